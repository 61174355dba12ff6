"""Attention contexts for Bipartite Attention prompts (BAT §4): attend to gathered cached prefix KV + new tokens.

A packed forward holds several ranking requests. Each request is a ``BipartitePrompt`` (head, items, tail; see
``grserve.ranking.layouts``) where the head and any item may come **from cache** (its per-layer K/V, RoPE already
baked in at the layout's positions) instead of being computed. Only the non-cached tokens enter the forward; a
cached token is never recomputed. Per layer and request, with partial states ``(o, lse)`` merged by log-sum-exp
(``grserve.attention.staged.merge_states``):

- computed head tokens: causal over the head;
- computed item tokens: [head, full] ⊕ [own item, causal] — the self stage of all computed items of the whole
  batch runs as one causal attention call per item length (no padding: an item's K/V do not depend on what else
  is packed with it, bit for bit at any dtype);
- tail tokens: [head + every item (cached or computed), full] ⊕ [tail, causal].

That is exactly the visibility of ``BipartitePrompt.visibility()``; ``MaskedPromptContext`` is the slow reference
that runs a flat prompt with that explicit boolean mask (tests: fast = reference ≤ 1e-4 fp32).

KV entries handled here are ``[L, 2, n, Hkv, D]`` tensors (layer, k/v, token, kv-head, dim).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from grserve.attention.reference import reference_attention
from grserve.attention.staged import _wide, merge_states, shared_stage, shared_stage_reference

_FLASH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------------------
# partial-state kernels
# ----------------------------------------------------------------------------------------------------------
def causal_states_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched causal self-attention partial state. q [B, L, Hq, D], k/v [B, L, Hkv, D] → o [B, L, Hq, D], lse [B, L, Hq]."""
    b, n, hq, d = q.shape
    g = hq // k.shape[2]
    kr, vr = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = _wide(torch.einsum("bqhd,bkhd->bhqk", q, kr)) * (d**-0.5)  # scores and lse in fp32 (fp64 stays)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, H, L]
    o = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]).to(v.dtype), vr)
    return o, lse.transpose(1, 2)


def causal_states(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_states_reference`` through PyTorch's fused CPU flash kernel (returns the LSE) when it applies."""
    if q.device.type != "cpu" or q.dtype not in _FLASH_DTYPES or q.shape[1] == 0:
        return causal_states_reference(q, k, v)
    g = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(g, dim=2).transpose(1, 2)
    vh = v.repeat_interleave(g, dim=2).transpose(1, 2)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, True)
    return o.transpose(1, 2), _wide(lse).transpose(1, 2)  # the kernel's fp32 lse, not rounded to a bf16 model's


def causal_states_1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, exact: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal self-attention partial state of one sequence: q [n, Hq, D], k/v [n, Hkv, D] → o [n, Hq, D], lse [n, Hq].

    GQA without copying K/V: the G query heads of a KV head become the kernel's batch dimension and K/V are
    expanded (stride 0) over it.
    """
    if exact or q.device.type != "cpu" or q.dtype not in _FLASH_DTYPES or q.shape[0] == 0:
        o, lse = causal_states_reference(q[None], k[None], v[None])
        return o[0], lse[0]
    n, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qh = q.view(n, hkv, g, d).permute(2, 1, 0, 3)  # [G, Hkv, n, D]
    kh = k.permute(1, 0, 2).unsqueeze(0).expand(g, hkv, n, d)
    vh = v.permute(1, 0, 2).unsqueeze(0).expand(g, hkv, n, d)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, True)
    return o.permute(2, 1, 0, 3).reshape(n, hq, d), _wide(lse).permute(2, 1, 0).reshape(n, hq)


def full_states_hm(q: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, exact: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query sees every key. q [Nq, Hq, D], head-major keys kh/vh [Hkv, Nk, D] (Nk may be 0; may be strided
    views of a batch buffer) → o [Nq, Hq, D], lse [Nq, Hq]."""
    if exact or q.dtype not in _FLASH_DTYPES:
        return shared_stage_reference(q, kh, vh)
    return shared_stage(q, kh, vh)


