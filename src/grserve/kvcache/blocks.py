"""Apt-Serve's unified block pool: one paged memory whose blocks hold K, V **or** hidden states (§4.3).

Granularity (the paper's key design point): one block holds *one* plane of the cache for ``block_size`` tokens
in every layer. A plane is ``width`` elements per token per layer, where ``width`` is the K (= V) row size,
``num_kv_heads × head_dim``. A request with n cached tokens holds

- ``kv`` cache (``kv_planes`` = 2: K and V):        2 · ⌈n/B⌉ blocks;
- ``hidden`` cache (the post-norm input x^ℓ of the QKV projection, ``hidden_size`` elements per token):
  ``hidden_planes`` · ⌈n/B⌉ blocks with ``hidden_planes = ⌈hidden_size / width⌉``; x is split into that many
  ``width``-sized slices (the last one zero-padded).

For multi-head attention (OPT, the paper's models) ``hidden_size == width`` so a hidden request holds half the
blocks of a KV one, exactly the paper's "half". For GQA ``hidden_planes ≥ 2`` and the hidden cache is at least as
large as K+V, so the scheduler (which only ever sees these block counts) never picks it.

``BlockPool`` is pure bookkeeping (no tensors): the schedulers' simulator and the engine share it.

Shared prefix blocks (``kvcache/shared_prefix.py``): a block may be held by several tables (requests whose prompts
start with the same full blocks) and by the prefix cache (``retain``/``release``). Every used block has a
reference count = tables holding it + 1 if the cache retains it; it returns to the free list when that reaches 0,
never before. Blocks only the cache holds are *reclaimable*: ``num_free`` counts them (the schedulers see them as
free) and ``reserve`` evicts them through the pool's ``reclaimer`` when the free list is short. What the schedulers
see: ``blocks_of(owner)`` is the table's size (its growth arithmetic), ``freeable_blocks(owner)`` the blocks its
release would free or make reclaimable (held by no other request), and ``shared_credit`` the blocks counted more
than once when summing the tables (Σ (request holders − 1)), which the engine adds to the total it reports.
``HybridCacheStorage`` is the tensor that backs it: ``data[layer, block·B + offset, width]``; a block is the same
rows in every layer.

Cache map: ``table.planes[p][g]`` is the block holding plane p of token group g (tokens g·B … g·B+B−1);
token t lives at (``planes[p][t // B]``, ``t % B``). Blocks of a request need not be contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Literal, Protocol

import torch

CacheKind = Literal["kv", "hidden"]
CACHE_KINDS: tuple[CacheKind, ...] = ("kv", "hidden")


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than an allocation needs (the pool is left unchanged)."""


@dataclass
class BlockTable:
    """One request's cache map: the cache kind, the blocks of each plane, and how many tokens are stored."""

    kind: CacheKind
    planes: list[list[int]]
    num_tokens: int = 0

    @property
    def num_blocks(self) -> int:
        return sum(len(p) for p in self.planes)


