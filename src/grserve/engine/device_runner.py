"""The device fast path of GR retrieval: fixed-shape beam steps, captured once per bucket as CUDA graphs.

    prefill           packed prompts → each prompt's K/V into its padded shared slot (one varlen flash call on
                      CUDA; the last layer on the last rows only; ``--prefill-compile``: compiled layer pieces);
                      level-0 logits → first()
    per level l ≥ 1   ONE function (``_step``): decoder forward with staged attention over ``PaddedBeamKV``
                      (backend: torch | triton), the LM head on level l's token rows only
                      (``search/level_heads.py``), masked top-k/expand with the trie on the device, exact
                      fixed-shape top-BW, code/node/token update, unshared-KV reorder by parent
    results           one host copy per batch

A *bucket* is (R_b, BW, L_cap, scoring, catalog): the batch's request count padded up to a ``batch_buckets``
entry, its longest prompt up to a multiple of ``prompt_bucket``. A bucket owns its static buffers (KV, beam state,
inputs) and, on CUDA with ``cuda_graphs``, one ``torch.cuda.CUDAGraph`` per level, all captured in one shared
memory pool: the first batch of a bucket runs each level eagerly (the warm-up, also the real computation of that
batch), then captures it; later batches copy their inputs in and replay. On CPU (or with graphs off) the same
``_step`` runs eagerly. Batches on one runner are serialised (the buckets' buffers are shared state).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from grserve.attention.backends import get_backend
from grserve.attention.padded import PaddedBeamDecodeContext, PaddedPrefillContext
from grserve.catalog import Catalog
from grserve.config import AccelConfig, SearchConfig
from grserve.engine.retrieval import BatchOutput, prefill_rows
from grserve.flags import split_commas
from grserve.kvcache.padded_beam import PaddedBeamKV
from grserve.kvcache.prefix_blocks import PrefixBlockCache
from grserve.model import Decoder
from grserve.model.prefill_compile import CompiledPrefill
from grserve.search.device_beams import DeviceBeamState
from grserve.search.device_trie import DeviceTrie
from grserve.search.level_heads import level_heads
from grserve.search.masked_topk import masked_topk_expand_backend


class _Bucket:
    """Static buffers (and captured graphs) of one bucket."""

    def __init__(self, model: Decoder, trie: DeviceTrie, catalog: Catalog, r: int, bw: int, max_len: int,
                 top_k: int | None):
        spec, dev = model.spec, model.device
        depth = catalog.depth
        self.kv = PaddedBeamKV(num_layers=spec.num_hidden_layers, num_kv_heads=spec.num_key_value_heads,
                               head_dim=spec.head_dim, num_requests=r, max_len=max_len, beam_width=bw,
                               decode_steps=depth, dtype=model.dtype, device=dev)
        self.heads = level_heads(catalog.layout, dev)
        self.state = DeviceBeamState(trie, self.heads, r, bw, top_k, dev)
        self.positions = torch.zeros(depth, r * bw, dtype=torch.int64, device=dev)  # row l: level-l step
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.r, self.bw = r, bw

    def load(self, lens: list[int]) -> None:
        self.kv.set_lengths(lens)
        base = torch.tensor(lens + [0] * (self.r - len(lens)), dtype=torch.int64).repeat_interleave(self.bw)
        steps = torch.arange(self.positions.shape[0], dtype=torch.int64)[:, None] - 1
        self.positions.copy_(base[None, :] + steps)


class DeviceRetrievalRunner:
    """Same contract as ``RetrievalRunner.run``; results equal (tests: items and scores to fp32 tolerance)."""

    def __init__(self, model: Decoder, search: SearchConfig, accel: AccelConfig | None = None):
        self.model, self.search = model, search
        self.prefix: PrefixBlockCache | None = None  # the engine's prefix cache (kvcache/prefix_blocks.py), if on
        self.accel = accel or AccelConfig(fast_path="on")
        self.backend = get_backend(self.accel.attention_backend, model.device.type)
        self.topk_fn = masked_topk_expand_backend(self.accel.attention_backend)
        self.buckets_r = sorted(split_commas(self.accel.batch_buckets, int))
        self.use_graphs = self.accel.cuda_graphs and model.device.type == "cuda"
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._buckets: dict[tuple, _Bucket] = {}
        self._tries: dict[int, tuple[Catalog, DeviceTrie]] = {}
        self._lock = threading.Lock()
        self.captures = 0  # graphs captured so far
        self.capture_s = 0.0  # time spent in warm-up + capture (reported apart from steady-state batches)
        self.compiled = CompiledPrefill(model, self.accel.prompt_bucket) if self.accel.prefill_compile else None

    def close(self) -> None:
        self._buckets.clear()

    # ---- buckets ----------------------------------------------------------------------------------------------
    def _trie(self, catalog: Catalog) -> DeviceTrie:
        hit = self._tries.get(id(catalog))
        if hit is None or hit[0] is not catalog:
            if self._tries:  # a new catalog: the old one's graphs read its trie tensors; drop both
                self._tries.clear()
                self._buckets.clear()
            hit = self._tries[id(catalog)] = (catalog, DeviceTrie(catalog, self.model.device))
        return hit[1]

    def bucket_key(self, lens: list[int], beam_width: int) -> tuple[int, int]:
        r_b = next((b for b in self.buckets_r if b >= len(lens)), len(lens))
        step = self.accel.prompt_bucket
        return r_b, -(-max(lens) // step) * step

    def _bucket(self, catalog: Catalog, lens: list[int], beam_width: int) -> _Bucket:
        trie = self._trie(catalog)
        r_b, l_cap = self.bucket_key(lens, beam_width)
        key = (r_b, beam_width, l_cap, self.search.scoring)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(self.model, trie, catalog, r_b, beam_width, l_cap, self.search.top_k)
        return b

    # ---- one batch --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, prompts: list[np.ndarray], beam_width: int, top_n: list[int], catalog: Catalog,
            trace: bool = False) -> BatchOutput:
        with self._lock:
            lens = [int(p.shape[0]) for p in prompts]
            b = self._bucket(catalog, lens, beam_width)
            events: list[tuple[str, float, float]] = []
            sync = torch.cuda.synchronize if trace and self.model.device.type == "cuda" else (lambda: None)
            t0 = time.perf_counter()
            b.load(lens)
            cached = self._prefill(b, prompts, lens, catalog)
            sync()  # only when tracing: the events then time the device work, not the launches
            events.append(("prefill", t0, time.perf_counter()))
            for level in range(1, catalog.depth):
                t = time.perf_counter()
                self._run_level(b, level, catalog)
                sync()
                events.append((f"step{level}", t, time.perf_counter()))
            hits = b.state.results(catalog, top_n)
            formula = [(n + beam_width * catalog.depth) * b.kv.bytes_per_token for n in lens]
            return BatchOutput(hits=hits, candidates_visited=int(b.state.visited),
                               kv_bytes_per_request=[b.kv.request_nbytes()] * len(lens),
                               kv_bytes_formula=formula, trace=events if trace else [], cached_tokens=cached)

    def _prefill(self, b: _Bucket, prompts, lens: list[int], catalog: Catalog) -> list[int]:
        """Returns each prompt's tokens loaded from the prefix cache (``self.prefix``; the rest is prefilled)."""
        model, dev, prefix = self.model, self.model.device, self.prefix
        matches = [prefix.load(p, *b.kv.shared_request(r)) for r, p in enumerate(prompts)] if prefix else []
        cached = [mt.tokens for mt in matches] or [0] * len(lens)
        offsets = np.concatenate([[0], np.cumsum([n - m for n, m in zip(lens, cached)])]).tolist()
        tokens = torch.from_numpy(np.concatenate([p[m:] for p, m in zip(prompts, cached)]).astype(np.int64)).to(dev)
        positions = torch.cat([torch.arange(m, n) for n, m in zip(lens, cached)]).to(dev)
        ctx = PaddedPrefillContext(b.kv, offsets, cached if any(cached) else None, self.accel.prefill_attention)
        rows = torch.tensor(offsets[1:], device=dev) - 1
        last = prefill_rows(model, self.accel, tokens, positions, ctx, rows, compiled=self.compiled)
        for r, (p, mt) in enumerate(zip(prompts, matches)):
            prefix.store(p, mt, *b.kv.shared_request(r))
        c0 = catalog.codebook_sizes[0]
        logits = torch.zeros(b.r, c0, dtype=torch.float32, device=dev)
        logits[: len(lens)] = model.logits(last, b.heads.rows[0]).float()
        full = None
        if self.search.scoring == "hf":
            full = torch.zeros(b.r, dtype=torch.float32, device=dev)
            full[: len(lens)] = torch.logsumexp(model.logits(last).float(), dim=-1)
        b.state.first(logits, len(lens), full)
        return cached

    def _run_level(self, b: _Bucket, level: int, catalog: Catalog) -> None:
        if not self.use_graphs:
            self._step(b, level, catalog)
            return
        g = b.graphs.get(level)
        if g is not None:
            g.replay()
            return
        t = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(b, level, catalog)  # warm-up = this batch's real step (compiles/loads every kernel)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._step(b, level, catalog)  # recorded only: the state is not advanced twice
        b.graphs[level] = g
        torch.cuda.synchronize()
        self.captures += 1
        self.capture_s += time.perf_counter() - t

    def _step(self, b: _Bucket, level: int, catalog: Catalog) -> None:
        """The one beam-step function (captured on CUDA, eager elsewhere)."""
        model, st = self.model, b.state
        ctx = PaddedBeamDecodeContext(b.kv, level - 1, self.backend)
        hidden = model(st.tokens, b.positions[level], ctx)
        logits = model.logits(hidden, b.heads.rows[level])
        full = torch.logsumexp(model.logits(hidden).float(), dim=-1) if self.search.scoring == "hf" else None
        parents = st.select(level, logits, self.topk_fn, full)
        if level < catalog.depth - 1:
            b.kv.reorder(parents, level)
