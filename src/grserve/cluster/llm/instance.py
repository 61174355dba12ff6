"""One engine instance of the cluster: an ``AsyncLLMEngine`` inside a Ray actor (or a plain object in tests).

The front end talks to it with Ray actor calls (no home-made RPC), in the messages of ``cluster/wire.py``:

- ``submit(Attempt)``: run one attempt of a request as an ``engine.types.Handover``: the engine continues after the
  tokens delivered so far (their text state replayed), loads ``Attempt.snapshot`` — the K/V of the first m tokens,
  computed elsewhere: a migrated or handed-over request's — into the request's blocks instead of computing it, and
  hands out the prompt's K/V at the end of its prefill (``kv_snapshot``);
- ``poll(wait_s)`` → ``LLMPoll``: everything new since the last poll — ``TokenReport``\\ s, the ``PromptKV`` of
  requests whose prefill just ended (returned, so the front end owns them: they outlive this actor), the KV events
  of the prefix cache with the next sequence number, engine stats. It waits up to ``wait_s`` for something to
  report; a poll that answers is the heartbeat;
- ``cancel(request_id)``; ``kv_snapshot()`` (the index resync); ``reset(incarnation)`` (an empty prefix cache
  under a new incarnation, for benchmarks that compare policies on the same instances).

The actor is async: each request's token stream (``RequestHandle.events()``) is read by a task on the actor's
event loop, which the engine thread wakes. ``submit``, ``cancel`` and ``reset`` hand the engine messages its step
loop applies between steps (``AsyncLLMEngine``'s inbox), so none of them waits for a step in progress: the event
loop keeps answering polls (the heartbeat) through a long prefill.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from grserve.cluster.core.kv_index import KVEventPublisher
from grserve.cluster.core.ray_runtime import node_ip
from grserve.cluster.wire import Attempt, KVSnapshot, LLMInstanceInfo, LLMPoll, PromptKV, Tier, TokenReport

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from grserve.config import ClusterConfig, LLMServeConfig
    from grserve.engine.llm import LLMEngine
    from grserve.engine.protocol import RequestHandle
    from grserve.engine.types import LLMResult


class EngineInstance:
    def __init__(self, index: int, cfg: LLMServeConfig, incarnation: str, kv_block_size: int = 16,
                 kv_snapshot: bool = True, torch_threads: int = 1):
        import torch

        from grserve.engine.async_llm import AsyncLLMEngine

        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        self.index, self.cfg, self.kv_block_size, self.kv_snapshot = index, cfg, kv_block_size, kv_snapshot
        self.engine = AsyncLLMEngine.build(cfg).start()
        self.engine.max_waiting = self.engine.request_timeout_s = None  # the front end admits (admission.py)
        self.publisher = self._attach(incarnation)
        self._out: list[TokenReport] = []
        self._snapshots: list[PromptKV] = []
        self._wake: asyncio.Event | None = None
        self._live: dict[str, tuple[int, RequestHandle[LLMResult]]] = {}  # request id → (attempt, handle)
        self._tasks: set[asyncio.Task] = set()
        self.token_interval = TokenInterval()  # PD role monitor: the recent decode token interval

    def _attach(self, incarnation: str) -> KVEventPublisher:
        """A new KV event publisher on this instance's prefix cache (either kind: both report what they hold)."""
        pc = self.engine.prefix_cache
        tier: Tier = "hbm" if self.engine.model.device.type == "cuda" else "dram"
        pub = KVEventPublisher(self.index, incarnation, self.kv_block_size, tier)
        if pc is not None:
            pc.listener = pub
        return pub

    def info(self) -> LLMInstanceInfo:
        import torch

        m, core = self.engine.model, self.engine.core
        pc = self.engine.prefix_cache
        return LLMInstanceInfo(self.index, self.publisher.incarnation, os.getpid(), socket.gethostname(), node_ip(),
                               str(m.device), torch.get_num_threads(), max_model_len=m.spec.max_position_embeddings,
                               vocab_size=m.spec.vocab_size, num_blocks=core.pool.num_blocks,
                               block_size=core.pool.block_size, kv_planes=core.pool.kv_planes,
                               prefix_cache_tokens=pc.capacity if pc is not None else 0)

    # ---- requests --------------------------------------------------------------------------------------------
    async def submit(self, attempt: Attempt) -> None:
        rid, n = attempt.request_id, attempt.attempt
        try:
            handle = self._submit(attempt)
        except Exception:  # noqa: BLE001 - refused here (stopping, never fits): the front end fails the request
            self._report(TokenReport(rid, n, 0, [], "", True, "error"))
            return
        self._live[rid] = (n, handle)
        task = asyncio.get_running_loop().create_task(self._forward(rid, n, handle))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(self, *args)`` (a module-level function) in a worker thread: start-up measurements."""
        return await asyncio.to_thread(fn, self, *args)

    def _submit(self, attempt: Attempt) -> RequestHandle[LLMResult]:
        from grserve.engine.types import Handover, LLMRequest

        # the prompt's K/V comes back at the end of its prefill (a move or a hand-off may need it), unless the
        # request ends with its first token; a PD prefill attempt always returns it, and pauses after one token
        export = self.kv_snapshot and (attempt.max_new_tokens > 1 or attempt.prefill_only)
        handover = Handover(list(attempt.delivered), attempt.snapshot, export, 1 if attempt.prefill_only else None)
        return self.engine.submit(LLMRequest(list(attempt.prompt_ids), attempt.params,
                                             request_id=f"{attempt.request_id}#{attempt.attempt}",
                                             priority=attempt.priority, handover=handover))

    async def _forward(self, request_id: str, attempt: int, handle: RequestHandle[LLMResult]) -> None:
        n, ended = 0, False
        async for ev in handle.events():
            phases = await _phases(handle) if ev.finished else None  # set with its last event (AsyncLLMEngine)
            self._report(TokenReport(request_id, attempt, n, list(ev.token_ids), ev.text, ev.finished,
                                     ev.finish_reason, phases, ev.cached_tokens))
            if ev.prompt_kv is not None:  # the end of its prefill: returned, so the front end owns it
                self._snapshots.append(PromptKV(request_id, attempt, ev.prompt_kv))
            self.token_interval.tokens(request_id, len(ev.token_ids))
            n += len(ev.token_ids)
            ended = ended or ev.finished
        self.token_interval.forget(request_id)
        try:
            await handle.result()
        except Exception as exc:  # noqa: BLE001 - reported to the front end, which fails or ignores it
            if not ended:
                reason = "abort" if type(exc).__name__ == "RequestCancelled" else "error"
                self._report(TokenReport(request_id, attempt, n, [], "", True, reason))
        finally:
            if self._live.get(request_id, (None,))[0] == attempt:
                del self._live[request_id]

    def _report(self, item: TokenReport) -> None:
        self._out.append(item)
        if self._wake is not None:
            self._wake.set()

    async def cancel(self, request_id: str) -> bool:
        entry = self._live.get(request_id)
        return entry is not None and self.engine.cancel(entry[1].request_id)

    # ---- the front end's view ----------------------------------------------------------------------------------
    async def poll(self, wait_s: float = 0.05) -> LLMPoll:
        if self._wake is None:
            self._wake = asyncio.Event()
        if not self._out and wait_s > 0:
            try:
                await asyncio.wait_for(self._wake.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        self._wake.clear()
        out, self._out = self._out, []
        snaps, self._snapshots = self._snapshots, []
        events, next_seq = self.publisher.take_events()
        stats = {**self.engine.stats(), "token_interval_s": self.token_interval.mean()}
        return LLMPoll(out, snaps, events, next_seq, stats)

    async def kv_snapshot(self) -> KVSnapshot:
        return self.publisher.snapshot()  # the publisher's own lock: consistent with its sequence numbers

    async def reset(self, incarnation: str) -> None:
        """Empty the prefix cache (same size and policy) under a new incarnation (on the step loop, between
        steps)."""
        await asyncio.wrap_future(self.engine.call(lambda core: self._reset(core, incarnation)))

    def _reset(self, core: LLMEngine, incarnation: str) -> None:
        if core.prefix_cache is not None:
            core.prefix_cache.listener = None  # the old incarnation's publisher hears nothing more
            core.prefix_cache.clear()
        for k in ("prefix_hit_tokens", "prefill_tokens"):
            core.stats[k] = 0
        self.publisher = self._attach(incarnation)

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.engine.stop()


PHASES = ("queue_s", "prefill_s", "decode_s")


async def _phases(handle: RequestHandle[LLMResult]) -> dict[str, float] | None:
    """An ended attempt's engine phases (``LLMResult``: queue, prefill, decode; those its engine measured), None if
    it failed."""
    try:
        result = await handle.result()
    except Exception:  # noqa: BLE001 - a failed attempt: reported by _forward, no phases
        return None
    return {k: float(v) for k in PHASES if (v := getattr(result, k, None)) is not None} or None


class TokenInterval:
    """The recent time per output token of the decodes running here (xLLM's "token generation interval"): per
    request, the time between two token events divided by the tokens of the later one; the mean over the last
    ``window`` such intervals (of any request) no older than ``max_age_s``. None when there are none."""

    def __init__(self, window: int = 64, max_age_s: float = 2.0):
        self.window, self.max_age_s = window, max_age_s
        self._last: dict[str, float] = {}
        self._recent: list[tuple[float, float]] = []  # (when, seconds per token)

    def tokens(self, request_id: str, n: int) -> None:
        now = time.monotonic()
        last = self._last.get(request_id)
        self._last[request_id] = now
        if last is not None and n > 0:
            self._recent.append((now, (now - last) / n))
            del self._recent[:-self.window]

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def mean(self) -> float | None:
        cutoff = time.monotonic() - self.max_age_s
        vals = [v for t, v in self._recent if t >= cutoff]
        return sum(vals) / len(vals) if vals else None


def spawn_instance(index: int, cfg: LLMServeConfig, cluster: ClusterConfig, incarnation: str) -> ActorHandle:
    """One engine instance actor (``cluster/llm/instance.py``), spread over the cluster's nodes; never restarted by
    Ray (the front end decides: a dead instance's requests move, its entries leave the KV index)."""
    import ray

    from grserve.cluster.core.ray_runtime import instance_threads

    actor_cls = ray.remote(EngineInstance)
    # max_concurrency: calls (coroutines) in flight per actor. At 64 (when each ``submit`` waited in a worker thread
    # for the engine lock), an overloaded instance's pending submits filled every slot and its polls (the heartbeat)
    # queued behind them until the front end fenced all three instances (bench cluster, cluster12 session); submits
    # no longer wait (the engine's inbox), the bound stays generous
    return actor_cls.options(num_cpus=0, max_restarts=0, max_concurrency=4096, scheduling_strategy="SPREAD",
                             name=None).remote(index, cfg, incarnation, cluster.kv_block_size, cluster.kv_snapshot,
                                               instance_threads(cluster.instance_threads, cluster.instances))
