"""Set-associative embedding cache in front of an embedding table, with DLRM SparseLengthsSum lookups.

Like HugeCTR's SlabHash cache as used by LCR (§4.1): every id hashes to one set of ``ways`` slots (64 = two
slabs of 32) and each set runs its *own* eviction-policy instance (LARU: its own phases, O, λ and record). The
cached rows live in one preallocated ``[num_sets·ways, dim]`` buffer (the "HBM" copy); a miss reads the backing
table (the "DRAM"/Redis stand-in) and writes the row into the slot the policy freed.

``sparse_length_sum(indices, offsets)`` pools bags like ``torch.nn.EmbeddingBag(mode="sum")`` and is exactly the
direct table lookup. Hit rate counts every looked-up id (before deduplication); within one batch each distinct
id is resolved once (first occurrence decides hit/miss, later occurrences count as hits) — decision on digest
§11.18.

Logical time (digest §11.10), ``clock=``: ``"batch"`` gives every id of one lookup call the same tick (one tick
per batch); ``"lookup"`` gives a distinct id the tick of its first occurrence in the stream of looked-up ids (the
clock advances by the batch's length); ``"id"`` gives each distinct id of a batch its own tick (the clock
advances by the number of distinct ids). ``access_times`` returns the ticks a trace's ids will be resolved at
under a clock, i.e. the future an oracle needs. Default ``"lookup"``: with ``"batch"`` every id of a batch shares
one tick, so an oracle's next-request times tie within a batch, Line 25 breaks those ties by recency, and LARU
with the exact oracle fires Line 14 and falls short of Belady (docs/results/eviction.md, "DLRM at p = 1").
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from grserve.eviction.policy import EvictionPolicy, make_policy


CLOCKS = ("batch", "lookup", "id")


def _first_occurrences(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(distinct ids in first-occurrence order, their first positions, order, inverse) of one batch."""
    uniq, first, inv = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    return uniq[order], first[order], order, inv


def _ticks(clock: str, base: int, n_ids: int, first: np.ndarray) -> tuple[np.ndarray, int]:
    """The tick of each distinct id of a batch (in first-occurrence order) and the clock after the batch."""
    if clock == "batch":
        return np.full(len(first), base, dtype=np.int64), base + 1
    if clock == "lookup":
        return base + first, base + n_ids
    return base + np.arange(len(first), dtype=np.int64), base + len(first)


def access_times(id_batches: Any, clock: str = "lookup") -> dict[int, list[int]]:
    """key -> sorted ticks at which ``EmbeddingCache(clock=clock)`` resolves it, for this sequence of lookups."""
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
    times: dict[int, list[int]] = {}
    now = 0
    for ids in id_batches:
        ids_np = np.asarray(ids, dtype=np.int64).reshape(-1)
        uniq_o, first_o, _, _ = _first_occurrences(ids_np)
        ticks, now = _ticks(clock, now, len(ids_np), first_o)
        for key, t in zip(uniq_o.tolist(), ticks.tolist()):
            times.setdefault(key, []).append(t)
    return times


def _set_of(ids: np.ndarray, num_sets: int) -> np.ndarray:
    """Multiplicative hash of the id to a set (spreads consecutive ids)."""
    with np.errstate(over="ignore"):
        h = ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return ((h >> np.uint64(32)) % np.uint64(num_sets)).astype(np.int64)


