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

from grserve.attention.reference import reference_attention
from grserve.kvcache.blocks import BlockTable, HybridCacheStorage

KVFromHidden = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class SeqSlice:
    """One request's part of a packed forward pass (its new tokens are contiguous in the packed order)."""

    table: BlockTable
    start: int  # tokens already in the cache
    num_new: int  # tokens computed in this pass


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
        # ---- write plan: (plane, dst pool rows, src packed rows) for K, V and each hidden plane
        k_dst, v_dst, kv_src = [], [], []
        h_dst: list[list[torch.Tensor]] = [[] for _ in range(storage.pool.hidden_planes)]
        h_src: list[torch.Tensor] = []
        off = 0
        for s in seqs:
            if s.start + s.num_new > len(s.table.planes[0]) * b:
                raise ValueError("block table too short for start + num_new tokens")
            rows = storage.row_index(s.table, s.start, s.start + s.num_new, device="cpu")
            src = torch.arange(off, off + s.num_new)
            if s.table.kind == "kv":
                k_dst.append(rows[0]), v_dst.append(rows[1]), kv_src.append(src)
            else:
                for p in range(len(rows)):
                    h_dst[p].append(rows[p])
                h_src.append(src)
            off += s.num_new
        self.num_tokens = off
        cat = lambda xs: torch.cat(xs).to(dev) if xs else None  # noqa: E731
        self._k_dst, self._v_dst, self._kv_src = cat(k_dst), cat(v_dst), cat(kv_src)
        self._h_dst = [cat(x) for x in h_dst] if h_src else []
        self._h_src = cat(h_src)

    def observe_layer_input(self, layer: int, h: torch.Tensor) -> None:
        self._h = h

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        data = self.storage.data[layer]
        w = self.storage.width
        if self._kv_src is not None:
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


class HybridPagedContext(_HybridBase):
    """Fast path: padded [S, Tmax] key layout and one SDPA per layer for the whole mixed batch."""

    def __init__(self, storage: HybridCacheStorage, seqs: list[SeqSlice], kv_from_hidden: KVFromHidden,
                 num_kv_heads: int, head_dim: int):
        super().__init__(storage, seqs, kv_from_hidden, num_kv_heads, head_dim)
        dev = storage.data.device
        n_seq = len(seqs)
        self.t_max = max(s.start + s.num_new for s in seqs)
        self.q_max = max(s.num_new for s in seqs)
        new_dst, q_dst = [], []
        pk_dst, pk_src_k, pk_src_v = [], [], []
        ph_dst, ph_src, ph_pos = [], [], []
        mask = torch.zeros(n_seq, 1, self.q_max, self.t_max, dtype=torch.bool)
        mask[:, :, :, 0] = True  # padded query rows see key 0 (never NaN); their output is discarded
        for i, s in enumerate(seqs):
            j = torch.arange(s.num_new)
            new_dst.append(i * self.t_max + s.start + j)
            q_dst.append(i * self.q_max + j)
            kpos = torch.arange(self.t_max)
            mask[i, 0, : s.num_new] = kpos[None, :] <= (s.start + j)[:, None]
            if s.start:
                rows = storage.row_index(s.table, 0, s.start, device="cpu")
                dst = i * self.t_max + torch.arange(s.start)
                if s.table.kind == "kv":
                    pk_dst.append(dst), pk_src_k.append(rows[0]), pk_src_v.append(rows[1])
                else:
                    ph_dst.append(dst), ph_src.append(rows), ph_pos.append(torch.arange(s.start))
        self._new_dst = torch.cat(new_dst).to(dev)
        self._q_dst = torch.cat(q_dst).to(dev)
        self._mask = mask.to(dev)
        self._pk = (torch.cat(pk_dst).to(dev), torch.cat(pk_src_k).to(dev), torch.cat(pk_src_v).to(dev)) \
            if pk_dst else None
        self._ph = (torch.cat(ph_dst).to(dev), torch.cat(ph_src, dim=1).to(dev), torch.cat(ph_pos).to(dev)) \
            if ph_dst else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._write(layer, k, v)
        n_seq, hq, d, hkv = len(self.seqs), q.shape[1], self.d, self.hkv
        if n_seq == 1 and self.seqs[0].start == 0:  # a lone fresh prefill: no gather, plain causal SDPA
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=True, enable_gqa=hq != hkv)
            return o[0].transpose(0, 1)
        kk = k.new_zeros(n_seq * self.t_max, hkv, d)
        vv = v.new_zeros(n_seq * self.t_max, hkv, d)
        kk.index_copy_(0, self._new_dst, k)
        vv.index_copy_(0, self._new_dst, v)
        data = self.storage.data[layer]
        if self._pk is not None:
            dst, sk, sv = self._pk
            kk.index_copy_(0, dst, data.index_select(0, sk).view(-1, hkv, d).to(k.dtype))
            vv.index_copy_(0, dst, data.index_select(0, sv).view(-1, hkv, d).to(v.dtype))
        if self._ph is not None:
            dst, rows, pos = self._ph
            kr, vr = self.kv_from_hidden(layer, self._gather_hidden(layer, rows).to(k.dtype), pos)
            kk.index_copy_(0, dst, kr)
            vv.index_copy_(0, dst, vr)
        qq = q.new_zeros(n_seq * self.q_max, hq, d)
        qq.index_copy_(0, self._q_dst, q)
        o = F.scaled_dot_product_attention(
            qq.view(n_seq, self.q_max, hq, d).transpose(1, 2),
            kk.view(n_seq, self.t_max, hkv, d).transpose(1, 2),
            vv.view(n_seq, self.t_max, hkv, d).transpose(1, 2),
            attn_mask=self._mask, enable_gqa=hq != hkv)
        return o.transpose(1, 2).reshape(n_seq * self.q_max, hq, d).index_select(0, self._q_dst)


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