@dataclass
class BlockPool:
    """Free list + per-owner block tables over ``num_blocks`` blocks of ``block_size`` tokens.

    Invariants (tested with hypothesis): no block is owned twice; used + free == total; an owner of kind k with
    n tokens holds exactly ``planes(k) · ⌈n/B⌉`` blocks.
    """

    num_blocks: int
    block_size: int
    kv_planes: int = 2
    hidden_planes: int = 1
    _free: list[int] = field(default_factory=list, repr=False)
    _tables: dict[Hashable, BlockTable] = field(default_factory=dict, repr=False)
    _ref: dict[int, int] = field(default_factory=dict, repr=False)  # used block -> holders (tables + cache)
    _retained: set[int] = field(default_factory=set, repr=False)  # blocks the prefix cache holds
    reclaimer: "Reclaimer | None" = field(default=None, repr=False)
    shared_credit: int = 0  # Σ over blocks of (request holders − 1)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if self.hidden_planes <= 0:
            raise ValueError("hidden_planes must be positive")
        # Pop from the end: lowest ids are handed out first ("scan for unused blocks", Fig. 6).
        self._free = list(range(self.num_blocks - 1, -1, -1))

    @classmethod
    def for_model(cls, num_blocks: int, block_size: int, hidden_size: int, kv_width: int) -> "BlockPool":
        return cls(num_blocks, block_size, kv_planes=2, hidden_planes=-(-hidden_size // kv_width))

    # ------------------------------------------------------------------ sizes (what the schedulers see)
    def planes(self, kind: CacheKind) -> int:
        return self.kv_planes if kind == "kv" else self.hidden_planes

    def blocks_for(self, num_tokens: int, kind: CacheKind) -> int:
        """Blocks a ``kind`` cache of ``num_tokens`` tokens occupies."""
        return self.planes(kind) * (-(-num_tokens // self.block_size))

    def hidden_is_smaller(self) -> bool:
        return self.hidden_planes < self.kv_planes

    @property
    def num_free(self) -> int:
        """Blocks a reservation can get: the free list plus the blocks only the prefix cache holds."""
        return len(self._free) + (self.reclaimer.reclaimable() if self.reclaimer is not None else 0)

    @property
    def num_used(self) -> int:
        """Blocks not on the free list (tables and the prefix cache, each block once)."""
        return self.num_blocks - len(self._free)

    def request_holders(self, block: int) -> int:
        return self._ref.get(block, 0) - (block in self._retained)

    def freeable_blocks(self, owner: Hashable) -> int:
        """Blocks of ``owner`` that no other table holds (freed, or left to the cache, when it is freed)."""
        t = self._tables.get(owner)
        return 0 if t is None else sum(self.request_holders(b) == 1 for p in t.planes for b in p)

    # ------------------------------------------------------------------ owners
    def __contains__(self, owner: Hashable) -> bool:
        return owner in self._tables

    def table(self, owner: Hashable) -> BlockTable:
        return self._tables[owner]

    def owners(self) -> list[Hashable]:
        return list(self._tables)

    def blocks_of(self, owner: Hashable) -> int:
        t = self._tables.get(owner)
        return 0 if t is None else t.num_blocks

    def extra_blocks_for(self, owner: Hashable, num_tokens: int, kind: CacheKind) -> int:
        """Blocks that ``reserve(owner, num_tokens, kind)`` would take from the free list."""
        t = self._tables.get(owner)
        have = 0 if t is None or t.kind != kind else t.num_blocks
        return max(0, self.blocks_for(num_tokens, kind) - have)

    def reserve(self, owner: Hashable, num_tokens: int, kind: CacheKind) -> BlockTable:
        """Grow (or create) ``owner``'s table so it can hold ``num_tokens`` tokens of ``kind``.

        A table never shrinks here and never changes kind (free it first: the paper discards and recomputes).
        Raises OutOfBlocks, leaving the pool unchanged, if the free list is too short.
        """
        t = self._tables.get(owner)
        if t is not None and t.kind != kind:
            raise ValueError(f"owner {owner!r} holds a {t.kind} cache; free it before reserving {kind}")
        groups = -(-num_tokens // self.block_size)
        nplanes = self.planes(kind)
        have = 0 if t is None else len(t.planes[0])
        need = max(0, groups - have) * nplanes
        if need > len(self._free) and self.reclaimer is not None:
            self.reclaimer.reclaim(need - len(self._free))
        if need > len(self._free):
            raise OutOfBlocks(f"need {need} blocks, {len(self._free)} free")
        if t is None:
            t = BlockTable(kind, [[] for _ in range(nplanes)])
            self._tables[owner] = t
        for _ in range(max(0, groups - have)):
            for p in t.planes:
                b = self._free.pop()
                self._ref[b] = 1
                p.append(b)
        return t

    def attach(self, owner: Hashable, groups: list[tuple[int, ...]], kind: CacheKind = "kv") -> BlockTable:
        """Create ``owner``'s table holding the given shared token groups (one block per plane each) first."""
        if owner in self._tables:
            raise ValueError(f"owner {owner!r} already holds a table")
        nplanes = self.planes(kind)
        t = BlockTable(kind, [[] for _ in range(nplanes)])
        for g in groups:
            if len(g) != nplanes:
                raise ValueError(f"a {kind} group has {nplanes} blocks, got {len(g)}")
            for p, b in zip(t.planes, g):
                if self._ref.get(b, 0) < 1:
                    raise ValueError(f"block {b} is not in use: only held blocks can be shared")
                self.shared_credit += self.request_holders(b) >= 1
                self._ref[b] += 1
                p.append(b)
        self._tables[owner] = t
        return t

    def retain(self, blocks: tuple[int, ...] | list[int]) -> None:
        """The prefix cache holds these (in-use) blocks too."""
        for b in blocks:
            if self._ref.get(b, 0) < 1 or b in self._retained:
                raise ValueError(f"block {b}: retain needs a used block the cache does not hold yet")
            self._ref[b] += 1
            self._retained.add(b)

    def release(self, blocks: tuple[int, ...] | list[int]) -> None:
        """The prefix cache lets go of these blocks (freed if no table holds them)."""
        for b in blocks:
            self._retained.remove(b)
            self._drop(b)

    def _drop(self, b: int) -> None:
        r = self._ref[b] - 1
        if r:
            self._ref[b] = r
            if r == 1 and b in self._retained and self.reclaimer is not None:
                self.reclaimer.unpinned(b)
        else:
            del self._ref[b]
            self._free.append(b)

    def free(self, owner: Hashable) -> int:
        """Drop ``owner``'s table: each block goes back to the free list unless another table or the prefix cache
        still holds it (no-op for an unknown owner). Returns the number of blocks the table held."""
        t = self._tables.pop(owner, None)
        if t is None:
            return 0
        n = 0
        for p in t.planes:
            for b in reversed(p):
                self.shared_credit -= self.request_holders(b) >= 2
                self._drop(b)
            n += len(p)
        return n

    def check(self) -> None:
        """Assert the pool invariants (used by tests and debug runs): reference counts equal the holders, a block
        is free iff nobody holds it, used + free == total, and the shared credit equals Σ (request holders − 1)."""
        holders: dict[int, int] = {}
        for owner, t in self._tables.items():
            groups = {len(p) for p in t.planes}
            assert len(groups) == 1, f"{owner!r}: planes of different lengths"
            assert len(t.planes) == self.planes(t.kind)
            assert t.num_tokens <= len(t.planes[0]) * self.block_size
            own: set[int] = set()
            for p in t.planes:
                for b in p:
                    assert 0 <= b < self.num_blocks
                    assert b not in own, f"block {b} twice in {owner!r}"
                    own.add(b)
                    holders[b] = holders.get(b, 0) + 1
        credit = sum(h - 1 for h in holders.values())
        for b in self._retained:
            holders[b] = holders.get(b, 0) + 1
        assert holders == self._ref, "reference counts differ from the holders"
        free = set(self._free)
        assert len(free) == len(self._free), "free list has duplicates"
        assert not (free & set(holders)), "a block is both free and held"
        assert len(holders) + len(free) == self.num_blocks, "used + free != total"
        assert credit == self.shared_credit, f"shared credit {self.shared_credit} != {credit}"


class Reclaimer(Protocol):
    """The prefix cache as the pool sees it: blocks only it holds can be evicted on demand."""

    def reclaimable(self) -> int: ...

    def reclaim(self, n_blocks: int) -> int: ...

    def unpinned(self, block: int) -> None: ...


class HybridCacheStorage:
    """The tensor behind a BlockPool: ``data[L, num_blocks·B, width]`` (one plane row per token per layer)."""

    def __init__(self, pool: BlockPool, num_layers: int, width: int, hidden_size: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.pool = pool
        self.width = width
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.data = torch.zeros(num_layers, pool.num_blocks * pool.block_size, width, dtype=dtype, device=device)

    def row_index(self, table: BlockTable, start: int, stop: int, device=None) -> torch.Tensor:
        """Flat row ids [planes, stop-start] of tokens start…stop-1 in every plane of ``table``."""
        b = self.pool.block_size
        tok = torch.arange(start, stop)
        g, off = tok // b, tok % b
        blocks = torch.tensor(table.planes, dtype=torch.int64).reshape(len(table.planes), -1)
        return (blocks[:, g] * b + off[None, :]).to(device or self.data.device)
