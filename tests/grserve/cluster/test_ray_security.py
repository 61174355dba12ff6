"""How the cluster's Ray is secured (``cluster/core/ray_security.py``, issue 25), without starting a Ray: the
arguments and environment of the local Ray's ``ray.init``, and the decision on a cluster to join from what the
token-less probe client saw. On a real Ray: ``test_cluster_ray.py::test_ray_listens_on_loopback_only_and_asks_for_a_
token`` (no listening socket outside loopback; the GCS refuses a client without the token)."""

from __future__ import annotations

import logging
import subprocess

import pytest

ray = pytest.importorskip("ray")

from grserve.cluster.core import ray_runtime, ray_security  # noqa: E402
from grserve.cluster.core.ray_security import OpenRay, check_joined  # noqa: E402


@pytest.fixture
def fake_ray(monkeypatch):
    """``ray.init`` recorded, not run; the auth environment restored afterwards."""
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    calls: list[dict] = []

    def init(**kw):
        from ray._private import ray_constants

        calls.append({**kw, "local_only": not ray_constants.ENABLE_RAY_CLUSTER, "mode": _env("RAY_AUTH_MODE"),
                      "token": _env("RAY_AUTH_TOKEN")})

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    return calls


def _env(name):
    import os

    return os.environ.get(name)


def test_the_local_ray_binds_loopback_with_a_fresh_token(fake_ray, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # an operator's opt-out does not apply to grserve's own Ray
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/nonexistent")
    from ray._private import ray_constants

    assert ray_runtime.start_ray(None) and ray_runtime.start_ray(None, dashboard=True)
    a, b = fake_ray
    assert a["_node_ip_address"] == "127.0.0.1" and a["local_only"] and a["address"] == "local"
    assert a["mode"] == "token" and len(a["token"]) == 64 and int(a["token"], 16) >= 0
    assert b["token"] != a["token"]  # a new token for every Ray started
    assert (a["include_dashboard"], b["include_dashboard"]) == (False, True)  # no dashboard unless asked
    assert ray_constants.ENABLE_RAY_CLUSTER  # only around ray.init: joining another cluster resolves as usual
    assert _env("RAY_AUTH_TOKEN_PATH") is None


def _probe_says(monkeypatch, out: str) -> list:
    seen = []

    def run(cmd, env, **kw):
        seen.append(env)
        return subprocess.CompletedProcess(cmd, 0, stdout=out + "\n", stderr="")

    monkeypatch.setattr(ray_security.subprocess, "run", run)
    return seen


def test_joining_asks_whether_the_cluster_requires_a_token(monkeypatch, caplog):
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    seen = _probe_says(monkeypatch, "AuthenticationError")
    assert check_joined("10.1.2.3:6379") == "token"
    assert seen[0]["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN" not in seen[0]  # the probe has no token
    _probe_says(monkeypatch, "open")
    with pytest.raises(OpenRay, match="--ray-address: the Ray cluster at 10.1.2.3:6379 accepts clients without"):
        check_joined("10.1.2.3:6379")
    with caplog.at_level(logging.WARNING, logger="grserve.cluster"):
        assert check_joined("10.1.2.3:6379", allow_open=True) == "open"
        assert check_joined("127.0.0.1:6379") == "open"  # on loopback: a warning, not a refusal
    assert "--allow-open-ray" in caplog.text and "every user of this machine" in caplog.text
    _probe_says(monkeypatch, "ConnectionError")
    with pytest.raises(OpenRay, match="could not check"):
        check_joined("10.1.2.3:6379")


def test_a_refused_cluster_is_never_joined(fake_ray, monkeypatch):
    _probe_says(monkeypatch, "open")
    with pytest.raises(OpenRay):
        ray_runtime.start_ray("10.1.2.3:6379")
    assert fake_ray == []
    _probe_says(monkeypatch, "AuthenticationError")
    assert not ray_runtime.start_ray("10.1.2.3:6379")  # joined: not ours to shut down
    assert fake_ray[0]["address"] == "10.1.2.3:6379"


def test_cli_flags():
    from grserve.cli import build_parser
    from grserve.server.ranking import command as ranking_main

    ns = build_parser().parse_args(["serve", "ranking", "--ray-address", "10.0.0.1:6379", "--allow-open-ray",
                                    "--ray-dashboard"])
    c = ranking_main.config_from_args(ns).cluster
    assert c.allow_open_ray and c.ray_dashboard
    c = ranking_main.config_from_args(build_parser().parse_args(["serve", "ranking"])).cluster
    assert not c.allow_open_ray and not c.ray_dashboard
