"""The LLM engine behind the Engine contract: a background thread steps the continuous-batching core.

``engine/llm.py``'s ``LLMEngine`` is the step-level core (one ``step()`` = one scheduled iteration over the hybrid
KV/hidden block pool); this class is what the server and the cluster talk to (``engine.protocol.Engine``):
``submit(LLMRequest)`` → a handle whose ``events()`` yields one ``TokenEvent`` per sampled token and whose future
resolves to an ``LLMResult``. A request that is cancelled fails with ``RequestCancelled``; a request caught in a
failing engine step fails with ``EngineStepFailed`` — an error never looks like a normal finish.

Admission (the server edge's ``EdgeConfig``): at most ``max_waiting`` requests wait for their first schedule
(``submit`` raises ``EngineOverloaded`` beyond it), and a request that has not started ``request_timeout`` seconds
after it was submitted is aborted before any of its tokens is computed (``RequestTimedOut``).

The inbox: the step loop's thread alone touches the core. Other threads (the server's event loop, a cluster
instance's) hand it messages — a request (``_Submit``), a cancel, a call (``call(fn)``: a cluster instance's cache
reset) — which the loop applies in order between two steps; so ``submit`` and ``cancel`` never wait for a step in
progress (a long prefill: seconds), and nothing needs a lock around the core. What must be known at once is checked
in the caller's thread: the request's fit (``LLMFit``, fixed at build) and the queue bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from grserve.config import EdgeConfig, LLMServeConfig
from grserve.engine.llm import LLMEngine, Sequence, TokenEvent
from grserve.engine.protocol import (
    EngineHealth,
    EngineOverloaded,
    EngineStepFailed,
    EngineStopped,
    RequestCancelled,
    RequestHandle,
    RequestTimedOut,
)
from grserve.engine.types import LLMRequest, LLMResult
from grserve.model.thread_choice import release_openmp_pool

log = logging.getLogger("grserve.engine")


@dataclass(frozen=True)
class _Submit:
    request: LLMRequest
    handle: RequestHandle[LLMResult]
    at: float  # monotonic submission time: the queue deadline counts from here


@dataclass(frozen=True)
class _Cancel:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: Future[Any]


def _log_line(line: str) -> None:
    """One line beside the server's start lines (stdout, which ``serve llm``'s engine process shares)."""
    print(f"grserve: {line}", flush=True)


def structured_backend(tok: Any, vocab_size: int) -> Any:
    """Structured output over ``tok``'s vocabulary (``engine/structured.py``; compiled lazily, on the first
    constrained request), or None for an engine without an HF tokenizer."""
    hf = getattr(tok, "tok", None)
    if hf is None:
        return None
    from grserve.engine.structured import StructuredBackend

    stops = [tok.eos_token_id, *getattr(tok, "extra_eos_ids", ())]
    return StructuredBackend(hf, vocab_size, [t for t in stops if t is not None])


class AsyncLLMEngine:
    def __init__(self, core: LLMEngine, tokenizer: Any = None, model: Any = None, edge: EdgeConfig | None = None):
        self.max_waiting = edge.max_waiting if edge is not None else None  # None: no edge (driven in code)
        self.request_timeout_s: float | None = edge.request_timeout if edge is not None else None
        self._inbox: deque[_Submit | _Cancel | _Call] = deque()  # for the step loop, applied between steps, in order
        self._open: set[str] = set()  # request ids submitted and not ended (what ``cancel`` may still cancel)
        self._submitted: dict[str, float] = {}  # request id -> monotonic submit time, until it first runs
        self._expired: set[str] = set()
        self.requests_expired = 0
        self.core = core
        self.tokenizer = tokenizer
        # structured output over the served tokenizer's vocabulary, unless the core was given a backend (build()
        # and every hand-built core alike get it here)
        spec = getattr(getattr(getattr(core, "executor", None), "model", None), "spec", None)
        if getattr(core, "structured", False) is None and tokenizer is not None and spec is not None:
            core.structured = structured_backend(tokenizer, spec.vocab_size)
        self.model = model
        self._cv = threading.Condition()
        self._status = "stopped"
        self._thread: threading.Thread | None = None
        self.thread_choice = None  # ThreadChoice of build(pick_threads=True): the torch threads and why
        self._live: dict[str, tuple[int, Sequence, RequestHandle]] = {}  # the loop's: requests in the core
        self.errors = 0
        self.step_hooks: tuple[Callable[[], None], Callable[[], None]] | None = None  # around each iteration
        # structured requests whose grammar is not compiled yet: compiled on a thread of their own first, so a
        # large schema's compile (over a second) never stalls the step loop and every other request with it
        self._grammars: ThreadPoolExecutor | None = None
        self._compiling: dict[str, bool] = {}  # request id -> cancelled while its grammar compiles

    @classmethod
    def build(cls, cfg: LLMServeConfig, pick_threads: bool = False) -> "AsyncLLMEngine":
        """Model (preset or HF dir), tokenizer, scheduling policy (ρ profiled at start-up for Apt-Serve unless
        given), block pool and optional prefix cache, from one config. ``pick_threads``: set torch's thread
        count from ``--threads`` (0: measured on the model, ``model/thread_choice.py``) before anything is
        profiled; the choice is ``thread_choice``. Without it the caller's thread count stays."""
        from grserve.engine.llm import build_model_engine, calibrate_rho
        from grserve.engine.tokenizer import load_tokenizer
        from grserve.model import load_model
        from grserve.scheduler.llm_factory import make_llm_scheduler

        m, c = cfg.model, cfg.llm
        model = load_model(m.source, dtype=m.dtype, device=m.device, seed=m.seed, quantization=m.quantization)
        tok = load_tokenizer(cfg.api.tokenizer or m.source, model.spec.vocab_size,
                             model.spec.max_position_embeddings, cfg.api.tokenizer_cache)
        choice = None
        if pick_threads:
            from grserve.model.thread_choice import FRONT_END_STEP_MS, engine_threads

            choice = engine_threads(c.threads, model, c.packed_linears, min_step_ms=FRONT_END_STEP_MS)
        rho = c.rho if c.rho is not None else (calibrate_rho(model) if c.scheduler == "aptserve" else 0.0)
        pol = make_llm_scheduler(c.scheduler, ttft_slo=c.ttft_slo, tbt_slo=c.tbt_slo, rho=rho,
                                 token_budget=c.token_budget, max_num_batched_tokens=c.max_batched_tokens,
                                 max_num_seqs=c.max_num_seqs)
        pol = colocated(pol, cfg)
        core = build_model_engine(model, pol, num_blocks=c.num_blocks, block_size=c.block_size,
                                  prefix_cache_tokens=c.prefix_cache_tokens,
                                  prefix_cache_policy=c.prefix_cache_policy, prefix_cache_mode=c.prefix_cache_mode,
                                  packed_linears=c.packed_linears, decode_staging=c.decode_staging,
                                  decode_kernel=c.decode_kernel,
                                  batch_invariant=c.batch_invariant,
                                  decode_compile=c.decode_compile,
                                  eos_token_id=tok.eos_token_id, detokenize=tok.decode,
                                  decoder_factory=tok.decode_stream)
        if choice is not None and choice.wide_threads:
            core.executor.wide_threads = choice.wide_threads
        dc = getattr(core.executor, "decode_compiled", None)
        if dc is not None:  # --decode-compile: the row buckets compiled now (bounded), not in the first steps
            dc.on_background_done = _log_line  # the start line says which buckets are left to the background
            dc.warm_up()
        engine = cls(core, tok, model, cfg.edge)
        engine.thread_choice = choice
        return engine

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> "AsyncLLMEngine":
        with self._cv:
            if self._status == "ok":
                return self
            self._status = "ok"
        release_openmp_pool()  # the step thread's OpenMP pool the only one (model/thread_choice.py)
        self._thread = threading.Thread(target=self._run, name="grserve-llm-engine", daemon=True)
        self._thread.start()
        return self

    def drain(self, timeout_s: float | None = None) -> bool:
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        with self._cv:
            if self._status == "ok":
                self._status = "draining"
        while self.core.has_work() or self._inbox:
            if deadline is not None and time.perf_counter() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def stop(self) -> None:
        with self._cv:
            self._status = "stopped"
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._grammars is not None:  # queued compiles fail their requests (EngineStopped); a running one ends
            self._grammars.shutdown(wait=False, cancel_futures=True)
            self._grammars = None
        while self._inbox:  # the loop is gone: this thread has the core now
            msg = self._inbox.popleft()
            if isinstance(msg, _Submit):
                self._open.discard(msg.request.request_id)
                _fail(msg.handle, EngineStopped("engine stopped"))
            elif isinstance(msg, _Call):
                msg.future.set_exception(EngineStopped("engine stopped"))
        for seq_id, _seq, handle in list(self._live.values()):
            self.core.abort(seq_id)
            _fail(handle, EngineStopped("engine stopped"))

    def __enter__(self) -> "AsyncLLMEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- requests -----------------------------------------------------------------------------------------
    def submit(self, req: LLMRequest) -> RequestHandle[LLMResult]:
        """Queue a request (never waits for a step); ``ValueError`` if it can never fit (model length or pool)."""
        if self._status != "ok":
            raise EngineStopped(f"engine is {self._status}")
        self.core.fit.check(len(req.prompt_ids), req.params.max_tokens)
        depth = self.queue_depth
        if self.max_waiting is not None and depth >= self.max_waiting:
            raise EngineOverloaded(f"{depth} requests waiting (max_waiting={self.max_waiting})")
        handle: RequestHandle[LLMResult] = RequestHandle(req.request_id, self.cancel)
        self._open.add(req.request_id)
        msg = _Submit(req, handle, time.monotonic())
        spec, backend = req.params.structured, getattr(self.core, "structured", None)
        if spec is not None and backend is not None and not backend.has(spec):
            self._compile_first(msg, backend, spec)
        else:
            self._post(msg)
        return handle

    def _compile_first(self, msg: _Submit, backend: Any, spec: Any) -> None:
        """Compile ``msg``'s grammar off the step loop, then post it (its matcher is then a cache hit); a compile
        error or a cancel in the meantime fails its handle, as the loop would have."""
        rid = msg.request.request_id
        with self._cv:
            if self._grammars is None:
                self._grammars = ThreadPoolExecutor(1, thread_name_prefix="grserve-grammar")
            self._compiling[rid] = False
            job = self._grammars.submit(backend.compiled, spec)

        def done(fut: Future) -> None:
            with self._cv:
                cancelled = self._compiling.pop(rid, False)
            error = fut.exception() if not fut.cancelled() else EngineStopped("engine stopped")
            if cancelled or error is not None:
                self._open.discard(rid)
                _fail(msg.handle, RequestCancelled(f"request {rid} cancelled") if cancelled else error)
                return
            try:
                self._post(msg)
            except EngineStopped as exc:
                _fail(msg.handle, exc)

        job.add_done_callback(done)

    def cancel(self, request_id: str) -> bool:
        """Ask the loop to cancel a request (its handle fails with ``RequestCancelled`` between two steps). False
        when it is unknown or has ended."""
        if request_id not in self._open:
            return False
        with self._cv:
            if request_id in self._compiling:  # not posted yet: it fails when its compile ends
                self._compiling[request_id] = True
                return True
        self._post(_Cancel(request_id))
        return True

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future[Any]:
        """Run ``fn(core)`` on the step loop between two steps (a cluster instance's cache reset); its future."""
        fut: Future[Any] = Future()
        self._post(_Call(fn, fut))
        return fut

    def _post(self, msg: _Submit | _Cancel | _Call) -> None:
        with self._cv:
            if self._status == "stopped":  # after stop() (or raced with it: it has drained the inbox already)
                if isinstance(msg, _Submit):
                    self._open.discard(msg.request.request_id)
                    raise EngineStopped("engine is stopped")
                if isinstance(msg, _Call):
                    msg.future.set_exception(EngineStopped("engine is stopped"))
                return
            self._inbox.append(msg)
            self._cv.notify_all()

    def _drain_inbox(self) -> None:
        """The loop: apply every message posted so far, in order (each one's failure is its own)."""
        while self._inbox:
            msg = self._inbox.popleft()
            if isinstance(msg, _Submit):
                self._add(msg)
            elif isinstance(msg, _Cancel):
                entry = self._live.get(msg.request_id)
                if entry is not None:
                    self.core.abort(entry[0])
            else:
                try:
                    msg.future.set_result(msg.fn(self.core))
                except Exception as exc:  # noqa: BLE001 - the caller's error, not the loop's
                    msg.future.set_exception(exc)

    def _add(self, msg: _Submit) -> None:
        req, rid = msg.request, msg.request.request_id
        try:
            seq_id = self.core.add_request(req.prompt_ids, req.params, on_event=lambda ev: self._on_event(rid, ev),
                                           priority=req.priority, handover=req.handover)
        except Exception as exc:  # noqa: BLE001 - e.g. a handover with nothing left: that request fails
            self._open.discard(rid)
            _fail(msg.handle, exc)
            return
        self._live[rid] = (seq_id, self.core.seqs[seq_id], msg.handle)
        self._submitted[rid] = msg.at

    def _on_event(self, request_id: str, ev: TokenEvent) -> None:
        """Called by the core (the loop thread) for every token and every end."""
        entry = self._live.get(request_id)
        if entry is None:
            return
        _, seq, handle = entry
        if not ev.finished or ev.token_ids:
            handle.push(ev)
        if not ev.finished:
            return
        del self._live[request_id]
        self._open.discard(request_id)
        self._submitted.pop(request_id, None)
        if request_id in self._expired:
            self._expired.discard(request_id)
            _fail(handle, RequestTimedOut(f"request {request_id} waited more than {self.request_timeout_s:g} s in "
                                          f"the queue"))
        elif ev.finish_reason in ("stop", "length", "pause"):
            handle.future.set_result(LLMResult(request_id, list(seq.output_ids), seq.text, ev.finish_reason,
                                               len(seq.prompt_ids), seq.num_preemptions, seq.cached_tokens,
                                               **_phases(seq)))
        elif ev.finish_reason == "abort":
            _fail(handle, RequestCancelled(f"request {request_id} cancelled"))
        else:
            _fail(handle, EngineStepFailed(ev.error or f"request {request_id} failed in an engine step"))

    # ---- state ---------------------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Requests waiting for their first schedule: in the core's queue, in the inbox, or their grammar compiling."""
        return (len(self.core.waiting) + sum(isinstance(m, _Submit) for m in list(self._inbox))
                + len(self._compiling))

    @property
    def prefix_cache(self):
        return self.core.prefix_cache

    def health(self) -> EngineHealth:
        c = self.core
        return EngineHealth(self._status, self.queue_depth, len(c.running),  # type: ignore[arg-type]
                            {"free_blocks": c.pool.num_free, "total_blocks": c.pool.num_blocks})

    def stats(self) -> dict[str, float]:
        c = self.core
        return {**c.stats, "running": len(c.running), "waiting": len(c.waiting), "free_blocks": c.pool.num_free,
                "requests_expired": self.requests_expired,
                "total_blocks": c.pool.num_blocks, "iterations": c.iterations, "errors": self.errors,
                "offline_deferred": getattr(c.scheduler, "stats", {}).get("offline_deferred", 0),
                **c.priority_counts()}

    # ---- the loop --------------------------------------------------------------------------------------------
    def _expire(self) -> None:
        """The loop: apply the inbox, then abort every request still waiting for its first schedule past its
        deadline (nothing computed)."""
        self._drain_inbox()
        if self.request_timeout_s is None or not self._submitted:
            return
        limit = time.monotonic() - self.request_timeout_s
        for rid, t in list(self._submitted.items()):  # oldest first (insertion order)
            if t >= limit:
                break
            del self._submitted[rid]
            seq = self._live[rid][1]
            if seq.num_computed or seq.token_times:  # it has run: a later preemption is not a queue wait
                continue
            self._expired.add(rid)
            self.requests_expired += 1
            self.core.abort(self._live[rid][0])

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._status != "stopped" and not self.core.has_work() and not self._inbox:
                    self._cv.wait(timeout=0.5)
                if self._status == "stopped":
                    return
            self._iterate()

    def _iterate(self) -> None:
        """One loop iteration: the inbox and the deadlines (``_expire``), one step; a step that raises never kills
        the loop (``_fail_step``). ``step_hooks`` (before, after) bracket it (an engine process sends the events
        of a step together)."""
        hooks = self.step_hooks
        if hooks is not None:
            hooks[0]()
        try:
            self._run_step()
        finally:
            if hooks is not None:
                hooks[1]()

    def _run_step(self) -> None:
        try:
            self._expire()
            self.core.step()
            if not self.core.last_step_progressed:  # the policy is idle: let time pass, don't spin
                with self._cv:
                    self._cv.wait(timeout=0.002)
        except Exception as exc:  # never die: fail the requests of the failed step with an error, keep serving
            log.exception("engine step failed")
            self.errors += 1
            self._fail_step(exc)

    def _fail_step(self, exc: BaseException) -> None:
        """Fail the requests a failed step held: the running ones (their blocks may be half written, and the
        failure cannot be pinned on one of them: docs/llm.md). Requests still waiting were not part of the step
        and stay queued — unless nothing was running (the failure came from scheduling the queue itself): then
        they fail too, so a failure that repeats cannot loop forever."""
        message = f"engine step failed: {type(exc).__name__}"
        for s in list(self.core.running) or list(self.core.waiting):
            self.core.fail(s, message)


def colocated(policy, cfg: LLMServeConfig):
    """The policy inside the co-location layer (``scheduler/colocation.py``): online requests first, offline
    victims for online admission, offline rows admitted by the step latency model against ``cfg.slo``."""
    from grserve.scheduler.colocation import ColocationScheduler

    co = cfg.colocation
    return ColocationScheduler(policy, tpot_slo_s=cfg.slo.tpot_slo_s,
                               max_offline_preemptions=co.max_offline_preemptions,
                               offline_admission=co.offline_admission)


def _phases(seq: Sequence) -> dict[str, float]:
    """A finished sequence's queue, prefill and decode times (engine clock)."""
    if seq.first_scheduled is None or not seq.token_times:
        return {}
    return {"queue_s": seq.first_scheduled - seq.arrival, "prefill_s": seq.token_times[0] - seq.first_scheduled,
            "decode_s": seq.token_times[-1] - seq.token_times[0]}


def _fail(handle: RequestHandle, exc: BaseException) -> None:
    if not handle.future.done():
        handle.future.set_exception(exc)
