"""Runs one GR retrieval batch to completion: a packed prefill, then one staged decode step per SID level.

    prefill(all prompts) → shared_kv, level-0 logits at each prompt's last position → top-BW of one distribution
        (``prefill_rows``: the last layer past K/V runs on those last positions only; docs/gpu.md "The prefill")
    for level in 1..depth-1:
        host thread: build this level's sparse item mask from the beams' trie nodes   ┐ overlapped
        model: forward the BW beams' previous tokens (staged attention)               ┘
        masked log-softmax → per-beam top-K → global top-BW → reorder beams and unshared_kv by parent

Decoder-only mapping (decided; see docs/decisions.md): the first SID token comes from the prefill's last
position, so a depth-D SID takes 1 prefill + (D−1) decode forwards; decode token s (0-based) of every beam sits
at position L + s. The unshared cache is sized BW × D slots as the paper specifies (slot D−1 is never written:
the last token's K/V is never needed).

A request with a ``ThinkSpec`` first writes its thought (``engine/think.py``); its prompt + thought + sid_begin K/V
is copied into its ``shared_kv`` slot (not recomputed) and its beams start from the hidden state at sid_begin; the
other requests of the batch are prefilled packed as usual.

With a prefix cache (``self.prefix``, ``kvcache/prefix_blocks.py``) each prompt's longest cached block-aligned
prefix is copied into its ``shared_kv`` slot first and only the rest is prefilled (a thinking request's text stage
starts from it too); after the prefill the prompts' new full blocks are stored. The beam search is unchanged.

Batch invariance (``accel.batch_invariant``, on by default): every projection of the prefill and the beam steps and
the SID LM head run one GEMM per request (``RowGroups``, ``model/packed_linear.py``), and attention is per request
already (the prefill's per-prompt causal attention, the staged shared stage per request, the unshared stage per
beam), so a request's items and scores are the same bits alone as in any batch, at any position in it
(``tests/grserve/engine/test_batch_invariance.py``). The prefill's attention runs in query chunks aligned to the
prefix cache's blocks (``prefill_align``), so a prompt whose prefix came from the prefix cache gets the same K/V as
computed whole, where the GEMMs' rows do not depend on the row count (its rest is prefilled with another M). A
thinking request's prompt is prefilled the same way (``think.ThoughtKV``: the same chunks, the same packed
projections). Not covered: ``prefill_compile`` (one compiled call over the packed prompts).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from grserve.attention.beam_context import BeamDecodeContext, PrefillContext
from grserve.catalog import Catalog
from grserve.catalog.allowlist import Allow, item_filter
from grserve.config import AccelConfig, PrefixCacheConfig, SearchConfig
from grserve.engine.think import ThinkSpec, Thought, think
from grserve.kvcache.beam import BeamKV
from grserve.kvcache.prefix_blocks import PrefixBlockCache, PrefixMatch
from grserve.model import Decoder
from grserve.model.packed_linear import PackedLinears, RowGroups, shared_pack
from grserve.model.prefill_compile import CompiledPrefill
from grserve.search.beam_search import BeamSearch, Hit


@dataclass
class BatchOutput:
    hits: list[list[Hit]]
    candidates_visited: int
    kv_bytes_per_request: list[int]
    kv_bytes_formula: list[int]
    trace: list[tuple[str, float, float]] = field(default_factory=list)  # (event, start, end), perf_counter
    thoughts: list[Thought | None] = field(default_factory=list)  # per request: its thought, if it thought
    cached_tokens: list[int] = field(default_factory=list)  # per request: prompt tokens loaded from the prefix cache


class RetrievalRunner:
    def __init__(self, model: Decoder, search: SearchConfig, accel: AccelConfig | None = None):
        self.model = model
        self.search = search
        self.accel = accel or AccelConfig()
        # oneDNN-prepacked projections on a CPU that has them (model/packed_linear.py), else None: F.linear
        self.packed = shared_pack(model, self.accel.cpu_packed_linears)
        # (not for a quantized model: the compiled layers run F.linear on the unquantized weights)
        self.compiled = CompiledPrefill(model, self.accel.prompt_bucket) \
            if self.accel.prefill_compile and getattr(model, "quantized", None) is None else None
        self.prefix: PrefixBlockCache | None = None  # the engine's prefix cache (kvcache/prefix_blocks.py), if on
        # the prefill's attention in query chunks aligned to the prefix cache's blocks, cache on or off (the engine
        # sets its --prefix-block-size): a prompt's K/V and answers are then the same computed whole or after a
        # cached prefix, and with the cache on or off (attention/prefix_prefill.py::block_aligned_attention)
        self.prefill_align = PrefixCacheConfig().prefix_block_size
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grserve-mask") if search.overlap_masks else None

    def close(self) -> None:
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=False)

    @torch.inference_mode()
    def run(
        self, prompts: list[np.ndarray], beam_width: int, top_n: list[int], catalog: Catalog, trace: bool = False,
        exclude: list[np.ndarray | None] | None = None, include: list[Allow | None] | None = None,
        think: list[ThinkSpec | None] | None = None,
    ) -> BatchOutput:
        """One batch; ``exclude[i]``: item ids request ``i`` must never get, ``include[i]``: the only items it may get
        (both masked inside the search: ``catalog/exclusion.py``, ``catalog/allowlist.py``); ``think[i]``: request
        ``i`` thinks first (the module docstring)."""
        model, dev = self.model, self.model.device
        events: list[tuple[str, float, float]] = []
        r, depth = len(prompts), catalog.depth
        exclude, include = exclude or [None] * r, include or [None] * r
        exclusions = [item_filter(catalog, e, a) for e, a in zip(exclude, include)]
        beams = BeamSearch(catalog, r, beam_width, self.search.top_k, self.search.topbw, dev, exclusions)
        hf = self.search.scoring == "hf"

        t0 = time.perf_counter()
        kv, last, thoughts, cached = self._prefill(prompts, beam_width, depth, think or [None] * r)
        lens = kv.prompt_lens
        invariant = self.accel.batch_invariant
        one = RowGroups.uniform(r, 1) if invariant else None  # the level-0 head: one row per request
        per_beam = RowGroups.uniform(r, beam_width) if invariant else None  # a beam step: BW rows per request
        self._level_logits(last, catalog, 0, beams, one)
        beams.select_first(self._full_lse(last, one) if hf else None)
        events.append(("prefill", t0, time.perf_counter()))

        base_pos = torch.tensor(lens, device=dev).repeat_interleave(beam_width)
        for level in range(1, depth):
            t_fwd = time.perf_counter()
            mask_job = self._submit_mask(beams, level, events)
            hidden = model(beams.next_tokens, base_pos + (level - 1), BeamDecodeContext(kv, step=level - 1),
                           packed=self.packed, groups=per_beam)
            self._level_logits(hidden, catalog, level, beams, per_beam)
            lse = self._full_lse(hidden, per_beam) if hf else None
            events.append((f"forward{level}", t_fwd, time.perf_counter()))
            if mask_job is not None:
                mask_job.result()
            t_sel = time.perf_counter()
            parents = beams.select(level, lse)
            if level < depth - 1:
                kv.reorder(parents)
            events.append((f"select{level}", t_sel, time.perf_counter()))

        return BatchOutput(
            hits=beams.results(top_n),
            candidates_visited=beams.candidates_visited,
            kv_bytes_per_request=[kv.request_nbytes(i) for i in range(r)],
            kv_bytes_formula=[(n + beam_width * depth) * kv.bytes_per_token for n in lens],
            trace=events if trace else [],
            thoughts=thoughts,
            cached_tokens=cached,
        )

    def _prefill(self, prompts: list[np.ndarray], beam_width: int, depth: int, specs: list[ThinkSpec | None]
                 ) -> tuple[BeamKV, torch.Tensor, list[Thought | None], list[int]]:
        """The batch's ``BeamKV`` with every request's prompt (+ thought) in ``shared_kv``, the hidden state
        [R, H] each request's beams start from, the thoughts and each prompt's tokens loaded from the prefix cache:
        thoughts first, then one packed prefill of the other prompts (of what the prefix cache did not have)."""
        model, spec, dev, prefix = self.model, self.model.spec, self.model.device, self.prefix
        thoughts = [think(model, p, s, prefix, self.packed, self.prefill_align) if s is not None else None
                    for p, s in zip(prompts, specs)]
        lens = [int(p.shape[0]) + (len(t.tokens) if t is not None else 0) for p, t in zip(prompts, thoughts)]
        kv = BeamKV(num_layers=spec.num_hidden_layers, num_kv_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
                    prompt_lens=lens, beam_width=beam_width, decode_steps=depth, dtype=model.dtype, device=dev)
        fresh = [i for i, t in enumerate(thoughts) if t is None]
        cached = [t.cached_tokens if t is not None else 0 for t in thoughts]
        matches: list[PrefixMatch | None] = [None] * len(prompts)
        if prefix is not None:
            for i in fresh:
                matches[i] = prefix.load(prompts[i], *kv.shared_request(i))
                cached[i] = matches[i].tokens
        last = torch.empty(len(prompts), spec.hidden_size, dtype=model.dtype, device=dev)
        if fresh:
            tokens = torch.from_numpy(np.concatenate([prompts[i][cached[i]:] for i in fresh]).astype(np.int64)).to(dev)
            positions = torch.cat([torch.arange(cached[i], lens[i]) for i in fresh]).to(dev)
            ctx = PrefillContext(kv, None if len(fresh) == len(prompts) else fresh, cached if any(cached) else None,
                                 self.accel.prefill_attention, self.prefill_align)
            sizes = [lens[i] - cached[i] for i in fresh]
            rows = torch.from_numpy(np.cumsum(sizes) - 1).to(dev)
            groups = RowGroups(sizes) if self.accel.batch_invariant else None
            last[fresh] = prefill_rows(model, self.accel, tokens, positions, ctx, rows, self.packed, self.compiled,
                                       groups)
        for i, t in enumerate(thoughts):
            if t is not None:
                for layer in range(spec.num_hidden_layers):
                    kv.write_shared_request(layer, i, t.kv.k[layer], t.kv.v[layer])
                last[i] = t.last_hidden[0]
                matches[i] = t.prefix_match
        if prefix is not None:  # the prompts' new full blocks (a thought's tokens are not part of its prompt's)
            for i, mt in enumerate(matches):
                if mt is not None:
                    prefix.store(prompts[i], mt, *kv.shared_request(i))
        return kv, last, thoughts, cached

    def _submit_mask(self, beams: BeamSearch, level: int, events: list):
        def build():
            t = time.perf_counter()
            with torch.inference_mode():  # buffers were made under inference mode; this may be another thread
                beams.prepare_mask(level)
            events.append((f"mask{level}", t, time.perf_counter()))

        if self._mask_pool is None:
            build()
            return None
        return self._mask_pool.submit(build)

    def _level_logits(self, hidden: torch.Tensor, catalog: Catalog, level: int, beams: BeamSearch,
                      groups: RowGroups | None = None) -> None:
        # fp32 from here on whatever the model dtype: the masked log-softmax and the beam scores (search/)
        beams.logits[level].copy_(self.model.logits(hidden, beams.heads.rows[level], groups))

    def _full_lse(self, hidden: torch.Tensor, groups: RowGroups | None = None) -> torch.Tensor:
        return torch.logsumexp(self.model.logits(hidden, None, groups).float(), dim=-1, keepdim=True)


def prefill_rows(model: Decoder, accel: AccelConfig, tokens: torch.Tensor, positions: torch.Tensor, ctx,
                 rows: torch.Tensor, packed: PackedLinears | None = None, compiled: CompiledPrefill | None = None,
                 groups: RowGroups | None = None) -> torch.Tensor:
    """The prefill of both runners: every token's K/V into ``ctx``'s cache, each prompt's last hidden row [S, H]
    back (``rows``: their packed indices). ``accel.prefill_last_rows``: the last layer past K/V on those rows only;
    ``compiled``: the layers through ``model/prefill_compile.py``; ``groups``: each prompt's rows, one GEMM per
    prompt (batch invariance; not honoured by ``compiled``)."""
    keep = rows if accel.prefill_last_rows else None
    if compiled is not None:
        h = compiled(tokens, positions, ctx, keep)
    else:
        h = model(tokens, positions, ctx, packed=packed, last_rows=keep, groups=groups)
    return h if keep is not None else h[rows]