# ----------------------------------------------------------------------------------------------------------
# the packed batch
# ----------------------------------------------------------------------------------------------------------
@dataclass
class BipartiteRequest:
    """One request of a packed forward: its prompt and which parts come from cache."""

    prompt: "object"  # grserve.ranking.layouts.BipartitePrompt (typed loosely: attention sits below ranking)
    head_kv: torch.Tensor | None = None  # cached head KV [L, 2, n_head, Hkv, D]; None → computed
    # per candidate: a cached [L, 2, n_i, Hkv, D]; True → cached, already inside ``cached_items_kv``; None → computed
    item_kv: list[torch.Tensor | bool | None] | None = None
    cached_items_kv: torch.Tensor | None = None  # [L, 2, Σ cached n_i, Hkv, D] for the entries marked True


@dataclass
class _Slots:
    head: tuple[int, int]  # packed [start, end) of the computed head (empty when cached or absent)
    items: list[tuple[int, int] | None]  # per candidate: packed range when computed, None when cached
    item_range: tuple[int, int]  # packed range covering all computed items (contiguous)
    tail: tuple[int, int]
    flat_items: tuple[int, int]  # range of this request's tokens in the batch's flat computed-item list
    prefix: tuple[int, int]  # range of [head | all items] in the batch's per-layer prefix-KV buffer
    n_head: int
    cached: list[tuple[int, torch.Tensor]]  # (buffer offset, cached [L, 2, n, Hkv, D]) copied in per layer


class _Packing:
    """Lays out the computed tokens of a batch request by request: packed ids/positions, the per-layer prefix
    buffer ranges and the copies of computed head/item K/V into it (``BipartiteBatchContext`` reads the result)."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.pos: list[np.ndarray] = []
        self.cursor = 0  # packed tokens so far
        self.flat = 0  # computed item tokens so far (the batch's flat item list)
        self.pre = 0  # cursor in the prefix-KV buffer
        self.item_rows: list[tuple[int, int]] = []  # computed items of the whole batch, (packed start, length)
        self.copy_src: list[np.ndarray] = []
        self.copy_dst: list[np.ndarray] = []

    def _take(self, tokens: np.ndarray, positions: np.ndarray) -> tuple[int, int]:
        start = self.cursor
        self.ids.append(tokens)
        self.pos.append(positions)
        self.cursor += len(tokens)
        return start, self.cursor

    def add(self, req: BipartiteRequest) -> _Slots:
        p = req.prompt
        n_items = len(p.items)
        item_kv = req.item_kv if req.item_kv is not None else [None] * n_items
        if len(item_kv) != n_items:
            raise ValueError(f"item_kv has {len(item_kv)} entries for {n_items} candidates")
        n_head = len(p.head)
        head_computed = req.head_kv is None and n_head > 0
        if req.head_kv is not None and req.head_kv.shape[2] != n_head:
            raise ValueError(f"cached head KV has {req.head_kv.shape[2]} tokens, the head has {n_head}")
        p0, h0 = self.pre, self.cursor
        cached: list[tuple[int, torch.Tensor]] = []
        if head_computed:
            self._take(p.head, p.head_positions())
        elif req.head_kv is not None and n_head > 0:
            cached.append((p0, req.head_kv))
        head = (h0, self.cursor)
        i0, f0 = self.cursor, self.flat
        items, cached_parts, concat_tokens = self._items(p, item_kv)
        n_cat = 0 if req.cached_items_kv is None else int(req.cached_items_kv.shape[2])
        if concat_tokens != n_cat:
            raise ValueError(f"cached_items_kv has {n_cat} tokens, the candidates marked cached have {concat_tokens}")
        item_range = (i0, self.cursor)
        # prefix buffer: [head | every candidate in the prompt's order], whichever of them were computed or cached:
        # the tail's keys are in the same order whatever the cache held (a key order that changed with the cache
        # state changed the attention's last bits, and at bf16 the scores), and in the order of the flat reference
        src: list[np.ndarray] = []
        dst: list[np.ndarray] = []
        if head_computed:
            src.append(np.arange(h0, head[1], dtype=np.int64))
            dst.append(np.arange(p0, p0 + n_head, dtype=np.int64))
        off, cat, run = p0 + n_head, 0, None  # run: [buffer offset, concat start, tokens] of consecutive True entries
        parts = iter(cached_parts)
        for i, kv in enumerate(item_kv):
            n = len(p.items[i])
            if kv is True:
                if run is None:
                    run = [off, cat, 0]
                run[2] += n
                cat += n
            else:
                if run is not None:
                    cached.append((run[0], req.cached_items_kv[:, :, run[1]:run[1] + run[2]]))
                    run = None
                if kv is None:
                    a, b = items[i]
                    src.append(np.arange(a, b, dtype=np.int64))
                    dst.append(np.arange(off, off + n, dtype=np.int64))
                else:
                    cached.append((off, next(parts)))
            off += n
        if run is not None:
            cached.append((run[0], req.cached_items_kv[:, :, run[1]:run[1] + run[2]]))
        if src:
            self.copy_src.append(np.concatenate(src))
            self.copy_dst.append(np.concatenate(dst))
        self.pre = off
        tail = self._take(p.tail, p.tail_positions())
        return _Slots(head, items, item_range, tail, (f0, self.flat), (p0, self.pre), n_head, cached)

    def _items(self, p, item_kv) -> tuple[list[tuple[int, int] | None], list[torch.Tensor], int]:
        """Computed candidates go into the packed order; cached ones are listed (explicit KV) or counted (True)."""
        items: list[tuple[int, int] | None] = []
        cached_parts: list[torch.Tensor] = []
        concat_tokens = 0
        for i, kv in enumerate(item_kv):
            if kv is None:
                items.append(self._take(p.items[i], p.item_positions(i)))
                self.item_rows.append((items[-1][0], len(p.items[i])))
                self.flat += len(p.items[i])
            elif kv is True:
                items.append(None)
                concat_tokens += len(p.items[i])
            else:
                if kv.shape[2] != len(p.items[i]):
                    raise ValueError(f"cached KV of candidate {i} has {kv.shape[2]} tokens, the item has "
                                     f"{len(p.items[i])}")
                items.append(None)
                cached_parts.append(kv)
        return items, cached_parts, concat_tokens


def _item_groups(item_rows: list[tuple[int, int]], device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The computed items of a batch grouped by length: per length n, gather indices [k, n] of its k items' packed
    rows and where those rows go in the batch's flat item list [k·n]. One causal kernel call per group, no
    padding: an item's self stage is then computed alike whatever else is packed with it (CPU flash attention
    rounds a row differently with the sequence length it is called with; at bf16 that changed an item's K/V)."""
    flat, off = [], 0
    for _, n in item_rows:
        flat.append(off)
        off += n
    by_len: dict[int, list[int]] = {}
    for j, (_, n) in enumerate(item_rows):
        by_len.setdefault(n, []).append(j)
    groups = []
    for n, js in sorted(by_len.items()):
        ar = torch.arange(n, dtype=torch.int64)
        starts = torch.tensor([item_rows[j][0] for j in js], dtype=torch.int64)
        dst = torch.tensor([flat[j] for j in js], dtype=torch.int64)
        groups.append(((starts[:, None] + ar).to(device), (dst[:, None] + ar).reshape(-1).to(device)))
    return groups


