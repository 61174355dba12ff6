"""Retrieval warm-up: one untimed batch per (beam width, batch bucket) before the engine takes requests.

The first batch of a shape pays for set-up the later ones do not: torch's first kernels and allocations, the mask
thread, and on the device fast path the bucket's static buffers and its CUDA-graph capture per level
(``engine/device_runner.py``). Left to the first request, that cost is a user's latency (issue 26: ~4 s for the
first request, 0.5–1 s for the next). ``warm_up`` runs the plan before ``start()`` opens the queue, so ``/health``
says ``ok`` only when the configured shapes are warm.

The plan: every beam width of ``SearchConfig.warmup_beam_widths`` (default: the server's ``--beam-width``) × every
batch bucket — the device runner's ``--batch-buckets`` up to ``--max-batch-requests``; the host-driven runner has
no buckets, so one batch of one request. The prompt is catalog items laid out as a ``history_items`` request lays
them out: within one prompt bucket on the device path (``--prompt-bucket``; longer prompts capture their bucket on
first use), about 16 items on the host path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from grserve.flags import split_commas

HOST_WARMUP_ITEMS = 16


@dataclass(frozen=True)
class WarmupRun:
    beam_width: int
    batch: int  # requests in the warm-up batch (a bucket on the device path)
    prompt_tokens: int
    seconds: float


def warmup_beam_widths(search: Any) -> list[int]:
    """The beam widths to warm: ``--warmup-beam-widths``, else the default ``--beam-width``."""
    if search.warmup_beam_widths:
        return sorted(set(split_commas(search.warmup_beam_widths, int)))
    return [int(search.beam_width)]


def warmup_plan(runner: Any, search: Any, scheduler: Any, catalog: Any) -> list[tuple[int, int, int]]:
    """(beam width, batch, prompt tokens) of every warm-up batch."""
    depth = int(catalog.depth)
    buckets = getattr(runner, "buckets_r", None)
    if buckets:  # the device fast path: one bucket per (batch bucket, beam width)
        batches = [b for b in buckets if b <= scheduler.max_batch_requests] or [min(buckets)]
        prompt = max(depth, runner.accel.prompt_bucket // depth * depth)
    else:
        batches, prompt = [1], HOST_WARMUP_ITEMS * depth
    widths = [bw for bw in warmup_beam_widths(search) if bw <= search.max_beam_width]
    return [(bw, r, prompt) for bw in widths for r in batches]


def warm_up(runner: Any, catalog: Any, plan: list[tuple[int, int, int]],
            log: Callable[[str], None] | None = None) -> list[WarmupRun]:
    """Run the plan's batches through ``runner`` (results discarded); ``log`` gets one line per batch."""
    runs = []
    rows = np.arange(len(catalog))
    layout = catalog.layout
    per_item = catalog.depth + (layout.sid_begin is not None) + (layout.sid_end is not None)
    for k, (bw, r, prompt_tokens) in enumerate(plan, 1):
        n_items = max(1, (prompt_tokens - (layout.sid_begin is not None)) // per_item)
        items = rows[(np.arange(n_items) + k) % rows.size]
        prompt = layout.items_to_tokens(catalog.sids[items])  # as a request's history_items lays them out
        if layout.sid_begin is not None:
            prompt = np.append(prompt, layout.sid_begin)  # where the beams start
        t = time.perf_counter()
        runner.run([prompt] * r, bw, [1] * r, catalog)
        runs.append(WarmupRun(bw, r, int(prompt.size), time.perf_counter() - t))
        if log is not None:
            log(f"warm-up {k}/{len(plan)}: beam width {bw}, batch {r}, {prompt.size} prompt tokens: "
                f"{runs[-1].seconds:.2f} s")
    return runs