class EmbeddingCache:
    def __init__(self, table: torch.Tensor | np.ndarray, num_sets: int, ways: int = 64,
                 policy: str | Callable[[int, int], EvictionPolicy] = "lru", clock: str = "lookup", **policy_kw: Any):
        """``policy``: a registry name (each set gets ``make_policy(name, ways, **policy_kw)``) or a factory
        ``f(set_index, ways) -> EvictionPolicy`` (e.g. to give every set its own predictor view). ``clock``: one of
        ``CLOCKS`` (module docstring)."""
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
        self.clock_kind = clock
        self.table = torch.as_tensor(table)
        if self.table.dim() != 2:
            raise ValueError("table must be [num_rows, dim]")
        self.num_sets, self.ways = num_sets, ways
        self.dim = self.table.shape[1]
        self.slots = torch.zeros(num_sets * ways, self.dim, dtype=self.table.dtype)
        if callable(policy):
            self.policies = [policy(s, ways) for s in range(num_sets)]
        else:
            self.policies = [make_policy(policy, ways, **policy_kw) for _ in range(num_sets)]
        self._slot_of: list[dict[int, int]] = [dict() for _ in range(num_sets)]  # id -> slot, per set
        self._free: list[list[int]] = [list(range(s * ways + ways - 1, s * ways - 1, -1)) for s in range(num_sets)]
        self.clock = 0
        self.hits = 0
        self.misses = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def _resolve(self, uniq: np.ndarray, sets: np.ndarray, ticks: np.ndarray) -> tuple[list[int], list[int], list[int],
                                                                          list[int], list[int]]:
        """Drive each set's policy for the distinct ids of a batch, in first-occurrence order.

        Returns (hit positions, hit slots, miss positions, miss ids, miss slots)."""
        hit_pos: list[int] = []
        hit_slots: list[int] = []
        miss_pos: list[int] = []
        miss_ids: list[int] = []
        miss_slots: list[int] = []
        for i, (key, s, now) in enumerate(zip(uniq.tolist(), sets.tolist(), ticks.tolist())):
            pol, where = self.policies[s], self._slot_of[s]
            slot = where.get(key)
            if slot is not None:
                pol.on_hit(key, now)
                hit_pos.append(i)
                hit_slots.append(slot)
                continue
            pol.on_miss(key, now)
            free = self._free[s]
            if free:
                slot = free.pop()
            else:
                slot = where.pop(pol.victim(now))
            where[key] = slot
            pol.on_insert(key, now)
            miss_pos.append(i)
            miss_ids.append(key)
            miss_slots.append(slot)
        return hit_pos, hit_slots, miss_pos, miss_ids, miss_slots

    def lookup(self, ids: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Rows for ``ids`` [n] -> [n, dim], through the cache (ticks per the cache's ``clock``).

        Hit rows are gathered from the slot buffer *before* this batch's misses overwrite slots, and miss rows come
        straight from the table, so a row evicted later in the same batch is still served correctly."""
        ids_np = np.asarray(ids, dtype=np.int64).reshape(-1)
        uniq_o, first_o, order, inv = _first_occurrences(ids_np)  # distinct ids resolve in first-occurrence order
        ticks, self.clock = _ticks(self.clock_kind, self.clock, len(ids_np), first_o)
        hit_pos, hit_slots, miss_pos, miss_ids, miss_slots = self._resolve(
            uniq_o, _set_of(uniq_o, self.num_sets), ticks)
        rows = torch.empty(len(uniq_o), self.dim, dtype=self.table.dtype)
        if hit_pos:
            rows[torch.as_tensor(hit_pos)] = self.slots[torch.as_tensor(hit_slots)]
        if miss_pos:
            fetched = self.table[torch.as_tensor(miss_ids)]
            rows[torch.as_tensor(miss_pos)] = fetched
            # write back into the freed slots; a slot reused twice in the batch keeps its last owner
            last: dict[int, int] = {}
            for j, slot in enumerate(miss_slots):
                last[slot] = j
            keep = torch.as_tensor(list(last.values()))
            self.slots[torch.as_tensor(list(last.keys()))] = fetched[keep]
        self.misses += len(miss_ids)
        self.hits += len(ids_np) - len(miss_ids)
        back = np.empty(len(uniq_o), dtype=np.int64)
        back[order] = np.arange(len(uniq_o))
        return rows[torch.as_tensor(back[inv.reshape(-1)])]

    def sparse_length_sum(self, indices: torch.Tensor | np.ndarray, offsets: torch.Tensor | np.ndarray) -> torch.Tensor:
        """DLRM SLS: out[b] = Σ table[indices[offsets[b]:offsets[b+1]]] (EmbeddingBag mode='sum' offsets)."""
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        off = torch.as_tensor(np.asarray(offsets, dtype=np.int64))
        rows = self.lookup(idx.numpy())
        seg = torch.bucketize(torch.arange(len(idx)), off, right=True) - 1
        out = torch.zeros(len(off), self.dim, dtype=rows.dtype)
        out.index_add_(0, seg, rows)
        return out


def sparse_length_sum_reference(table: torch.Tensor, indices: Any, offsets: Any) -> torch.Tensor:
    """The uncached reference: a direct ``embedding_bag`` over the full table."""
    return torch.nn.functional.embedding_bag(torch.as_tensor(np.asarray(indices, dtype=np.int64)),
                                             torch.as_tensor(table),
                                             torch.as_tensor(np.asarray(offsets, dtype=np.int64)), mode="sum")
