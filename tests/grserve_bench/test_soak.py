"""``grserve bench soak``'s pieces: the RSS of a process tree read from /proc, the verdict against issue 41's goals,
the seeded request bodies, and (slow) a short run against a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from grserve_bench import soak

CHILD = ("import os, sys, time\n"
         "buf = bytearray(48 << 20)\n"  # 48 MiB, touched
         "for i in range(0, len(buf), 4096): buf[i] = 1\n"
         "sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(60)\n")


def test_rss_of_every_process_of_a_session(tmp_path):
    # a parent in its own session that starts a child holding 48 MiB: both are found, the child's RSS is seen
    parent = ("import subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, '-c', {CHILD!r}], stdout=subprocess.PIPE)\n"
              "p.stdout.readline(); print(p.pid, flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        assert soak.session_pids(proc.pid) == sorted([proc.pid, child])
        assert soak.tree_pids(proc.pid) == sorted([proc.pid, child])
        sampler = soak.RssSampler(lambda: soak.session_pids(proc.pid), proc.pid)
        now = sampler.sample(0.0)
        assert len(now) == 2 and f"front-end:{proc.pid}" in now
        child_key = next(k for k in now if k.endswith(f":{child}"))
        assert now[child_key] > 48
        (t, rss, anon), = sampler.series[child_key]
        assert t == 0.0 and rss > 48 and anon > 40
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert soak.memory_kib(proc.pid) is None


def _requests(minutes: float, lat_first: float, lat_last: float, status=200, per_s: int = 2):
    out = []
    end = minutes * 60
    for k in range(int(end * per_s)):
        t = k / per_s
        out.append((t, lat_first + (lat_last - lat_first) * t / end, status))
    return out


def test_verdict_passes_a_flat_run_and_fails_growth_drift_and_failures():
    series = {"front-end:1": [(t, 300.0, 200.0) for t in range(0, 3601, 60)],
              "engine-core:2": [(t, 1000.0 + (50.0 if t >= 300 else t / 6), 900.0) for t in range(0, 3601, 60)]}
    v = soak.verdict(_requests(60, 0.1, 0.11), series, 60, 5, 10)
    assert v["pass"], v["checks"]
    assert v["rss"]["engine-core:2"]["rss_start_mib"] == 1050 and v["rss"]["engine-core:2"]["growth"] == 0
    assert v["requests_first"] > 0 and v["requests_last"] > 0 and v["failed"] == {}

    grown = dict(series, **{"engine-core:2": [(t, 1000.0 + t / 10, 900.0) for t in range(0, 3601, 60)]})
    v = soak.verdict(_requests(60, 0.1, 0.1), grown, 60, 5, 10)
    assert not v["checks"]["rss_growth_below_10pct"] and v["checks"]["no_failures"]
    assert v["worst_rss_growth"] == pytest.approx(1360 / 1030 - 1, abs=1e-3)

    v = soak.verdict(_requests(60, 0.1, 0.2), series, 60, 5, 10)
    assert not v["checks"]["p99_last_within_1_2x_first"] and v["p99_drift"] > 1.2

    reqs = _requests(60, 0.1, 0.1) + [(100.0, 0.0, 503), (200.0, 0.0, "ConnectionResetError")]
    v = soak.verdict(reqs, series, 60, 5, 10)
    assert v["failed"] == {"503": 1, "ConnectionResetError": 1} and not v["pass"]

    # an engine core that died half way (a restart: a new pid takes over) fails the memory check
    died = dict(series, **{"engine-core:3": [(t, 900.0, 800.0) for t in range(0, 1801, 60)]})
    v = soak.verdict(_requests(60, 0.1, 0.1), died, 60, 5, 10)
    assert v["processes_gone"] == ["engine-core:3"] and not v["checks"]["rss_growth_below_10pct"]


def test_windows_scale_and_percentiles():
    assert soak.default_windows(60) == (5, 10)
    assert soak.default_windows(120) == (5, 10)
    assert soak.default_windows(30) == (5, 5)
    assert soak.default_windows(12) == (2, 2)
    assert soak.percentile([], 99) is None
    xs = list(range(1, 101))
    assert soak.percentile(xs, 50) == 50 and soak.percentile(xs, 99) == 99 and soak.percentile(xs, 100) == 100
    w = soak.windows(_requests(3, 0.1, 0.1) + [(61.0, 0.0, 500)], 60, 180)
    assert [x["from_s"] for x in w] == [0, 60, 120]
    assert w[1]["failed"] == 1 and w[0]["failed"] == 0 and w[0]["p50_ms"] == 100.0


def test_bodies_are_seeded_and_in_range():
    facts = {"vocab_size": 32000, "catalog": {"codebook_sizes": [256, 256, 256]}, "num_users": 200,
             "num_items": 2000, "model": "tiny"}
    a = [soak.Bodies("retrieval", facts, 1).next() for _ in range(1)]
    assert a == [soak.Bodies("retrieval", facts, 1).next()]
    b = soak.Bodies("retrieval", facts, 7)
    seen_bw = set()
    for _ in range(200):
        body = b.next()
        assert 4 <= len(body["history_tokens"]) <= 300
        assert all(16 <= t < 16 + 768 for t in body["history_tokens"])
        assert body["top_n"] <= body["beam_width"]
        seen_bw.add(body["beam_width"])
    assert seen_bw == {8, 32, 64}
    r = soak.Bodies("ranking", facts, 3, max_candidates=50)
    for _ in range(100):
        body = r.next()
        assert 0 <= body["user_id"] < 200 and 1 <= len(body["candidates"]) <= 50
        assert len(set(body["candidates"])) == len(body["candidates"]) and max(body["candidates"]) < 2000
    llm = soak.Bodies("llm", facts, 3)
    for _ in range(50):
        body = llm.next()
        assert body["model"] == "tiny" and 4 <= len(body["prompt"]) <= 512 and 1 <= body["max_tokens"] <= 128
    assert soak._flag_value("--num-users 50 --port=3", "--num-users", 200) == 50
    assert soak._flag_value("--num-items=7", "--num-items", 2000) == 7
    assert soak._flag_value("", "--num-items", 2000) == 2000


@pytest.mark.slow
def test_soak_command_runs_a_ranking_server(tmp_path):
    """Twenty seconds of ranking load on a small generated catalog: both server processes are sampled, no request
    fails, the report is written."""
    out = tmp_path / "soak.json"
    t = time.monotonic()
    rc = subprocess.run([sys.executable, "-m", "grserve", "bench", "soak", "--mode", "ranking", "--minutes", "0.34",
                         "--sample-s", "5", "--clients", "2", "--max-candidates", "16",
                         "--server-flags", "--num-items 200 --num-users 20", "--out", str(out),
                         "--log", str(tmp_path / "server.log"), "--startup-timeout", "300"],
                        capture_output=True, text=True, timeout=600,
                        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).returncode
    assert time.monotonic() - t < 600
    r = json.loads(out.read_text())
    v = r["verdict"]
    assert v["failed"] == {} and v["requests"] > 0, (rc, v)
    roles = {k.split(":")[0] for k in r["rss_series"]}
    assert {"front-end", "engine-core"} <= roles
    assert all(len(s) >= 3 for k, s in r["rss_series"].items() if not k.startswith("resource-tracker"))
