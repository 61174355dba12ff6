"""Cache traces read from files (``grserve bench cache --trace-file``).

Two formats, told apart by the first non-empty line:

* **JSONL, Mooncake style**: one JSON object per request with ``hash_ids`` (the ids of the request's prefix blocks,
  in order; a block's id fixes its whole prefix, so the ids form a prefix tree) and optionally ``timestamp``,
  ``input_length``, ``output_length``. Each request is a *path* of keys.
* **plain**: one key per line (any token; integers are read as ints). Each line is a request of one key, so the
  radix mode has no structure to use and equals the block mode.

``sample_requests`` keeps a prefix of the trace (the first n requests): sampled runs while iterating keep the
conversations whole, which a random subsample would not.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Hashable


@dataclass
class PathTrace:
    name: str
    paths: list[list[Hashable]]  # one key list per request
    format: str  # "jsonl" | "plain"

    @property
    def keys(self) -> list[Hashable]:
        return [k for p in self.paths for k in p]

    @property
    def accesses(self) -> int:
        return sum(len(p) for p in self.paths)

    @property
    def unique_keys(self) -> int:
        return len({k for p in self.paths for k in p})


def _plain_key(tok: str) -> Hashable:
    try:
        return int(tok)
    except ValueError:
        return tok


def load_trace(path: str, max_requests: int = 0) -> PathTrace:
    """Read a JSONL (``hash_ids``) or one-key-per-line trace; ``max_requests`` > 0 keeps only the first ones."""
    paths: list[list[Hashable]] = []
    fmt = None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            if fmt is None:
                fmt = "jsonl" if line.startswith("{") else "plain"
            if fmt == "jsonl":
                obj = json.loads(line)
                if "hash_ids" not in obj:
                    raise ValueError(f"{path}: a JSONL trace needs 'hash_ids' in every line")
                paths.append([int(h) for h in obj["hash_ids"]])
            else:
                paths.append([_plain_key(line.split()[0])])
            if max_requests and len(paths) >= max_requests:
                break
    if not paths:
        raise ValueError(f"{path}: empty trace")
    name = os.path.splitext(os.path.basename(path))[0]
    return PathTrace(name, paths, fmt or "plain")


def write_lcs_csv(keys: list[Hashable], path: str) -> None:
    """The flattened key sequence as libCacheSim's CSV (time, obj id), ids renumbered densely from 1."""
    ids: dict[Hashable, int] = {}
    with open(path, "w") as f:
        for t, k in enumerate(keys):
            i = ids.setdefault(k, len(ids) + 1)
            f.write(f"{t + 1},{i}\n")


LCS_ALGOS = ("ARC", "S3FIFO", "LIRS", "Cacheus", "LeCaR")


def libcachesim_available() -> bool:
    try:
        import libcachesim  # noqa: F401
    except ImportError:
        return False
    return True


def run_libcachesim(csv_path: str, algo: str, cache_size: int) -> tuple[float, float]:
    """(object hit rate, µs per access) of libCacheSim's ``algo`` on a CSV written by ``write_lcs_csv``.

    The time is the process CPU time of its C replay loop (including reading the CSV) over the accesses."""
    import time

    import libcachesim as lcs

    params = lcs.ReaderInitParam(has_header=False, has_header_set=True, delimiter=",", ignore_obj_size=True)
    params.time_field, params.obj_id_field = 1, 2
    reader = lcs.TraceReader(csv_path, lcs.TraceType.CSV_TRACE, params)
    cache = getattr(lcs, algo)(cache_size)
    t0 = time.process_time()
    miss_ratio = cache.process_trace(reader)[0]
    spent = time.process_time() - t0
    n = reader.get_num_of_req() if hasattr(reader, "get_num_of_req") else 0
    return 1.0 - miss_ratio, (1e6 * spent / n if n else float("nan"))
