"""Continuous-batching LLM engine: executes the scheduler's plan over the hybrid KV/hidden block pool.

One ``step()`` = one iteration: build the plain ``SchedulerInput`` (W, R, pool arithmetic), ask the policy,
then execute its ``SchedulerOutput`` — preempt (free blocks, back to the front of W, recompute later), grow
block tables, run one packed forward pass (``HybridPagedContext``), sample (temperature / top-p / seed), apply
stop conditions (max_tokens, EOS, stop token ids, stop strings), free finished requests' blocks.

The executor is swappable: ``ModelExecutor`` runs the real model; ``grserve_bench.simulator.SimulatedExecutor``
returns a cost-model duration instead (the discrete-event simulator). The clock is injectable (virtual time
in the benchmark). ``abort()`` frees a request's blocks at once. One thread drives an engine (``AsyncLLMEngine``'s
step loop, which applies other threads' requests between steps; or a benchmark); it takes no lock.

Prefix cache: ``prefix_cache`` (default None) is a ``kvcache.prefix_kv.PrefixKVStore`` (a radix tree of cached
prompt spans with a pluggable eviction policy, e.g. LARU). A KV request admitted to prefill first copies its
longest cached prefix into its blocks and computes only the rest, within the tokens the scheduler planned (so
memory stays exactly as planned); its first sampled token (the end of its prefill) saves its computed tokens'
K/V into the store. Hidden-cache requests do not use it. With ``prefix_cache_mode="share"`` (the default of
``build_model_engine``) the cache is a ``kvcache.shared_prefix.SharedPrefixCache`` instead: cached full blocks are
attached to the request's table (reference-counted, no copy) and the pool counts the cache's idle blocks as free.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
import torch

from grserve.attention.decode_staging import GROW_TOKENS, DecodeStaging
from grserve.attention.hybrid import INVARIANT_KEY_BLOCK, HybridPagedContext, SeqSlice
from grserve.config import Priority
from grserve.kvcache.blocks import BlockPool, BlockTable, CacheKind, HybridCacheStorage
from grserve.engine.sampling import SampleOutput, SampleRow, SamplingParams, TokenLogprobs, sample
from grserve.engine.structured import fill_bitmasks
from grserve.engine.types import Handover, LLMFit
from grserve.model.cpu_support import cpu_support
from grserve.model.thread_choice import WIDE_STEP_TOKENS, torch_threads
from grserve.scheduler.llm_types import LLMScheduler, PoolView, SchedulerInput, SchedulerOutput, SeqView

log = logging.getLogger("grserve.engine")


class PrefixCache(Protocol):
    """What the engine calls on its prefix cache (``kvcache.prefix_kv.PrefixKVStore``)."""

    def match(self, tokens: list[int]) -> np.ndarray: ...

    def copy_in(self, slots: np.ndarray, storage: HybridCacheStorage, table) -> int: ...

    def save(self, tokens: list[int], storage: HybridCacheStorage, table) -> int: ...


@dataclass
class TokenEvent:
    """What a request got in one iteration (streamed to its client)."""

    seq_id: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "pause" | "abort" | "error"
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked for logprobs
    error: str | None = None  # why the request failed (finish_reason "error")
    prompt_kv: torch.Tensor | None = None  # on the first token's event of a request that asked (``export_kv``)
    cached_tokens: int = 0  # prompt tokens its admission took from the prefix cache (a cluster's usage)


class IncrementalDecoder(Protocol):
    """Turns one request's output tokens into text one token at a time (``engine/tokenizer.py``)."""

    def step(self, token_id: int) -> str: ...


