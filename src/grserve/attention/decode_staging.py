"""Persistent head-major K/V of the running decode batch: a pure decode step reads its keys without a gather.

``HybridPagedContext`` gathers every request's past K/V from the block pool into a padded [S, T, heads, d] tensor in
every layer of every step, then runs SDPA on it. For a decode batch of medium size (32 requests × 256 tokens × 8
KV heads × 64) that gather copies 2 × 17 MB per layer and step, and SDPA with ``enable_gqa`` on the token-major
copy costs as much again (measured: 9.4 ms vs 4.2 ms of thread CPU per layer, docs/llm.md, P7). ``DecodeStaging``
keeps the batch's K/V between steps in a head-major buffer ``[L, S, Hkv, T_cap, d]``:

- a step whose requests are the same as the last staged step's, in the same order and each exactly one token
  further (``plan`` returns ``"append"``), writes only the new token's K/V into the buffer (the pool gets it too,
  as always);
- any other pure-KV decode step (a request joined, finished, was preempted or ran a step that was not staged)
  refills the buffer from the pool (``"rebuild"``: the same gather as before, once, then appends again);
- a batch whose buffer would exceed ``max_bytes`` is not staged (``None``: the context's gather path).

Attention on the buffer is one call per layer with the g = Hq / Hkv query heads of a KV head laid out as g query
rows of that head (no K/V expansion for GQA): the C++ decode kernel (``decode_kernel.py``; ``kernel``, set by the
executor where it built and checked one), else SDPA with a
[S, 1, 1, T] key mask. A request is identified by its id and how
often it was preempted (a recomputed request is new). The buffer only mirrors the pool: the pool stays the truth
(prefix cache, preemption, the reference contexts read it); ``tests/grserve/attention/test_decode_staging.py`` checks staged logits
against the gather path over joins, finishes, preemptions and block boundaries.
"""

from __future__ import annotations

import torch

GROW_TOKENS = 64  # T_cap = the step's T rounded up to this (a rebuild every GROW_TOKENS steps at most)


class DecodeStaging:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_bytes: int = 1 << 30, grow_tokens: int = GROW_TOKENS,
                 kernel=None):
        """``grow_tokens``: T_cap is a multiple of it (a batch-invariant executor's key length is padded to a
        multiple of 512, ``attention/hybrid.py``: it stages 512-token multiples). ``kernel``: a
        ``decode_kernel.DecodeKernel`` for the buffer's reads, or None (SDPA)."""
        self.kernel = kernel
        self.grow_tokens = grow_tokens
        self.num_layers, self.hkv, self.d = num_layers, num_kv_heads, head_dim
        self.dtype, self.device, self.max_bytes = dtype, torch.device(device), max_bytes
        self.k: torch.Tensor | None = None  # [L, S, Hkv, T_cap, d]
        self.v: torch.Tensor | None = None
        self.keys: tuple | None = None  # the staged requests, in batch order
        self.lens: list[int] = []  # tokens of each request in the buffer
        self.stats = {"append": 0, "rebuild": 0, "unstaged": 0}

    def nbytes(self, n_seq: int, t_cap: int) -> int:
        return 2 * self.num_layers * n_seq * self.hkv * t_cap * self.d * torch.finfo(self.dtype).bits // 8

    def plan(self, keys: tuple, starts: list[int]) -> str | None:
        """A pure decode step of requests ``keys`` whose new tokens sit at positions ``starts``: ``"append"`` (the
        buffer holds exactly positions < start of these requests), ``"rebuild"`` (refill it; (re)allocated if too
        small) or None (too large to stage). Call ``commit`` once the step's layers have run."""
        t_needed = max(starts) + 1
        if keys == self.keys and starts == self.lens and self.k is not None and t_needed <= self.k.shape[3]:
            self.stats["append"] += 1
            return "append"
        t_cap = -(-t_needed // self.grow_tokens) * self.grow_tokens
        if self.nbytes(len(keys), t_cap) > self.max_bytes:
            self.release()
            self.stats["unstaged"] += 1
            return None
        if self.k is None or self.k.shape[1] != len(keys) or self.k.shape[3] < t_needed:
            shape = (self.num_layers, len(keys), self.hkv, t_cap, self.d)
            self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.keys = None  # invalid until commit
        self.stats["rebuild"] += 1
        return "rebuild"

    def commit(self, keys: tuple, starts: list[int]) -> None:
        """The step ran every layer: the buffer now holds positions ≤ start of each request."""
        self.keys, self.lens = keys, [s + 1 for s in starts]

    def release(self) -> None:
        self.k = self.v = self.keys = None
        self.lens = []

    def invalidate(self) -> None:
        """Forget what is staged (a step failed half-way: the buffer may be half written)."""
        self.keys = None