class BipartiteBatchContext:
    """The fast path: one packed forward over the computed tokens of several Bipartite prompts.

    Per layer, the keys every request's items and tail attend to in full ("shared" keys: [head | all items]) are
    assembled once in a head-major buffer ``[2, Hkv, Σ prefix, D]``: cached head / item KV is copied in (one
    copy per cached entry), computed head / item K/V with a single ``index_copy_`` for the whole batch. Per request
    the attention is then at most: one causal kernel call for a computed head, one full call items → head, one
    full call tail → [head | items] and one causal call for the tail, plus one causal call per item length for the
    self stage of every computed item of the batch. No concatenation or GQA repetition of cached KV per layer.
    """

    def __init__(self, requests: list[BipartiteRequest], device: torch.device | str = "cpu", exact: bool = False):
        self.exact = exact
        pack = _Packing()
        self.slots: list[_Slots] = [pack.add(req) for req in requests]
        self.input_ids = torch.from_numpy(np.concatenate(pack.ids)).to(device)
        self.positions = torch.from_numpy(np.concatenate(pack.pos)).to(device)
        self.num_tokens = pack.cursor
        self.prefix_tokens = pack.pre
        self._copy_src = torch.from_numpy(np.concatenate(pack.copy_src)).to(device) if pack.copy_src else None
        self._copy_dst = torch.from_numpy(np.concatenate(pack.copy_dst)).to(device) if pack.copy_dst else None
        # the computed items, grouped by length (one causal call per length, ``_item_groups``)
        self.num_item_tokens = pack.flat
        self._item_groups = _item_groups(pack.item_rows, device)
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []

    # ---- results ------------------------------------------------------------------------------------------
    def last_index(self, r: int) -> int:
        """Packed index of request r's discriminant (last) token."""
        return self.slots[r].tail[1] - 1

    def captured_kv(self, start: int, end: int) -> torch.Tensor:
        """K/V the forward computed for packed tokens [start, end) → [L, 2, n, Hkv, D] (a copy)."""
        return torch.stack([torch.stack((k[start:end], v[start:end])) for k, v in zip(self.k, self.v)])

    def head_kv(self, r: int) -> torch.Tensor:
        s, e = self.slots[r].head
        return self.captured_kv(s, e)

    def item_kv(self, r: int, i: int) -> torch.Tensor:
        rng = self.slots[r].items[i]
        if rng is None:
            raise ValueError(f"candidate {i} of request {r} came from cache")
        return self.captured_kv(*rng)

    # ---- the contract -------------------------------------------------------------------------------------
    def _prefix_buffer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[2, Hkv, Σ prefix, D]: every request's [head | items] K/V of this layer, head-major."""
        buf = k.new_empty(2, k.shape[1], self.prefix_tokens, k.shape[2])
        for s in self.slots:
            for off, kv in s.cached:
                n = kv.shape[2]
                buf[:, :, off:off + n].copy_(kv[layer].transpose(1, 2))
        if self._copy_src is not None:
            buf[0].index_copy_(1, self._copy_dst, k.index_select(0, self._copy_src).transpose(0, 1))
            buf[1].index_copy_(1, self._copy_dst, v.index_select(0, self._copy_src).transpose(0, 1))
        return buf

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        while len(self.k) <= layer:
            self.k.append(None)
            self.v.append(None)
        self.k[layer], self.v[layer] = k, v
        ex = self.exact
        out = torch.empty_like(q)
        buf = self._prefix_buffer(layer, k, v)
        # self stage of every computed item of the batch: one causal call per item length
        if self._item_groups:
            causal = causal_states_reference if ex else causal_states
            o_items = q.new_empty(self.num_item_tokens, *q.shape[1:])
            lse_items = None
            for idx, dst in self._item_groups:
                o_g, lse_g = causal(q[idx], k[idx], v[idx])
                if lse_items is None:
                    lse_items = lse_g.new_empty(self.num_item_tokens, q.shape[1])
                o_items[dst] = o_g.reshape(-1, *q.shape[1:])
                lse_items[dst] = lse_g.reshape(-1, q.shape[1])
        for s in self.slots:
            hs, he = s.head
            if he > hs:
                out[hs:he] = causal_states_1(q[hs:he], k[hs:he], v[hs:he], ex)[0]
            p0, p1 = s.prefix
            f0, f1 = s.flat_items
            i0, i1 = s.item_range
            if f1 > f0:
                o_self, lse_self = o_items[f0:f1], lse_items[f0:f1]
                if s.n_head > 0:
                    o_a, lse_a = full_states_hm(q[i0:i1], buf[0, :, p0:p0 + s.n_head], buf[1, :, p0:p0 + s.n_head], ex)
                    o_self, _ = merge_states(o_a, lse_a, o_self, lse_self)
                out[i0:i1] = o_self
            ts, te = s.tail
            o_a, lse_a = full_states_hm(q[ts:te], buf[0, :, p0:p1], buf[1, :, p0:p1], ex)
            o_t, lse_t = causal_states_1(q[ts:te], k[ts:te], v[ts:te], ex)
            out[ts:te], _ = merge_states(o_a, lse_a, o_t, lse_t)
        return out


class MaskedPromptContext:
    """Reference: one flat prompt with an explicit boolean visibility mask; records every layer's K/V."""

    def __init__(self, allowed: torch.Tensor):
        self.allowed = allowed
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k.append(k)
        self.v.append(v)
        return reference_attention(q, k, v, self.allowed)

    def kv(self, start: int, end: int) -> torch.Tensor:
        """[L, 2, n, Hkv, D] of flat tokens [start, end)."""
        return torch.stack([torch.stack((k[start:end], v[start:end])) for k, v in zip(self.k, self.v)])


@torch.no_grad()
def reference_forward(model, prompt) -> tuple[torch.Tensor, MaskedPromptContext]:
    """Run a whole ``BipartitePrompt`` flat with its explicit mask → (final hidden [T, H], context with K/V)."""
    dev = model.device
    ctx = MaskedPromptContext(torch.from_numpy(prompt.visibility()).to(dev))
    hidden = model.forward(torch.from_numpy(prompt.tokens()).to(dev), torch.from_numpy(prompt.positions()).to(dev),
                           ctx)
    return hidden, ctx
