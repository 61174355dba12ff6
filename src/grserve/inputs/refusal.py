"""The validators the retrieval and ranking routes share: user values (Python ints, possibly beyond int64) into
int64 arrays, or a 4xx ``ApiError`` naming the field (``field[i]``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from grserve.server.http.errors import ApiError

INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)
MAX_LISTED_IDS = 20


def _clip_int64(values: Any) -> Any:
    if isinstance(values, list):
        return [_clip_int64(v) for v in values]
    return min(max(values, INT64_MIN), INT64_MAX)


def int64_in_range(values: list, lo: int, hi: Any) -> tuple[np.ndarray, tuple[int, ...] | None]:
    """Python ints (a list, or a rectangular list of lists) → (int64 array, None), or (array, index of the first
    value outside [lo, hi)). ``hi`` may be per column. Ints beyond int64 count as out of range, never wrap."""
    try:
        arr = np.asarray(values, dtype=np.int64)
    except OverflowError:  # only on this rare path: a Python pass that saturates them
        arr = np.asarray(_clip_int64(values), dtype=np.int64)
    bad = (arr < lo) | (arr >= hi)
    if not bad.any():
        return arr, None
    return arr, tuple(int(x) for x in np.argwhere(bad)[0])


def token_ids(values: list[int], vocab_size: int, field: str) -> np.ndarray:
    """Token ids → int64 array; 400 ``out_of_range`` naming ``field[i]`` for the first one outside the vocab."""
    arr, bad = int64_in_range(values, 0, vocab_size)
    if bad is not None:
        i = bad[0]
        raise ApiError(400, f"{field}[{i}]: token {values[i]} is out of range [0, {vocab_size})", f"{field}[{i}]",
                       "out_of_range")
    return arr


def check_length(n: int, limit: int, field: str, what: str, type: str) -> None:
    """413 ``type`` when ``what`` has more than ``limit`` tokens."""
    if n > limit:
        raise ApiError(413, f"{field}: {what} has {n} tokens, more than the limit of {limit}", field, type)


def unknown_ids(field: str, values: Sequence[int], positions: Sequence[int], what: str, type: str) -> ApiError:
    """404 listing the distinct unknown ids (at most ``MAX_LISTED_IDS``); ``field`` names the first position."""
    if not positions:  # a batch lookup failed but no single id does: report the list
        return ApiError(404, f"{field}: unknown {what}s", field, type)
    ids = list(dict.fromkeys(values[k] for k in positions))
    shown = ", ".join(str(v) for v in ids[:MAX_LISTED_IDS]) + (", ..." if len(ids) > MAX_LISTED_IDS else "")
    first = positions[0]
    return ApiError(404, f"{field}: {len(ids)} unknown {what}{'s' if len(ids) != 1 else ''}: [{shown}] "
                         f"(first at {field}[{first}])", f"{field}[{first}]", type)
