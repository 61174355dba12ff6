"""Cluster start-up progress: wait for the instance actors' ``info()`` (an instance answers once its engine is built
and warmed up) and say, per instance, when it is ready; while some are still building, say which every
``STILL_WAITING_S`` seconds. A start of several instances takes tens of seconds (issue 26: 35–63 s), and a
silent front end cannot be told from a hung one."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

STILL_WAITING_S = 10.0


def print_progress(line: str) -> None:
    print(f"grserve: {line}", file=sys.stderr, flush=True)


def wait_ready(actors: list[Any], progress: Callable[[str], None] = print_progress,
               every_s: float = STILL_WAITING_S) -> list[Any]:
    """Every actor's ``info()``, in actor order; an actor whose start failed raises its error here."""
    import ray

    t0 = time.perf_counter()
    refs = [a.info.remote() for a in actors]
    index = {ref: i for i, ref in enumerate(refs)}
    infos: list[Any] = [None] * len(refs)
    pending = list(refs)
    progress(f"starting {len(refs)} instance(s): each builds its engine and warms it up")
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=every_s)
        for ref in done:
            i = index[ref]
            infos[i] = ray.get(ref)
            progress(f"instance {i} ready after {time.perf_counter() - t0:.1f} s "
                     f"({len(refs) - len(pending)}/{len(refs)})")
        if not done:
            waiting = ", ".join(str(index[r]) for r in pending)
            progress(f"still starting after {time.perf_counter() - t0:.0f} s: instance(s) {waiting}")
    return infos
