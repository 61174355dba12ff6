#!/usr/bin/env python3
"""Fire N concurrent POST /v1/recommend requests at a running ``grserve serve`` and print one JSON line.

Standard library only (the GPU machines have no package index): one thread per in-flight request. Used by
``scripts/gpu-check.sh p2`` (200 concurrent requests against ``grserve serve --device cuda``); runs against a CPU
server too (``--requests 8 --history 20`` for a smoke test).

    python3 scripts/serve_load.py --url http://127.0.0.1:8765 --requests 200 --concurrency 200 --beam-width 256
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def wait_ready(url: str, timeout_s: float) -> float:
    """Seconds until GET /health answered 200 (warm-up included); raises TimeoutError past ``timeout_s``."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url}/health not ready after {timeout_s:.0f} s")


def one(url: str, body: dict, timeout_s: float) -> tuple[int, float, int]:
    """(HTTP status, seconds, items returned); status 0 for a connection error."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/recommend", data=data, headers={"content-type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            items = len(json.loads(r.read()).get("items", []))
            return r.status, time.perf_counter() - t, items
    except urllib.error.HTTPError as e:
        return e.code, time.perf_counter() - t, 0
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, time.perf_counter() - t, 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8765")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--beam-width", type=int, default=256)
    ap.add_argument("--top-n", type=int, default=10)
    ap.add_argument("--history", type=int, default=300, help="history items per request (3 SID tokens each)")
    ap.add_argument("--num-items", type=int, default=20000, help="the server's catalog size (item ids drawn below)")
    ap.add_argument("--ready-timeout", type=float, default=240.0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    ready_s = wait_ready(a.url, a.ready_timeout)
    rng = random.Random(a.seed)
    bodies = [{"history_items": [rng.randrange(a.num_items) for _ in range(a.history)], "beam_width": a.beam_width,
               "top_n": a.top_n} for _ in range(a.requests)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(a.concurrency) as pool:
        res = list(pool.map(lambda b: one(a.url, b, a.timeout), bodies))
    wall = time.perf_counter() - t0
    ok = [r for r in res if r[0] == 200]
    lat = sorted(r[1] * 1e3 for r in ok)
    statuses: dict[str, int] = {}
    for r in res:
        statuses[str(r[0])] = statuses.get(str(r[0]), 0) + 1
    out = {"benchmark": "serve_load", "url": a.url, "requests": a.requests, "concurrency": a.concurrency,
           "beam_width": a.beam_width, "history_items": a.history, "ready_s": round(ready_s, 1),
           "statuses": statuses, "ok": len(ok), "items_min": min((r[2] for r in ok), default=0),
           "wall_s": round(wall, 3), "req_per_s": round(len(ok) / wall, 2) if wall > 0 else None,
           "p50_ms": round(statistics.median(lat), 1) if lat else None,
           "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1) if lat else None}
    print(json.dumps(out), flush=True)
    return 0 if len(ok) == a.requests else 1


if __name__ == "__main__":
    sys.exit(main())
