"""How the cluster's Ray is secured (issue 25; docs/cluster.md, "How Ray is secured").

Started here (``local_ray_env`` around ``ray.init``): loopback only — Ray binds its gRPC servers to 127.0.0.1 when
that is the node address, but its Python layer maps 127.0.0.1 to the machine's address
(``services.resolve_ip_for_localhost``) unless its local-only mode is on (``ray_constants.ENABLE_RAY_CLUSTER``
False), so it is, for the ``ray.init`` only — and a token: ``RAY_AUTH_MODE=token`` with a fresh random
``RAY_AUTH_TOKEN`` in the environment Ray's processes inherit, never written to a file.

Joined (``--ray-address``): ``check_joined`` connects a GCS client *without* a token (a subprocess: Ray's auth mode
is per process); ``AuthenticationError`` means the cluster requires tokens. An open cluster is refused
(``OpenRay``) unless ``--allow-open-ray``, or warned about when its GCS is on loopback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import subprocess
import sys

log = logging.getLogger("grserve.cluster")

_PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1])
except Exception as exc:  # AuthenticationError: the cluster asks for a token
    print(type(exc).__name__)
else:
    print("open")
"""


class OpenRay(ValueError):
    """A Ray cluster to join accepts clients without a token (the CLI: ``grserve: error: --ray-address: …``)."""


@contextlib.contextmanager
def local_ray_env():
    """Around the ``ray.init`` that starts a local Ray: loopback only, a fresh token (module docstring)."""
    from ray._private import ray_constants
    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    Config.initialize("")  # this process's Ray config and token cache follow the environment now
    AuthenticationTokenLoader.instance().reset_cache()
    before, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        yield "127.0.0.1"
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before  # later joins of other clusters resolve addresses as usual


def check_joined(address: str, allow_open: bool = False) -> str:
    """Whether the Ray cluster at ``address`` requires a token: "token", or "open" (warned about). Raises
    ``OpenRay`` for an open cluster off this machine unless ``allow_open``."""
    if "://" in address or ":" not in address:  # Ray Client, "auto": no GCS address to ask
        log.warning("grserve: cannot check how the Ray cluster at %s is secured (give its GCS host:port)", address)
        return "unknown"
    gcs = address
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env["RAY_AUTH_MODE"] = "disabled"
    out = subprocess.run([sys.executable, "-c", _PROBE, gcs], env=env, capture_output=True, text=True,
                         timeout=120).stdout.strip().splitlines()
    if out and out[-1] == "AuthenticationError":
        return "token"
    if not out or out[-1] != "open":
        why = out[-1] if out else "no answer"
        raise OpenRay(f"--ray-address: could not check how the Ray cluster at {gcs} is secured: {why}")
    loopback = gcs.startswith(("127.", "localhost:", "[::1]"))
    if not (loopback or allow_open):
        raise OpenRay(f"--ray-address: the Ray cluster at {gcs} accepts clients without a token: anyone who "
                      "reaches it can run code in it. Start it with RAY_AUTH_MODE=token (and give grserve its token: "
                      "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), or pass --allow-open-ray")
    log.warning("grserve: the Ray cluster at %s accepts clients without a token (%s)", gcs,
                "loopback: every user of this machine can run code in it" if loopback else "--allow-open-ray")
    return "open"