@dataclass
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float
    on_event: Callable[[TokenEvent], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    num_computed: int = 0
    cache: CacheKind | None = None
    finished: bool = False
    finish_reason: str | None = None
    num_preemptions: int = 0
    seed: int = 0  # params.seed, or drawn at admission: every draw is a function of (seed, position)
    decoder: IncrementalDecoder | None = None
    parts: list[str] = field(default_factory=list)  # text emitted so far
    pending: str = ""  # decoded text held back (it could be the start of a stop string)
    error: str | None = None
    prefix_saved: bool = False  # this (re)prefill's tokens were offered to the prefix cache
    cached_tokens: int = 0  # prompt tokens its last admission took from the prefix cache (usage.cached_tokens)
    last_scheduled: float | None = None  # start of the last iteration that computed tokens for it (pending time)
    first_scheduled: float | None = None  # start of the first one (its queue time ends there)
    priority: Priority = Priority.ONLINE  # co-location class (scheduler/colocation.py)
    resumed: int = 0  # output tokens it started with (delivered by an earlier attempt elsewhere)
    pause_at: int | None = None  # end the attempt ("pause", text unfinished) at this many output tokens
    export_kv: bool = False  # hand out the K/V its first prefill computed (``TokenEvent.prompt_kv``)
    kv_in: torch.Tensor | None = None  # K/V [L, 2, m, width] of its first m tokens, computed elsewhere
    kv_out: torch.Tensor | None = None  # the exported K/V, until its first token's event carries it
    grammar: Any = None  # structured output: its grammar matcher (engine/structured.py), advanced per token

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None


@dataclass
class ExecItem:
    seq: Sequence
    start: int
    num_new: int
    kind: CacheKind
    sample: bool


class ModelExecutor:
    """Runs one packed forward over the hybrid cache; for the requests that sample it returns their logits, or,
    when every one of them is greedy, their token ids (list) chosen by the screened greedy head."""

    def __init__(self, model, storage: HybridCacheStorage, screened_greedy: bool = True, packed_linears: bool = True,
                 decode_staging: bool = True, batch_invariant: bool = False, decode_compile: str = "off",
                 decode_kernel: bool = True):
        self.model = model
        # a request's tokens do not depend on what shares its batch (attention/hybrid.py, docs/llm.md issue 42)
        self.batch_invariant = batch_invariant
        self.storage = storage
        spec = model.spec
        self.hkv, self.d = spec.num_key_value_heads, spec.head_dim
        from grserve.model.packed_linear import maybe_pack

        # oneDNN-prepacked projections on a CPU (model/packed_linear.py; the model is not changed); else F.linear
        self.packed = maybe_pack(model, packed_linears)
        # pure decode steps read K/V from a persistent head-major copy (attention/decode_staging.py); None: gather
        # GRSERVE_CPU_ISA=reference (model/cpu_support.py): every fast path off, the reference paths run
        fast = cpu_support().fast_paths or storage.data.device.type != "cpu"
        # pure-KV decode passes build their attention indices straight from the block tables (attention/hybrid.py)
        self.fast_index = fast
        self.staging = DecodeStaging(spec.num_hidden_layers, self.hkv, self.d, dtype=storage.data.dtype,
                                     device=storage.data.device,
                                     grow_tokens=INVARIANT_KEY_BLOCK if batch_invariant else GROW_TOKENS,
                                     ) if decode_staging and fast else None
        # staged decode attention by a C++ kernel built for this CPU (attention/decode_kernel.py), else SDPA. Not
        # under batch invariance: a request's decode attention would then differ between a staged step and a
        # gathered one (SDPA), which depends on what shares its step
        self.decode_kernel_status = ("SDPA (--no-decode-kernel)" if not decode_kernel
                                     else "SDPA (batch-invariant)" if batch_invariant else "SDPA")
        if self.staging is not None and decode_kernel and not batch_invariant and storage.data.device.type == "cpu":
            from grserve.attention.decode_kernel import decode_kernel as build_kernel
            from grserve.model.thread_choice import openmp_runtime_path

            self.staging.kernel, self.decode_kernel_status = build_kernel(
                spec.num_attention_heads // self.hkv, self.d, cpu_support().cpu_model, openmp_runtime_path())
        # exact greedy argmax through a bf16 screen of the LM head (engine/greedy_head.py), fp32 models only; its
        # GEMMs chosen by what the CPU can do. A bf16 model: every logit from ModelDtypeHead (packed where fast),
        # plain-greedy passes take its per-row max instead of the sampler's float64 argmax (the same token)
        self.greedy_head = self.dtype_head = None
        self.greedy_pick = screened_greedy  # off: every token through the sampler (the reference)
        if screened_greedy and fast and model.lm_head.weight.dtype == torch.float32:
            from grserve.engine.greedy_head import ScreenedGreedyHead

            self.greedy_head = ScreenedGreedyHead(model.lm_head.weight)
        elif fast and model.lm_head.weight.dtype != torch.float32:
            from grserve.engine.greedy_head import ModelDtypeHead

            self.dtype_head = ModelDtypeHead(model.lm_head.weight)
        # threads for a step of >= WIDE_STEP_TOKENS new tokens (model/thread_choice.py: an engine kept on fewer
        # threads than cores beside its front end); 0: every step on torch's current count. Not under batch
        # invariance (a GEMM's split over threads could move a row's bits with what shares its step)
        self.wide_threads = 0
        # pure decode passes through a torch.compile'd layer stack per row bucket (model/decode_compile.py); None:
        # the eager forward (off: the module, and its torch.library ops, not even imported)
        self.decode_compiled = None
        if decode_compile != "off":
            from grserve.model.decode_compile import decode_compiler

            self.decode_compiled = decode_compiler(model, self.packed, decode_compile)

    def describe(self) -> str:
        """Which paths this executor runs on this machine, and why (the start line of ``serve llm``)."""
        sup = cpu_support()
        if getattr(self.model, "quantized", None) is not None:
            lin = self.model.quantized.describe()
        elif self.storage.data.device.type != "cpu":
            lin = "F.linear"
        elif self.packed is not None:
            lin = f"oneDNN-packed {str(self.model.dtype).removeprefix('torch.')}"
        else:
            lin = "F.linear" + (f" ({sup.reason})" if sup.reason else "")
            if self.model.dtype == torch.bfloat16 and not sup.onednn_bf16:
                lin += "; bf16 weights without fast bf16 run slower than fp32 here (--dtype float32)"
        head = (self.greedy_head.describe() if self.greedy_head is not None
                else self.dtype_head.describe() if self.dtype_head is not None else "full logits + argmax")
        dc = self.decode_compiled.describe() if self.decode_compiled is not None else "decode step eager"
        return (f"CPU {sup.label()}: projections {lin}; greedy head {head}; "
                f"decode staging {'on' if self.staging is not None else 'off'}"
                f"{'' if self.staging is None else ' (attention: ' + self.decode_kernel_status + ')'}; "
                f"batch-invariant {'on' if self.batch_invariant else 'off'}; {dc}")

    def execute(self, items: list[ExecItem], pool: BlockPool) -> tuple[torch.Tensor | list[int] | None, None]:
        ids: list[int] = []
        pos: list[int] = []
        slices, rows = [], []
        for it in items:
            seq, a, b = it.seq, it.start, it.start + it.num_new
            plen = len(seq.prompt_ids)
            if a >= plen:  # decode: only generated tokens (no prompt + output list copy per step)
                ids.extend(seq.output_ids[a - plen: b - plen])
            elif b <= plen:
                ids.extend(seq.prompt_ids[a:b])
            else:
                ids.extend(seq.tokens[a:b])
            pos.extend(range(a, b))
            slices.append(SeqSlice(pool.table(it.seq.seq_id), it.start, it.num_new))
            if it.sample:
                rows.append(len(ids) - 1)
        dev = self.storage.data.device
        keys = tuple((it.seq.seq_id, it.seq.num_preemptions) for it in items) if self.staging is not None else None
        ctx = HybridPagedContext(self.storage, slices, self.model.kv_from_hidden, self.hkv, self.d, self.staging, keys,
                                 fast_index=self.fast_index, invariant=self.batch_invariant)
        with torch.inference_mode():
            try:
                ids_t, pos_t = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
                dc = self.decode_compiled
                if dc is not None and dc.accepts(ctx, len(ids)):
                    h = dc.forward(ids_t, pos_t, ctx)
                elif self.wide_threads and len(ids) >= WIDE_STEP_TOKENS and not self.batch_invariant:
                    with torch_threads(self.wide_threads):
                        h = self.model(ids_t, pos_t, ctx, packed=self.packed)
                else:
                    h = self.model(ids_t, pos_t, ctx, packed=self.packed)
            except BaseException:
                if self.staging is not None:
                    self.staging.invalidate()
                raise
            ctx.finish()
            if not rows:
                return None, None
            last = h[torch.tensor(rows, device=dev)]
            greedy = all(it.seq.params.plain_greedy for it in items if it.sample)
            if self.greedy_head is not None and greedy:
                return self.greedy_head.argmax(last).tolist(), None  # token ids, not logits
            if self.dtype_head is not None:
                if not (greedy and self.greedy_pick):
                    return self.dtype_head.logits(last), None
                ids, logits = self.dtype_head.pick(last)
                return (ids.tolist() if ids is not None else logits), None
            if self.batch_invariant and last.dtype == torch.float32:  # MKL's sgemm rounds a row by the row count
                from grserve.model.packed_linear import RowGroups

                return self.model.logits(last, groups=RowGroups.uniform(len(rows), 1)), None
            return self.model.logits(last), None


def calibrate_rho(model, token_counts=(32, 128, 512), repeats: int = 3, timer=time.perf_counter) -> float:
    """ρ (seconds per cached token): the slope of the all-layer K/V re-projection time vs tokens (§4.2 'profiled
    before serving'; the Repo times the fused QKV linear and divides by 5 — we time exactly ``kv_from_hidden``
    and do not divide)."""
    spec = model.spec
    xs, ys = [], []
    with torch.inference_mode():
        for n in token_counts:
            h = torch.randn(n, spec.hidden_size, dtype=model.dtype, device=model.device)
            pos = torch.arange(n, device=model.device)
            best = float("inf")
            for _ in range(repeats):
                t0 = timer()
                for layer in range(spec.num_hidden_layers):
                    model.kv_from_hidden(layer, h, pos)
                best = min(best, timer() - t0)
            xs.append(n), ys.append(best)
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(slope, 0.0)


class LLMEngine:
    def __init__(self, scheduler: LLMScheduler, pool: BlockPool, executor, *, eos_token_id: int | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, clock: Callable[[], float] = time.perf_counter,
                 max_model_len: int | None = None, prefix_cache: PrefixCache | None = None,
                 on_iteration: Callable[[SchedulerOutput, float], None] | None = None,
                 decoder_factory: Callable[[list[int]], IncrementalDecoder] | None = None,
                 structured: Any = None):
        self.scheduler = scheduler
        # structured output (engine/structured.py's StructuredBackend): compiles a request's grammar, makes its
        # matcher; None: a request asking for one is refused
        self.structured = structured
        self.pool = pool
        self.executor = executor
        self.eos_token_id = eos_token_id
        self.detokenize = detokenize
        # one incremental decoder per request (given the prompt); from a plain decode function, a window scheme
        if decoder_factory is None and detokenize is not None:
            from grserve.engine.tokenizer import WindowDecoder

            def decoder_factory(prompt_ids: list[int]) -> IncrementalDecoder:
                return WindowDecoder(detokenize)
        self.decoder_factory = decoder_factory
        self.clock = clock
        self.max_model_len = max_model_len
        self.fit = LLMFit(max_model_len, pool.num_blocks, pool.block_size, pool.kv_planes)  # what it can ever hold
        self.prefix_cache = prefix_cache
        self._storage = getattr(executor, "storage", None)
        if prefix_cache is not None and self._storage is None:
            raise ValueError("a prefix cache needs an executor with tensor storage (not the simulator)")
        self.on_iteration = on_iteration
        self._observe_step = getattr(scheduler, "observe_step", None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}
        self.finished: list[Sequence] = []
        self.keep_finished = False
        self._next_id = 0
        self.iterations = 0
        self.last_step_progressed = False  # did the last step() schedule or preempt anything?
        self.stats = {"preemptions": 0, "hidden_scheduled": 0, "kv_scheduled": 0, "iterations_at_limit": 0,
                      "prefix_hit_tokens": 0, "prefill_tokens": 0, "offline_preemptions": 0}

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, arrival: float | None = None,
                    on_event: Callable[[TokenEvent], None] | None = None, seq_id: int | None = None,
                    priority: Priority | str = Priority.ONLINE, handover: Handover | None = None) -> int:
        """Queue a request; raises ValueError if it can never fit (model length or pool size). ``priority``: its
        co-location class (only a co-location policy, ``scheduler/colocation.py``, tells them apart). ``handover``:
        what a request carries across cluster instances (``engine.types.Handover``)."""
        priority = Priority.of(priority)
        self.fit.check(len(prompt_ids), params.max_tokens)
        handover = handover if handover is not None else Handover()
        if len(handover.delivered) >= params.max_tokens:
            raise ValueError(f"{len(handover.delivered)} tokens delivered: nothing left of max_tokens "
                             f"{params.max_tokens}")
        if seq_id is None:
            seq_id = self._next_id
            self._next_id += 1
        seq = Sequence(seq_id, list(prompt_ids), params, self.clock() if arrival is None else arrival, on_event)
        seq.seed = params.seed if params.seed is not None else random.getrandbits(63)
        seq.priority = priority
        if params.structured is not None:
            if self.structured is None:
                raise ValueError("structured output needs the model's tokenizer (this engine has none)")
            seq.grammar = self.structured.matcher(params.structured)  # GrammarError (a ValueError): no compile
        if self.decoder_factory is not None:
            seq.decoder = self.decoder_factory(seq.prompt_ids)
        self._resume(seq, handover)
        self.seqs[seq_id] = seq
        self.waiting.append(seq)
        return seq_id

    def _resume(self, seq: Sequence, handover: Handover) -> None:
        """Start ``seq`` after the tokens an earlier attempt delivered: they are its first outputs (sampling,
        penalties and stop rules see them so; admission recomputes them like a preempted request's), and its
        incremental decoder replays them, so its text state — the characters held back for a stop string or an
        unfinished UTF-8 character — is what the earlier attempt's was; its events carry only what follows."""
        seq.output_ids = list(handover.delivered)
        seq.resumed = len(seq.output_ids)
        if handover.pause_after is not None:
            seq.pause_at = seq.resumed + handover.pause_after
        seq.export_kv, seq.kv_in = handover.export_kv, handover.prompt_kv
        for tok in seq.output_ids if seq.grammar is not None else ():
            if not seq.grammar.accept_token(tok):
                raise ValueError(f"the delivered token {tok} does not follow the request's grammar")
        if seq.decoder is not None:
            for tok in seq.output_ids:
                self._new_text(seq, tok, final=False)

    def abort(self, seq_id: int) -> bool:
        """Cancel a request and free its blocks now. Returns False if it is unknown or already finished."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.finished:
            return False
        self._finish(seq, "abort")
        return True

    def priority_counts(self) -> dict[str, int]:
        """Running and waiting requests per priority: ``running_online``, ``waiting_offline``, ...

        Read from other threads while the loop steps: ``stats()`` is asked from event loops (``/health``,
        ``/metrics``, a cluster instance's poll, which is its heartbeat), which must not wait for a step. Each queue
        is copied in one C call (atomic under the GIL), so a count is at most one step old and never torn within a
        queue."""
        out = {f"{q}_{p}": 0 for q in ("running", "waiting") for p in Priority}
        for q, seqs in (("running", list(self.running)), ("waiting", list(self.waiting))):
            for s in seqs:
                out[f"{q}_{s.priority}"] += 1
        return out

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the iteration
    def _view(self, s: Sequence) -> SeqView:
        p = self.pool
        return SeqView(s.seq_id, s.arrival, s.token_times[-1] if s.token_times else None, s.num_tokens,
                       s.num_computed, len(s.output_ids) - s.resumed, s.cache, p.blocks_of(s.seq_id),
                       p.freeable_blocks(s.seq_id) if p.shared_credit else -1, s.last_scheduled, s.priority,
                       s.num_preemptions, s.token_times[0] if s.token_times else None)

    def scheduler_input(self) -> SchedulerInput:
        """Shared prefix blocks: a table counts them all (its growth arithmetic), so the total is raised by the
        blocks counted more than once (``shared_credit``) and a preemption frees only ``freeable_blocks``."""
        p = self.pool
        return SchedulerInput(self.clock(), tuple(self._view(s) for s in self.waiting),
                              tuple(self._view(s) for s in self.running),
                              PoolView(p.num_blocks + p.shared_credit, p.num_free, p.block_size, p.kv_planes,
                                       p.hidden_planes))

    def step(self) -> list[TokenEvent]:
        self.last_step_progressed = False
        if not self.has_work():
            return []
        inp = self.scheduler_input()
        plan = self.scheduler.schedule(inp)
        self.iterations += 1
        # An idle plan (nothing scheduled, nothing preempted) changes no state: the driver must let time pass
        # (run_trace jumps to the next arrival; AsyncLLMEngine waits) or it would spin forever.
        self.last_step_progressed = bool(plan.scheduled or plan.preempted)
        # 1. preemption (recompute): free, back to the front of W in their original order
        for sid in reversed(plan.preempted):
            seq = self.seqs[sid]
            self.pool.free(sid)
            seq.num_computed, seq.cache, seq.prefix_saved = 0, None, False
            seq.num_preemptions += 1
            self.stats["preemptions"] += 1
            if seq.priority == Priority.OFFLINE:
                self.stats["offline_preemptions"] += 1
            if seq in self.running:
                self.running.remove(seq)
                self.waiting.appendleft(seq)
        if not plan.scheduled:
            return []
        planned = sum(self.pool.extra_blocks_for(x.seq_id, self.seqs[x.seq_id].num_computed + x.num_tokens, x.cache)
                      for x in plan.scheduled)
        if self.pool.num_free < planned:
            self.stats["iterations_at_limit"] += 1
        spare = max(0, self.pool.num_free - planned)  # blocks no planned item needs (a cached prefix may use them)
        # 2. admit + grow block tables
        items: list[ExecItem] = []
        for x in plan.scheduled:
            seq = self.seqs[x.seq_id]
            if seq.cache is not None and seq.cache != x.cache:  # a policy switching kinds without preempting
                raise RuntimeError(f"seq {x.seq_id}: cache switch {seq.cache}->{x.cache} must be a preemption")
            admitted = seq.cache is None
            if admitted:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.cache = x.cache
            n = min(x.num_tokens, seq.num_tokens - seq.num_computed)
            if admitted and x.cache == "kv" and seq.num_computed == 0 and (
                    self.prefix_cache is not None or seq.kv_in is not None):
                n, used = self._load_prefix(seq, n, spare)
                spare -= used
            self.pool.reserve(x.seq_id, seq.num_computed + n, x.cache)
            if admitted or seq.num_computed + n < seq.num_tokens or n > 1 or seq.num_computed < len(seq.prompt_ids):
                self.stats["prefill_tokens"] += n  # not a decode step (a 1-token last prompt chunk included)
            self.stats["hidden_scheduled" if x.cache == "hidden" else "kv_scheduled"] += 1
            items.append(ExecItem(seq, seq.num_computed, n, x.cache, seq.num_computed + n == seq.num_tokens))
        # 3. forward
        t0 = self.clock()
        for it in items:
            it.seq.last_scheduled = t0
            if it.seq.first_scheduled is None:
                it.seq.first_scheduled = t0
        logits, duration = self.executor.execute(items, self.pool)
        if duration is not None:  # simulated executor: advance the virtual clock
            self.clock_advance(duration)
        now = self.clock()
        if self.on_iteration is not None:
            self.on_iteration(plan, now - t0)
        if self._observe_step is not None:  # a policy that learns step latencies (co-location's model)
            self._observe_step(plan, now - t0)
        for it in items:
            it.seq.num_computed += it.num_new
            table = self.pool.table(it.seq.seq_id)
            table.num_tokens = it.seq.num_computed
            if it.sample and it.seq.export_kv:  # the end of its first prefill: hand its K/V out (cluster)
                it.seq.export_kv = False
                it.seq.kv_out = self._export(table, it.seq.num_computed if it.kind == "kv" else 0)
            if self.prefix_cache is not None and it.kind == "kv" and it.sample and not it.seq.prefix_saved:
                it.seq.prefix_saved = True  # the end of this (re)prefill: offer its tokens to the cache
                self.prefix_cache.save(it.seq.tokens[:it.seq.num_computed], self._storage, table)
        return self._sample_and_append([it.seq for it in items if it.sample], logits, now)

    def _sample_and_append(self, samplers: list[Sequence], logits, now: float) -> list[TokenEvent]:
        """Sample + stop conditions; a failure here fails only the request it belongs to."""
        if isinstance(logits, list):  # the executor already chose (greedy)
            out = SampleOutput(logits, [None] * len(logits), [None] * len(logits))
        elif logits is not None:
            out = self._sample(logits, samplers)
        else:
            toks = [self.executor.dummy_token(s) for s in samplers]
            out = SampleOutput(toks, [None] * len(toks), [None] * len(toks))
        events = []
        for seq, tok, lp, err in zip(samplers, out.token_ids, out.logprobs, out.errors):
            if err is not None:
                self.fail(seq, err)
                continue
            try:
                events.append(self._append_token(seq, tok, now, lp))
            except Exception as exc:  # noqa: BLE001 - e.g. its detokenizer: fail this request only
                log.exception("processing a token of request %s failed", seq.seq_id)
                self.fail(seq, f"processing the output failed: {type(exc).__name__}")
        return [e for e in events if e is not None]

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleOutput:
        """Sample every row at once; if that raises, row by row, so a failure is confined to its own row."""
        rows = [SampleRow(s.params, s.seed, s.num_tokens, s.prompt_ids, s.output_ids) for s in seqs]
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:  # each grammar's allowed tokens now (a failure here fails only its request, below)
            try:
                masks = fill_bitmasks([seqs[i].grammar for i in constrained], self.structured.words)
                for j, i in enumerate(constrained):
                    rows[i].allowed = masks[j]
            except Exception:  # noqa: BLE001
                log.exception("filling the grammar masks failed; row by row")
                for i in constrained:
                    try:
                        rows[i].allowed = fill_bitmasks([seqs[i].grammar], self.structured.words)[0]
                    except Exception as exc:  # noqa: BLE001
                        rows[i].allowed = np.zeros(self.structured.words, dtype=np.int32)  # -> this row's error
                        log.warning("request %s: grammar mask failed: %s", seqs[i].seq_id, exc)
        try:
            return sample(logits, rows, self.eos_token_id)
        except Exception:  # noqa: BLE001
            log.exception("batched sampling failed; sampling row by row")
        out = SampleOutput([0] * len(rows), [None] * len(rows), [None] * len(rows))
        for i, row in enumerate(rows):
            try:
                one = sample(logits[i:i + 1], [row], self.eos_token_id)
                out.token_ids[i], out.logprobs[i], out.errors[i] = one.token_ids[0], one.logprobs[0], one.errors[0]
            except Exception as exc:  # noqa: BLE001
                out.errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
        return out

    def fail(self, seq: Sequence, message: str) -> None:
        """End one request with an error (its client gets an error, never a normal finish)."""
        if seq.finished:
            return
        seq.error = message
        self._finish(seq, "error")

    def _load_prefix(self, seq: Sequence, n: int, spare: int) -> tuple[int, int]:
        """Load ``seq``'s prefix computed before — the K/V it brought (``kv_in``: a moved request's), else its
        longest cached prefix — into its blocks (m ≤ num_tokens − 1 tokens); return how many tokens to compute
        now and how many blocks beyond its plan it took. The prefix is free, so the request still computes its
        planned n tokens after it (fewer at the end of the prompt) if ``spare`` blocks (ones no other planned item
        needs) allow; otherwise it stays within the blocks planned for n tokens (m ≤ n − 1, computing n − m)."""
        pc = self.prefix_cache
        if seq.kv_in is not None:
            kv, seq.kv_in = seq.kv_in, None
            return self._copy_prefix(seq, n, spare, min(int(kv.shape[2]), seq.num_tokens - 1),
                                     lambda table, m: self._import(table, kv[:, :, :m]))
        if getattr(pc, "shares_blocks", False):  # SharedPrefixCache: attach cached blocks, no copy
            m, n_after, extra = pc.attach(seq.seq_id, seq.tokens, n, spare, self._storage)
            seq.num_computed = seq.cached_tokens = m
            self.stats["prefix_hit_tokens"] += m
            return n_after, extra
        slots = pc.match(seq.tokens)
        return self._copy_prefix(seq, n, spare, len(slots),
                                 lambda table, m: pc.copy_in(slots[:m], self._storage, table))

    def _copy_prefix(self, seq: Sequence, n: int, spare: int, m: int,
                     copy: Callable[[BlockTable, int], object]) -> tuple[int, int]:
        """``_load_prefix`` of a prefix of ``m`` tokens that is copied into the request's blocks (``copy(table,
        m)``, after the reservation; m may be cut to stay within the plan)."""
        if m <= 0:
            return n, 0
        n_after = min(n, seq.num_tokens - m)
        pool = self.pool
        extra = pool.extra_blocks_for(seq.seq_id, m + n_after, "kv") - pool.extra_blocks_for(seq.seq_id, n, "kv")
        if extra > spare:
            m = min(m, n - 1)
            n_after, extra = n - m, 0
        pool.reserve(seq.seq_id, m + n_after, "kv")
        copy(pool.table(seq.seq_id), m)
        seq.num_computed = seq.cached_tokens = m
        self.stats["prefix_hit_tokens"] += m
        return n_after, max(0, extra)

    def _export(self, table: BlockTable, m: int) -> torch.Tensor:
        """A copy of rows 0 … m−1 of ``table``'s K and V: ``[L, 2, m, width]`` (the prefix store's layout)."""
        rows = self._storage.row_index(table, 0, m)
        return torch.stack([self._storage.data[:, rows[0]], self._storage.data[:, rows[1]]], dim=1)

    def _import(self, table: BlockTable, kv: torch.Tensor) -> None:
        """Write K/V ``[L, 2, m, width]`` computed elsewhere into rows 0 … m−1 of ``table``."""
        rows = self._storage.row_index(table, 0, kv.shape[2])
        for plane in (0, 1):
            self._storage.data[:, rows[plane]] = kv[:, plane].to(self._storage.data)

    def clock_advance(self, dt: float) -> None:
        adv = getattr(self.clock, "advance", None)
        if adv is None:
            raise RuntimeError("a simulated executor needs a virtual clock with advance()")
        adv(dt)

    def _append_token(self, seq: Sequence, tok: int, now: float, lp: TokenLogprobs | None = None) -> TokenEvent | None:
        if seq.finished:
            return None
        if seq.grammar is not None and not seq.grammar.accept_token(tok):  # the mask allowed only what it accepts
            raise ValueError(f"token {tok} does not follow the request's grammar")
        seq.output_ids.append(tok)
        seq.token_times.append(now)
        p = seq.params
        reason = None
        if not p.ignore_eos and self.eos_token_id is not None and tok == self.eos_token_id:
            reason = "stop"
        elif tok in p.stop_token_ids:
            reason = "stop"
        elif seq.grammar is not None and seq.grammar.is_terminated():  # it accepted a stop token: complete
            reason = "stop"
        delta = self._new_text(seq, tok, reason is not None) if seq.decoder is not None else ""
        if delta is None:  # a stop string ended the text
            delta, reason = seq.parts[-1], "stop"
        if reason is None and len(seq.output_ids) >= p.max_tokens:
            reason = "length"
        if reason is None and seq.pause_at is not None and len(seq.output_ids) >= seq.pause_at:
            reason = "pause"  # the attempt's end, not the request's: the held-back text stays held back
        if reason not in (None, "pause") and seq.pending:
            delta += seq.pending
            seq.parts.append(seq.pending)
            seq.pending = ""
        ev = TokenEvent(seq.seq_id, [tok], delta, reason is not None, reason, [lp] if lp is not None else None,
                        prompt_kv=seq.kv_out, cached_tokens=seq.cached_tokens)
        seq.kv_out = None
        if reason is not None:
            self._finish(seq, reason, emit=False)
        if seq.on_event is not None:
            seq.on_event(ev)
        return ev

    def _new_text(self, seq: Sequence, tok: int, final: bool) -> str | None:
        """Decode one token incrementally; match stop strings on the held-back tail + the new text only. Returns
        the text safe to emit now, or None when a stop string was found (the text up to it is ``parts[-1]``)."""
        stops = seq.params.stop
        buf = seq.pending + seq.decoder.step(tok)  # type: ignore[union-attr]
        if stops:
            hits = [i for i in (buf.find(s) for s in stops) if i >= 0]
            if hits:
                seq.parts.append(buf[:min(hits)])
                seq.pending = ""
                return None
        hold = 0 if final or not stops else min(len(buf), max(len(s) for s in stops) - 1)
        emit, seq.pending = buf[:len(buf) - hold], buf[len(buf) - hold:]
        seq.parts.append(emit)
        return emit

    def _finish(self, seq: Sequence, reason: str, emit: bool = True) -> None:
        seq.finished, seq.finish_reason = True, reason
        self.pool.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.seqs.pop(seq.seq_id, None)
        if self.keep_finished:
            self.finished.append(seq)
        if emit and seq.on_event is not None:
            seq.on_event(TokenEvent(seq.seq_id, [], "", True, reason, error=seq.error))

    # ------------------------------------------------------------------ convenience (tests, offline runs)
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 max_iterations: int = 100_000) -> list[list[int]]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        self.keep_finished = True
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        for _ in range(max_iterations):
            if not self.has_work():
                break
            self.step()
        done = {s.seq_id: s for s in self.finished}
        return [done[i].output_ids for i in ids]


def build_model_engine(model, scheduler: LLMScheduler, *, num_blocks: int, block_size: int = 16,
                       prefix_cache_tokens: int = 0, prefix_cache_policy: str = "leader",
                       prefix_cache_mode: str = "share", packed_linears: bool = True, decode_staging: bool = True,
                       decode_kernel: bool = True, batch_invariant: bool = False, decode_compile: str = "off",
                       **kw) -> LLMEngine:
    """Engine over a real model: pool + storage sized from the model spec (planes of K/V width); with
    ``prefix_cache_tokens`` > 0 a prompt-prefix cache of that many tokens, evicting by ``prefix_cache_policy``:
    ``prefix_cache_mode="share"`` shares full cached blocks of the pool (``SharedPrefixCache``, at most
    ⌊tokens / block_size⌋ groups), ``"copy"`` copies from a separate store (``PrefixKVStore``). ``packed_linears``:
    the decoder's projections run on oneDNN-prepacked weights where the CPU build has them (``model/packed_linear``)."""
    spec = model.spec
    pool = BlockPool.for_model(num_blocks, block_size, spec.hidden_size, spec.kv_size)
    storage = HybridCacheStorage(pool, spec.num_hidden_layers, spec.kv_size, spec.hidden_size, dtype=model.dtype,
                                 device=model.device)
    kw.setdefault("max_model_len", spec.max_position_embeddings)
    if prefix_cache_tokens > 0 and prefix_cache_mode == "share":
        from grserve.kvcache.shared_prefix import SharedPrefixCache

        kw["prefix_cache"] = SharedPrefixCache(pool, max(1, prefix_cache_tokens // block_size), prefix_cache_policy)
    elif prefix_cache_tokens > 0:
        from grserve.kvcache.prefix_kv import PrefixKVStore

        kw["prefix_cache"] = PrefixKVStore.for_storage(storage, prefix_cache_tokens, prefix_cache_policy)
    return LLMEngine(scheduler, pool, ModelExecutor(model, storage, packed_linears=packed_linears,
                                                   decode_staging=decode_staging, decode_kernel=decode_kernel,
                                                   batch_invariant=batch_invariant, decode_compile=decode_compile),
                     **kw)
