"""Paged attention over Apt-Serve's hybrid cache: some requests keep K/V blocks, others hidden-state blocks.

One forward pass packs any mix of requests (prefill chunks and decode tokens, KV and hidden). For each request
the context is told its block table, how many tokens are already cached (``start``) and how many new tokens it
brings (``num_new``, at positions start … start+num_new−1). Per layer it

1. writes the new tokens into the request's blocks: K and V for a ``kv`` request, the post-norm layer input x
   (seen through ``observe_layer_input``) for a ``hidden`` request;
2. assembles every request's keys/values for positions 0 … start+num_new−1: new tokens from this pass, past
   tokens gathered from K/V blocks, or — for hidden requests — gathered x re-projected by the model's
   ``kv_from_hidden(layer, x, positions)`` (k_proj/v_proj, k-norm, RoPE at the cached tokens' own positions);
3. runs causal attention (token start+j sees keys 0 … start+j).

``HybridPagedContext`` is the fast path (one padded, batched SDPA per layer, index tensors built once per pass);
``ReferenceHybridContext`` is the slow reference (per request, dense tensors, ``reference_attention``). The two
write the cache identically and are tested against each other and against HF transformers.

The context never decides policy: which request uses which cache comes from the block tables it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from grserve.attention.decode_kernel import KeyLengths
from grserve.attention.decode_staging import DecodeStaging
from grserve.attention.reference import reference_attention
from grserve.kvcache.blocks import BlockTable, HybridCacheStorage

KVFromHidden = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class SeqSlice:
    """One request's part of a packed forward pass (its new tokens are contiguous in the packed order)."""

    table: BlockTable
    start: int  # tokens already in the cache
    num_new: int  # tokens computed in this pass


def block_matrix(seqs: list[SeqSlice], num_planes: int) -> torch.Tensor:
    """[S, num_planes, G] int64: every request's block ids per plane, padded with block 0 (one tensor build from
    the tables' lists; no per-token Python)."""
    g = max(len(s.table.planes[0]) for s in seqs)
    pad_plane = [0] * g
    rows = []
    for s in seqs:
        planes = [p + [0] * (g - len(p)) if len(p) < g else p for p in s.table.planes]
        planes += [pad_plane] * (num_planes - len(planes))
        rows.append(planes)
    return torch.tensor(rows, dtype=torch.int64)


def _pure_kv_decode(seqs: list[SeqSlice]) -> bool:
    """Every request brings one new token after at least one cached, into K/V blocks."""
    return bool(seqs) and all(s.num_new == 1 and s.start > 0 and s.table.kind == "kv" for s in seqs)


