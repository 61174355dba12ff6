"""The offline API against the server on the same requests: users/s of ``Recommender.recommend`` and of
``POST /v1/recommend`` (a ``grserve serve`` subprocess on 127.0.0.1, ``--concurrency`` clients at once), and whether
the answers are identical.

    .venv/bin/python scripts/offline_vs_server.py --users 400 --history 40 --beam-width 50 --concurrency 64

The model is a preset (seeded random weights: speed does not depend on the weights); the catalog is generated with
the MovieLens demo's shape (1,682 items, depth 3) unless ``--catalog`` names one. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def requests_of(item_ids: np.ndarray, users: int, history: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"history_items": rng.choice(item_ids, history, replace=False).tolist()} for _ in range(users)]


def offline(args, catalog: str, reqs: list[dict]) -> tuple[float, list[list[int]]]:
    from grserve.recommender import Recommender

    with Recommender(model=args.model, catalog=catalog, beam_width=args.beam_width, seed=0,
                     max_batch_requests=args.max_batch_requests) as rec:
        rec.recommend(reqs[: args.max_batch_requests], top_n=args.top_n, progress=False)  # warm
        t0 = time.perf_counter()
        out = rec.recommend(reqs, top_n=args.top_n, progress=False)
        return len(reqs) / (time.perf_counter() - t0), [r.item_ids for r in out]


async def _clients(url: str, reqs: list[dict], top_n: int, concurrency: int) -> list[list[int]]:
    import httpx

    answers: list[list[int]] = [[] for _ in reqs]
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(reqs)):
        queue.put_nowait(i)

    async def worker(client):
        while not queue.empty():
            i = queue.get_nowait()
            r = await client.post(url, json={**reqs[i], "top_n": top_n})
            r.raise_for_status()
            answers[i] = [it["item_id"] for it in r.json()["items"]]

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return answers


def server(args, catalog: str, reqs: list[dict]) -> tuple[float, list[list[int]]]:
    cmd = [sys.executable, "-m", "grserve.cli", "serve", "--model", args.model, "--catalog", catalog,
           "--beam-width", str(args.beam_width), "--seed", "0", "--host", "127.0.0.1", "--port", str(args.port),
           "--max-batch-requests", str(args.max_batch_requests), "--log-level", "warning",
           *args.server_flags.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{args.port}"
    try:
        import httpx

        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).json().get("status") == "ok":
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        asyncio.run(_clients(url + "/v1/recommend", reqs[: args.max_batch_requests], args.top_n,
                             args.concurrency))  # warm
        t0 = time.perf_counter()
        answers = asyncio.run(_clients(url + "/v1/recommend", reqs, args.top_n, args.concurrency))
        return len(reqs) / (time.perf_counter() - t0), answers
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--catalog", default=None)
    p.add_argument("--users", type=int, default=400)
    p.add_argument("--history", type=int, default=40)
    p.add_argument("--beam-width", type=int, default=50)
    p.add_argument("--top-n", type=int, default=10)
    p.add_argument("--max-batch-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--port", type=int, default=18310)
    p.add_argument("--skip-server", action="store_true")
    p.add_argument("--server-flags", default="", help="more grserve serve flags, e.g. '--no-engine-process'")
    args = p.parse_args()
    from grserve.catalog import generate_catalog, load_catalog, save_catalog

    with tempfile.TemporaryDirectory() as tmp:
        catalog = args.catalog or str(Path(tmp) / "catalog.jsonl")
        if args.catalog is None:
            save_catalog(generate_catalog(1682, 3, 16, seed=0), catalog)
        reqs = requests_of(load_catalog(catalog).item_ids, args.users, args.history, seed=1)
        off, off_items = offline(args, catalog, reqs)
        out = {"users": args.users, "history": args.history, "beam_width": args.beam_width, "model": args.model,
               "offline_users_per_s": round(off, 1), "load_avg": os.getloadavg()[0]}
        if not args.skip_server:
            srv, srv_items = server(args, catalog, reqs)
            out |= {"server_req_per_s": round(srv, 1), "concurrency": args.concurrency,
                    "server_flags": args.server_flags, "server_vs_offline": round(srv / off, 3),
                    "identical_answers": sum(a == b for a, b in zip(off_items, srv_items))}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
