"""Million-item catalogs (issue 27, item 4): load time and memory of the compact and the text format, and hot reloads
of such a catalog under load.

    PYTHONPATH=src python scripts/catalog_scale.py                      # RecIF shape: 1.5 M items, depth 4, 8,192
    PYTHONPATH=src python scripts/catalog_scale.py --num-items 50000 --codebook-size 512 --load-seconds 10

1. generates a RecIF-like catalog (``catalog/recif_like.py``) and writes it as ``.grcat`` and ``.jsonl``;
2. loads each file in a fresh process: seconds and extra RSS (peak resident memory during the load minus the
   resident memory just before it, the imports done);
3. serves it: a ``RetrievalEngine`` (preset ``tiny``, its vocabulary grown to the SID tokens) under closed-loop
   load from ``--clients`` threads, while the catalog is reloaded from the ``.grcat`` file every ``--reload-every``
   seconds (load + swap, alternating two catalogs of the same shape); every request must succeed and return only
   items of the catalog version it reports.

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

_MEASURE = """
import resource, sys, time
def rss(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
from grserve.catalog import load_catalog
before = rss('VmRSS:')
t = time.perf_counter()
cat = load_catalog(sys.argv[1])
print(time.perf_counter() - t, rss('VmHWM:') - before, len(cat))
"""


def measure_load(path: Path) -> dict:
    """Seconds and extra peak RSS of ``load_catalog(path)`` in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True, check=True)
    seconds, extra, n = out.stdout.split()
    return {"seconds": float(seconds), "extra_rss_mb": int(extra) / 2**20, "items": int(n),
            "file_mb": path.stat().st_size / 2**20}


def _client(engine, stop: threading.Event, prompts, stats: dict, lock: threading.Lock, catalogs: dict) -> None:
    from grserve.engine.types import RetrievalRequest

    k = 0
    while not stop.is_set():
        t = time.perf_counter()
        try:
            res = engine.submit(RetrievalRequest(prompts[k % len(prompts)], 16, 10)).future.result(timeout=300)
            cat = catalogs[res.catalog_version]
            ok = bool(res.items) and bool(cat.contains_sids(np.array([it.sid for it in res.items])).all())
        except Exception as exc:  # noqa: BLE001 - counted, the run goes on
            ok = False
            stats.setdefault("errors", []).append(repr(exc)[:200])
        with lock:
            stats["served" if ok else "failed"] = stats.get("served" if ok else "failed", 0) + 1
            stats.setdefault("latency_ms", []).append((time.perf_counter() - t) * 1e3)
        k += 1


def reload_under_load(paths: list[Path], args) -> dict:
    from grserve_bench.workload import history_prompts
    from grserve.catalog import CatalogStore, load_catalog
    from grserve.config import SchedulerConfig, SearchConfig
    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.model import load_model

    first = load_catalog(paths[0])
    model = load_model("tiny", min_vocab=first.layout.num_tokens)
    store = CatalogStore(first, vocab_size=model.spec.vocab_size)
    catalogs = {first.version: first}
    engine = RetrievalEngine(model, store, SearchConfig(), SchedulerConfig(max_inflight_batches=2)).start()
    prompts = history_prompts(first, 32, 128, seed=1)
    stop, lock, stats = threading.Event(), threading.Lock(), {}
    threads = [threading.Thread(target=_client, args=(engine, stop, prompts, stats, lock, catalogs), daemon=True)
               for _ in range(args.clients)]
    for th in threads:
        th.start()
    reloads, t_end = [], time.perf_counter() + args.load_seconds
    try:
        while time.perf_counter() < t_end:
            time.sleep(args.reload_every)
            t = time.perf_counter()
            new = load_catalog(paths[1 + len(reloads) % 2])  # the same items again, then other items
            catalogs[store.version + 1] = new  # registered before the swap: a request may see it at once
            store.replace(new)
            reloads.append(time.perf_counter() - t)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=600)
        engine.stop()
    lat = stats.get("latency_ms", [])
    return {"reloads": len(reloads), "reload_seconds_max": max(reloads, default=0.0),
            "served": stats.get("served", 0), "failed": stats.get("failed", 0),
            "p50_ms": float(np.percentile(lat, 50)) if lat else None,
            "p99_ms": float(np.percentile(lat, 99)) if lat else None, "errors": stats.get("errors", [])[:3]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-items", type=int, default=1_500_000)
    p.add_argument("--codebook-size", type=int, default=8192)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--skip-jsonl", action="store_true", help="do not write and load the .jsonl form")
    p.add_argument("--load-seconds", type=float, default=60.0, help="how long the reload-under-load phase runs")
    p.add_argument("--reload-every", type=float, default=10.0, help="seconds between reloads")
    p.add_argument("--clients", type=int, default=4)
    args = p.parse_args()

    from grserve.catalog import generate_catalog, save_catalog

    out: dict = {"num_items": args.num_items, "codebook_size": args.codebook_size, "depth": args.depth}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        t = time.perf_counter()
        cats = [generate_catalog(args.num_items, args.depth, args.codebook_size, seed=s) for s in (0, 1)]
        out["generate_seconds"] = (time.perf_counter() - t) / 2
        paths = [d / "a.grcat", d / "a2.grcat", d / "b.grcat"]
        save_catalog(cats[0], paths[0])
        save_catalog(cats[0], paths[1])
        save_catalog(cats[1], paths[2])
        out["grcat"] = measure_load(paths[0])
        if not args.skip_jsonl:
            save_catalog(cats[0], d / "a.jsonl")
            out["jsonl"] = measure_load(d / "a.jsonl")
        del cats
        out["reload_under_load"] = reload_under_load(paths, args)
    print(json.dumps(out))
    return 0 if out["reload_under_load"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