class _HybridBase:
    def __init__(self, storage: HybridCacheStorage, seqs: list[SeqSlice], kv_from_hidden: KVFromHidden,
                 num_kv_heads: int, head_dim: int):
        self.storage = storage
        self.seqs = seqs
        self.kv_from_hidden = kv_from_hidden
        self.hkv, self.d = num_kv_heads, head_dim
        self._h: torch.Tensor | None = None
        dev = storage.data.device
        b = storage.pool.block_size
        n_seq = len(seqs)
        for s in seqs:
            if s.start + s.num_new > len(s.table.planes[0]) * b:
                raise ValueError("block table too short for start + num_new tokens")
        # ---- per-request vectors and the padded block matrix, built once per pass (vectorised, CPU)
        self.num_planes = max(len(s.table.planes) for s in seqs)
        self._blocks = block_matrix(seqs, self.num_planes)  # [S, P, G]
        self._starts = torch.tensor([s.start for s in seqs], dtype=torch.int64)
        self._nnew = torch.tensor([s.num_new for s in seqs], dtype=torch.int64)
        self._is_kv = torch.tensor([s.table.kind == "kv" for s in seqs], dtype=torch.bool)
        self.all_kv = bool(self._is_kv.all())
        self.any_kv = bool(self._is_kv.any())
        off = torch.cumsum(self._nnew, 0) - self._nnew
        self.num_tokens = int(self._nnew.sum())
        # packed token t belongs to request tok_seq[t], position tok_pos[t]
        self._tok_seq = torch.repeat_interleave(torch.arange(n_seq), self._nnew)
        self._tok_pos = torch.arange(self.num_tokens) - off[self._tok_seq] + self._starts[self._tok_seq]
        rows = self._rows(self._tok_seq, self._tok_pos)  # [P, N] pool rows of the new tokens
        # ---- write plan: (plane, dst pool rows, src packed rows) for K, V and each hidden plane
        if self.all_kv:
            self._kv_src = None
            self._k_dst, self._v_dst = rows[0].to(dev), rows[1].to(dev)
            self._kv_all = True
        else:
            tok_kv = self._is_kv[self._tok_seq]
            kv_src = tok_kv.nonzero().squeeze(1)
            self._kv_all = False
            if kv_src.numel():
                self._kv_src = kv_src.to(dev)
                self._k_dst, self._v_dst = rows[0, kv_src].to(dev), rows[1, kv_src].to(dev)
            else:
                self._kv_src = self._k_dst = self._v_dst = None
        if self.all_kv:
            self._h_src, self._h_dst = None, []
        else:
            h_src = (~self._is_kv[self._tok_seq]).nonzero().squeeze(1)
            hp = storage.pool.hidden_planes
            self._h_src = h_src.to(dev) if h_src.numel() else None
            self._h_dst = [rows[p, h_src].to(dev) for p in range(hp)] if h_src.numel() else []

    def _rows(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Pool rows [P, M] of (request seq[m], position pos[m]) in every plane (padded planes → block 0)."""
        b = self.storage.pool.block_size
        blk = self._blocks[seq, :, pos // b]  # [M, P]
        return (blk * b + (pos % b)[:, None]).T.contiguous()

    def observe_layer_input(self, layer: int, h: torch.Tensor) -> None:
        self._h = h

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        data = self.storage.data[layer]
        w = self.storage.width
        if self._kv_all:
            data.index_copy_(0, self._k_dst, k.reshape(k.shape[0], -1).to(data.dtype))
            data.index_copy_(0, self._v_dst, v.reshape(v.shape[0], -1).to(data.dtype))
        elif self._kv_src is not None:
            data.index_copy_(0, self._k_dst, k.reshape(k.shape[0], -1).index_select(0, self._kv_src).to(data.dtype))
            data.index_copy_(0, self._v_dst, v.reshape(v.shape[0], -1).index_select(0, self._kv_src).to(data.dtype))
        if self._h_src is not None:
            if self._h is None:
                raise RuntimeError("hidden-cache requests need the decoder's observe_layer_input hook")
            h = self._h.index_select(0, self._h_src).to(data.dtype)
            planes = len(self._h_dst)
            pad = planes * w - h.shape[1]
            if pad:
                h = F.pad(h, (0, pad))
            h = h.view(h.shape[0], planes, w)
            for p in range(planes):
                data.index_copy_(0, self._h_dst[p], h[:, p])

    def _gather_hidden(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """rows [planes, M] → x [M, hidden_size]."""
        data = self.storage.data[layer]
        x = torch.cat([data.index_select(0, rows[p]) for p in range(rows.shape[0])], dim=-1)
        return x[:, : self.storage.hidden_size]


FAST_DECODE_INDEX = True  # pure-KV decode passes build their indices directly (``HybridPagedContext``); tests flip it
# torch's CPU flash attention (SDPA) splits the keys into blocks of this many (its kv_split_size) and sizes the
# GEMMs of the last block by how many keys are left: a batch-invariant pass pads its key length to a multiple of it
INVARIANT_KEY_BLOCK = 512


def invariant_key_length(t: int) -> int:
    """The padded key length of a batch-invariant pass: ``t`` rounded up to ``INVARIANT_KEY_BLOCK``."""
    return -(-t // INVARIANT_KEY_BLOCK) * INVARIANT_KEY_BLOCK


class HybridPagedContext(_HybridBase):
    """Fast path: padded [S, Tmax] key layout and one SDPA per layer for the whole mixed batch.

    All index tensors are built once per pass, vectorised (no per-token Python). Per layer: the new tokens' K/V
    are written to their blocks first, then every KV request's keys/values for positions 0 … start+num_new−1
    are gathered from the pool in **one** ``index_select`` per plane (padding reads row 0 and is masked);
    hidden requests get their past K/V re-projected from the gathered x and their new K/V from this pass. A
    pure decode batch (one new token each) needs no query packing.

    A pure-KV decode pass (every request one new token after ≥ 1 cached, K/V blocks) with ``fast_index`` (and
    the module's ``FAST_DECODE_INDEX``) builds only what such a pass reads (``_init_decode``): each request's
    new-token row in both planes (one lookup in its block table), the key mask from the start positions, and
    the padded gather rows only when the step reads the pool (a staging rebuild or no staging); the general
    construction stays the reference (``tests/grserve/attention/test_decode_index.py``: identical indices).

    ``invariant`` (batch invariance, issue 42): a request's attention output does not depend on the other requests
    of the pass nor on how its prompt was chunked. SDPA's CPU flash kernel walks the keys in blocks of 512 and
    sizes the last block's GEMMs by the keys left, so the same keys padded (masked) to the batch's longest
    request, or attended under ``is_causal`` (which cuts each query block's keys at its diagonal), sum in another
    order; and its GEMMs' row count (the query rows of a block) changes a row's bits too. Invariant: the key length
    is padded to a multiple of 512 (``invariant_key_length``; the padding is masked, a fully masked block adds
    exact zeros), lone prefills take the masked path too, and every query token is its own SDPA batch element
    (``_attend_tokens``), so each query row meets the same blocks of the same keys in the same call shape whatever
    shares its pass (``tests/grserve/engine/test_llm_batch_invariance.py``).
    """

    def __init__(self, storage: HybridCacheStorage, seqs: list[SeqSlice], kv_from_hidden: KVFromHidden,
                 num_kv_heads: int, head_dim: int, staging: DecodeStaging | None = None, keys: tuple | None = None,
                 fast_index: bool = True, invariant: bool = False):
        self.invariant = invariant
        if fast_index and FAST_DECODE_INDEX and _pure_kv_decode(seqs):
            self._init_decode(storage, seqs, kv_from_hidden, num_kv_heads, head_dim, staging, keys)
            return
        super().__init__(storage, seqs, kv_from_hidden, num_kv_heads, head_dim)
        dev = storage.data.device
        n_seq = len(seqs)
        self._stage = None  # (staging, "append" | "rebuild", keys) for a staged pure decode (decode_staging.py)
        self._stage_lens = None  # keys per request of a staged step, for the decode kernel (built once)
        ends = self._starts + self._nnew
        self.t_max = int(ends.max())
        if invariant:
            self.t_max = invariant_key_length(self.t_max)
        self.q_max = int(self._nnew.max())
        # fresh prefills of one length (incl. a lone prompt): plain causal SDPA over [S, n], no gather, no mask
        self.lone_prefill = (not invariant and all(s.start == 0 for s in seqs) and self.q_max == int(self._nnew.min())
                             and (self.all_kv or n_seq == 1))
        if self.lone_prefill:
            return
        kpos = torch.arange(self.t_max)
        qj = torch.arange(self.q_max)
        # mask[s, 0, j, t]: query j of request s (position start+j) sees key t ≤ start+j; padded query rows
        # (j ≥ num_new) see key 0 only (never NaN; their output is discarded)
        qpos = self._starts[:, None] + qj[None, :]  # [S, Q]
        real_q = qj[None, :] < self._nnew[:, None]
        mask = kpos[None, None, :] <= qpos[:, :, None]
        mask = torch.where(real_q[:, :, None], mask, (kpos == 0)[None, None, :])
        self._mask = mask[:, None].to(dev)
        self.pure_decode = self.q_max == 1 and bool((self._nnew == 1).all())
        flat_seq = torch.arange(n_seq).repeat_interleave(self.t_max)
        flat_pos = kpos.repeat(n_seq)
        valid = flat_pos < ends[flat_seq]
        self._kv_rows = None
        if self.any_kv:
            kv_ok = valid & self._is_kv[flat_seq]
            rows = self._rows(flat_seq, torch.where(valid, flat_pos, 0))  # [P, S·Tmax] (padding: row 0)
            self._kv_rows = (torch.where(kv_ok, rows[0], 0).to(dev), torch.where(kv_ok, rows[1], 0).to(dev))
        self._new_dst = self._ph = None
        if not self.all_kv:
            h_tok = ~self._is_kv[self._tok_seq]
            # hidden requests' new tokens: copied from this pass (packed rows → padded slots)
            self._new_src = h_tok.nonzero().squeeze(1).to(dev)
            self._new_dst = (self._tok_seq[h_tok] * self.t_max + self._tok_pos[h_tok]).to(dev)
            past = valid & ~self._is_kv[flat_seq] & (flat_pos < self._starts[flat_seq])
            if bool(past.any()):
                ps, pp = flat_seq[past], flat_pos[past]
                hp = storage.pool.hidden_planes
                self._ph = (past.nonzero().squeeze(1).to(dev), self._rows(ps, pp)[:hp].to(dev), pp.to(dev))
        if not self.pure_decode:
            self._q_dst = (self._tok_seq * self.q_max + torch.arange(self.num_tokens)
                           - (torch.cumsum(self._nnew, 0) - self._nnew)[self._tok_seq]).to(dev)
        elif staging is not None and keys is not None and self.all_kv:
            mode = staging.plan(keys, self._starts.tolist())
            if mode is not None:
                self._stage = (staging, mode, keys)
                self._stage_at = (torch.arange(n_seq, device=dev), self._starts.to(dev))

    def _init_decode(self, storage: HybridCacheStorage, seqs: list[SeqSlice], kv_from_hidden: KVFromHidden,
                     num_kv_heads: int, head_dim: int, staging: DecodeStaging | None, keys: tuple | None) -> None:
        """The pure-KV decode pass's indices, straight from the block tables (the general path's values)."""
        self.storage, self.seqs, self.kv_from_hidden = storage, seqs, kv_from_hidden
        self.hkv, self.d = num_kv_heads, head_dim
        self._h = None
        dev = storage.data.device
        b = storage.pool.block_size
        n_seq = len(seqs)
        starts = [s.start for s in seqs]
        k_rows, v_rows = [], []
        for s in seqs:
            g, off = divmod(s.start, b)
            planes = s.table.planes
            if g >= len(planes[0]):
                raise ValueError("block table too short for start + num_new tokens")
            k_rows.append(planes[0][g] * b + off)
            v_rows.append(planes[1][g] * b + off)
        self.num_planes = 2
        self._starts = torch.tensor(starts, dtype=torch.int64)
        self._nnew = torch.ones(n_seq, dtype=torch.int64)
        self._is_kv = torch.ones(n_seq, dtype=torch.bool)
        self.all_kv = self.any_kv = True
        self.num_tokens = n_seq
        self._tok_seq = torch.arange(n_seq)
        self._tok_pos = self._starts
        self._kv_src, self._kv_all = None, True
        self._k_dst = torch.tensor(k_rows, dtype=torch.int64, device=dev)
        self._v_dst = torch.tensor(v_rows, dtype=torch.int64, device=dev)
        self._h_src, self._h_dst = None, []
        self._stage = None
        self.t_max = invariant_key_length(max(starts) + 1) if self.invariant else max(starts) + 1
        self.q_max = 1
        self.lone_prefill = False
        self.pure_decode = True
        # key t of request s is visible iff t ≤ start_s (the query's own position)
        self._mask = (torch.arange(self.t_max)[None, :] <= self._starts[:, None])[:, None, None, :].to(dev)
        self._new_dst = self._ph = None
        self._stage_lens = None
        mode = staging.plan(keys, starts) if staging is not None and keys is not None else None
        if mode is not None:
            self._stage = (staging, mode, keys)
            self._stage_at = (torch.arange(n_seq, device=dev), self._starts.to(dev))
        self._kv_rows = None
        if mode != "append":  # the step reads the pool: the padded gather rows, as the general path builds them
            self._blocks = block_matrix(seqs, 2)
            flat_seq = torch.arange(n_seq).repeat_interleave(self.t_max)
            flat_pos = torch.arange(self.t_max).repeat(n_seq)
            ok = flat_pos <= self._starts[flat_seq]
            rows = self._rows(flat_seq, torch.where(ok, flat_pos, 0))
            self._kv_rows = (torch.where(ok, rows[0], 0).to(dev), torch.where(ok, rows[1], 0).to(dev))

    def finish(self) -> None:
        """Every layer ran: a staged step's buffer now holds its tokens (the executor calls this after the
        forward; a forward that raised leaves the buffer invalid instead)."""
        if self._stage is not None:
            staging, _mode, keys = self._stage
            staging.commit(keys, self._starts.tolist())

    def _attend_staged(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Pure decode on the staging buffer: append (or refill) this layer's K/V, then one call with the g query
        heads of each KV head as g query rows (GQA without expanding K/V): the staging's C++ decode kernel where it
        takes the call (``decode_kernel.py``), else SDPA."""
        staging, mode, _keys = self._stage
        n_seq, hq, d, hkv, t = len(self.seqs), q.shape[1], self.d, self.hkv, self.t_max
        kb, vb = staging.k[layer], staging.v[layer]  # [S, Hkv, T_cap, d]
        if mode == "rebuild":  # the pool already holds this step's token (written by _write)
            data = self.storage.data[layer]
            kb[:, :, :t].copy_(data.index_select(0, self._kv_rows[0]).view(n_seq, t, hkv, d).transpose(1, 2))
            vb[:, :, :t].copy_(data.index_select(0, self._kv_rows[1]).view(n_seq, t, hkv, d).transpose(1, 2))
        else:
            s_idx, pos = self._stage_at
            kb[s_idx, :, pos] = k.to(kb.dtype)
            vb[s_idx, :, pos] = v.to(vb.dtype)
        qg = q.view(n_seq, hkv, hq // hkv, d)
        kernel = staging.kernel
        if kernel is not None and kernel.accepts(q, kb):
            if self._stage_lens is None:
                self._stage_lens = KeyLengths(self._starts + 1)
            return kernel.attend(qg, kb, vb, self._stage_lens).reshape(n_seq, hq, d)
        o = F.scaled_dot_product_attention(qg, kb[:, :, :t].to(q.dtype), vb[:, :, :t].to(q.dtype),
                                           attn_mask=self._mask)
        return o.reshape(n_seq, hq, d)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._write(layer, k, v)
        n_seq, hq, d, hkv = len(self.seqs), q.shape[1], self.d, self.hkv
        if self.lone_prefill:  # fresh prefills of one length: no gather, plain causal SDPA
            n = self.q_max
            o = F.scaled_dot_product_attention(q.view(n_seq, n, hq, d).transpose(1, 2),
                                               k.view(n_seq, n, hkv, d).transpose(1, 2),
                                               v.view(n_seq, n, hkv, d).transpose(1, 2), is_causal=True,
                                               enable_gqa=hq != hkv)
            return o.transpose(1, 2).reshape(n_seq * n, hq, d)
        if self._stage is not None:
            return self._attend_staged(layer, q, k, v)
        data = self.storage.data[layer]
        if self._kv_rows is not None:  # one gather per plane; includes the new tokens just written
            kk = data.index_select(0, self._kv_rows[0]).view(-1, hkv, d).to(k.dtype)
            vv = data.index_select(0, self._kv_rows[1]).view(-1, hkv, d).to(v.dtype)
        else:
            kk = k.new_zeros(n_seq * self.t_max, hkv, d)
            vv = v.new_zeros(n_seq * self.t_max, hkv, d)
        if self._new_dst is not None:
            kk.index_copy_(0, self._new_dst, k.index_select(0, self._new_src))
            vv.index_copy_(0, self._new_dst, v.index_select(0, self._new_src))
        if self._ph is not None:
            dst, rows, pos = self._ph
            kr, vr = self.kv_from_hidden(layer, self._gather_hidden(layer, rows).to(k.dtype), pos)
            kk.index_copy_(0, dst, kr)
            vv.index_copy_(0, dst, vr)
        if self.invariant:
            return self._attend_tokens(q, kk, vv)
        if self.pure_decode:
            qq = q.view(n_seq, 1, hq, d)
        else:
            qq = q.new_zeros(n_seq * self.q_max, hq, d)
            qq.index_copy_(0, self._q_dst, q)
            qq = qq.view(n_seq, self.q_max, hq, d)
        o = F.scaled_dot_product_attention(
            qq.transpose(1, 2),
            kk.view(n_seq, self.t_max, hkv, d).transpose(1, 2),
            vv.view(n_seq, self.t_max, hkv, d).transpose(1, 2),
            attn_mask=self._mask, enable_gqa=hq != hkv)
        o = o.transpose(1, 2)
        if self.pure_decode:
            return o.reshape(n_seq, hq, d)
        return o.reshape(n_seq * self.q_max, hq, d).index_select(0, self._q_dst)

    def _attend_tokens(self, q: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        """The invariant pass's attention (``invariant``): every query token is one SDPA batch element, its g query
        heads of a KV head as g query rows ([tokens, Hkv, g, d], the staged decode's layout) against its request's
        keys padded to ``t_max`` (a multiple of 512) and masked after its own position. A row then meets the same
        kernel call shape whatever else shares the pass and however its prompt was chunked (a prefill chunk is a
        batch of such rows; a request's keys are expanded over its tokens, not copied)."""
        n_seq, t, hkv, d = len(self.seqs), self.t_max, self.hkv, self.d
        hq = q.shape[1]
        qq = q.view(-1, hkv, hq // hkv, d)
        kk = kk.view(n_seq, t, hkv, d).transpose(1, 2)  # [S, Hkv, T, d]
        vv = vv.view(n_seq, t, hkv, d).transpose(1, 2)
        if self.pure_decode:
            return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=self._mask).reshape(n_seq, hq, d)
        dev = q.device
        kpos = torch.arange(t, device=dev)
        out = torch.empty_like(qq)
        nnew = self._nnew.tolist()
        ones = [i for i, n in enumerate(nnew) if n == 1]
        off = (torch.cumsum(self._nnew, 0) - self._nnew).tolist()
        if ones:  # the requests with one new token: one call
            idx = torch.tensor(ones, device=dev)
            rows = torch.tensor([off[i] for i in ones], device=dev)
            mask = (kpos[None, :] <= self._starts[ones].to(dev)[:, None])[:, None, None, :]
            out[rows] = F.scaled_dot_product_attention(qq.index_select(0, rows), kk.index_select(0, idx),
                                                       vv.index_select(0, idx), attn_mask=mask)
        block = INVARIANT_KEY_BLOCK
        for i, n in enumerate(nnew):
            if n == 1:
                continue
            start = int(self._starts[i])
            # the request's tokens by key length: a token at position p reads invariant_key_length(p + 1) keys (the
            # blocks past it are fully masked, so any multiple of 512 gives the same bits: the shortest, causal skip)
            for lo in range(start - start % block, start + n, block):
                a, b = max(lo, start), min(lo + block, start + n)
                tk, r = lo + block, off[i] + a - start
                mask = (kpos[None, :tk] <= torch.arange(a, b, device=dev)[:, None])[:, None, None, :]
                out[r:r + b - a] = F.scaled_dot_product_attention(
                    qq[r:r + b - a], kk[i:i + 1, :, :tk].expand(b - a, -1, -1, -1),
                    vv[i:i + 1, :, :tk].expand(b - a, -1, -1, -1), attn_mask=mask)
        return out.reshape(-1, hq, d)


class ReferenceHybridContext(_HybridBase):
    """Slow reference: per request, dense K/V for positions 0…start+num_new−1, explicit causal mask."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._write(layer, k, v)
        data = self.storage.data[layer]
        outs, off = [], 0
        for s in self.seqs:
            n = s.start + s.num_new
            rows = self.storage.row_index(s.table, 0, n)
            if s.table.kind == "kv":
                ks = data[rows[0]].view(n, self.hkv, self.d).to(k.dtype)
                vs = data[rows[1]].view(n, self.hkv, self.d).to(v.dtype)
            else:
                ks, vs = self.kv_from_hidden(layer, self._gather_hidden(layer, rows).to(k.dtype), torch.arange(n))
            qpos = torch.arange(s.start, n)
            allowed = qpos[:, None] >= torch.arange(n)[None, :]
            outs.append(reference_attention(q[off: off + s.num_new], ks, vs, allowed))
            off += s.num_new
        return torch.cat(outs)
