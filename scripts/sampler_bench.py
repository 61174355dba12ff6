"""``sample()`` alone (engine/sampling.py): the fast path against the reference, ms per call of this thread's CPU time
(``time.thread_time``, robust to other tenants), median of ``--repeats`` interleaved calls, one torch thread:

    PYTHONPATH=src .venv/bin/python scripts/sampler_bench.py
    PYTHONPATH=src .venv/bin/python scripts/sampler_bench.py --rows 8 32 --top-p 1.0 0.95 --dtype float32 bfloat16

The logits are ``randn × --scale`` (0.5: flat like the tiny preset's random weights, so top-p 0.95 keeps most of
the vocabulary and the reference sorts whole rows); every call's tokens must agree with the reference's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from grserve.engine.sampling import SampleRow, SamplingParams, sample
from grserve.model.cpu_support import cpu_support


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, nargs="+", default=[1.0, 0.95])
    ap.add_argument("--dtype", nargs="+", default=["float32"])
    ap.add_argument("--scale", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"# {cpu_support().label()}; torch {torch.__version__}, 1 thread; vocab {args.vocab}, temperature "
          f"{args.temperature}, logits randn × {args.scale}; load {os.getloadavg()[0]:.2f}")
    print("| rows | dtype | top_p | reference ms | fast ms | × |\n|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for B in args.rows:
        base = torch.randn(B, args.vocab, generator=g) * args.scale
        for dt in args.dtype:
            logits = base.to(getattr(torch, dt))
            for top_p in args.top_p:
                times: dict[bool, list[float]] = {True: [], False: []}
                for rep in range(args.repeats + 1):
                    rows = [SampleRow(SamplingParams(temperature=args.temperature, top_p=top_p), seed=i,
                                      position=rep) for i in range(B)]
                    toks = {}
                    for ref in (True, False):
                        t = time.thread_time()
                        toks[ref] = sample(logits, rows, reference=ref).token_ids
                        if rep:  # the first call warms up (the fast path's scratch buffers)
                            times[ref].append(time.thread_time() - t)
                    assert toks[True] == toks[False], "the fast path disagrees with the reference"
                r, f = (statistics.median(times[k]) * 1e3 for k in (True, False))
                print(f"| {B} | {dt} | {top_p} | {r:.2f} | {f:.2f} | {r / f:.1f} |", flush=True)
    print(f"# load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
