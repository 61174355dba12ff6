"""One engine instance of the cluster: an ``AsyncLLMEngine`` inside a Ray actor (or a plain object in tests).

The front end talks to it with four calls, all Ray actor calls (no home-made RPC):

- ``submit(request_id, attempt, prompt_ids, params, snapshot)``: run a request (``snapshot``: the K/V of
  ``prompt_ids[:m]`` computed elsewhere — a migrated request's — loaded into this instance's prefix cache first,
  so admission copies it instead of computing it);
- ``poll(wait_s)``: everything new since the last poll — token reports ``(request_id, attempt, index, ids,
  finished, reason)``, KV snapshots of requests whose prefill just ended (returned, so the front end owns them:
  they outlive this actor), the KV events of the prefix cache with the next sequence number, engine stats. It
  waits up to ``wait_s`` for something to report; a poll that answers is the heartbeat;
- ``cancel(request_id)``; ``kv_snapshot()`` (the index resync); ``reset(incarnation)`` (an empty prefix cache
  under a new incarnation, for benchmarks that compare policies on the same instances).

The actor is async: each request's token stream (``RequestHandle.events()``) is read by a task on the actor's
event loop, which the engine thread wakes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import time
from typing import Any

from grserve.cluster.core.kv_index import KVEventPublisher


class EngineInstance:
    def __init__(self, index: int, cfg: Any, incarnation: str, kv_block_size: int = 16, kv_snapshot: bool = True,
                 torch_threads: int = 1):
        import torch

        from grserve.engine.async_llm import AsyncLLMEngine

        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        # an instance runs the copying prefix store: it has the KV-index publisher hook and the snapshot export /
        # import a migration uses (the shared-block store has neither yet; docs/cluster.md)
        cfg = dataclasses.replace(cfg, llm=dataclasses.replace(cfg.llm, prefix_cache_mode="copy"))
        self.index, self.cfg, self.kv_block_size, self.kv_snapshot = index, cfg, kv_block_size, kv_snapshot
        self.engine = AsyncLLMEngine.build(cfg).start()
        self.engine.max_waiting = self.engine.request_timeout_s = None  # the front end admits (admission.py)
        self.publisher = self._attach(incarnation)
        self._out: list[tuple] = []
        self._snapshots: list[tuple] = []
        self._wake: asyncio.Event | None = None
        self._live: dict[str, tuple[int, Any]] = {}  # request id → (attempt, handle)
        self._tasks: set = set()
        self._prefill_only: set[tuple[str, int]] = set()  # PD: attempts whose K/V is exported at their end
        self._cancel_early: set[str] = set()  # cancelled while their submit was still in a worker thread
        self.token_interval = TokenInterval()  # PD role monitor: the recent decode token interval

    def _attach(self, incarnation: str) -> KVEventPublisher:
        pc = self.engine.prefix_cache
        tier = "hbm" if pc is not None and pc.kv.device.type == "cuda" else "dram"
        pub = KVEventPublisher(self.index, incarnation, self.kv_block_size, tier)
        if pc is not None:
            pc.listener = pub
        return pub

    def info(self) -> dict:
        m, core = self.engine.model, self.engine.core
        pc = self.engine.prefix_cache
        return {"index": self.index, "pid": os.getpid(), "host": socket.gethostname(),
                "node_ip": _node_ip(), "incarnation": self.publisher.incarnation,
                "max_model_len": m.spec.max_position_embeddings, "vocab_size": m.spec.vocab_size,
                "num_blocks": core.pool.num_blocks, "block_size": core.pool.block_size,
                "prefix_cache_tokens": pc.capacity if pc is not None else 0, "device": str(m.device)}

    # ---- requests --------------------------------------------------------------------------------------------
    async def submit(self, request_id: str, attempt: int, prompt_ids: list[int], params: Any,
                     snapshot: Any = None, priority: str = "online") -> None:
        self._cancel_early.discard(request_id)
        try:
            handle = await asyncio.to_thread(self._submit, request_id, attempt, prompt_ids, params, snapshot,
                                             priority)
        except Exception:  # noqa: BLE001 - refused here (stopping, never fits): the front end fails the request
            self._prefill_only.discard((request_id, attempt))
            self._report((request_id, attempt, 0, [], True, "error"))
            return
        self._live[request_id] = (attempt, handle)
        if request_id in self._cancel_early:  # the front end cancelled it before it was live here
            self._cancel_early.discard(request_id)
            await asyncio.to_thread(self.engine.cancel, handle.request_id)
        task = asyncio.get_running_loop().create_task(self._forward(request_id, attempt, handle, prompt_ids))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def submit_prefill(self, request_id: str, attempt: int, prompt_ids: list[int], params: Any,
                             *args: Any, **kw: Any) -> None:
        """PD (``cluster/llm/pd_disagg.py``): a prefill-only attempt (``params.max_tokens == 1``); its prompt's K/V is
        exported and returned in a poll although the attempt ends at its first token."""
        self._prefill_only.add((request_id, attempt))
        await self.submit(request_id, attempt, prompt_ids, params, *args, **kw)

    async def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(self, *args)`` (a module-level function) in a worker thread: start-up measurements."""
        return await asyncio.to_thread(fn, self, *args)

    def _submit(self, request_id: str, attempt: int, prompt_ids: list[int], params: Any, snapshot: Any,
                priority: str = "online") -> Any:
        """In a worker thread: the engine lock is held for a whole step, and the event loop must keep answering
        polls (the heartbeat) meanwhile."""
        from grserve.engine.types import LLMRequest

        pc = self.engine.prefix_cache
        if snapshot is not None and pc is not None and snapshot.shape[2] > 0:
            with self.engine.core.lock:
                pc.put(prompt_ids[:snapshot.shape[2]], snapshot)
        return self.engine.submit(LLMRequest(list(prompt_ids), params, request_id=f"{request_id}#{attempt}",
                                             priority=priority))

    def _export(self, prompt_ids: list[int]) -> Any:
        with self.engine.core.lock:  # the end of the prefill: its prompt is in the prefix cache now
            return self.engine.prefix_cache.export(prompt_ids)

    async def _forward(self, request_id: str, attempt: int, handle: Any, prompt_ids: list[int]) -> None:
        n, ended = 0, False
        export_at_end = (request_id, attempt) in self._prefill_only
        self._prefill_only.discard((request_id, attempt))
        async for ev in handle.events():
            first = n == 0
            self._report((request_id, attempt, n, list(ev.token_ids), ev.finished, ev.finish_reason))
            self.token_interval.tokens(request_id, len(ev.token_ids))
            n += len(ev.token_ids)
            ended = ended or ev.finished
            if first and (not ev.finished or export_at_end) and self.kv_snapshot and \
                    self.engine.prefix_cache is not None:
                kv = await asyncio.to_thread(self._export, prompt_ids)  # the token is reported first: no TTFT cost
                self._snapshots.append((request_id, attempt, kv))
        self.token_interval.forget(request_id)
        try:
            await handle.result()
        except Exception as exc:  # noqa: BLE001 - reported to the front end, which fails or ignores it
            if not ended:
                reason = "abort" if type(exc).__name__ == "RequestCancelled" else "error"
                self._report((request_id, attempt, n, [], True, reason))
        finally:
            if self._live.get(request_id, (None,))[0] == attempt:
                del self._live[request_id]

    def _report(self, item: tuple) -> None:
        self._out.append(item)
        if self._wake is not None:
            self._wake.set()

    async def cancel(self, request_id: str) -> bool:
        entry = self._live.get(request_id)
        if entry is None:
            self._cancel_early.add(request_id)  # its submit may still be in a worker thread
            if len(self._cancel_early) > 4096:  # ids of requests that had already ended here
                self._cancel_early.clear()
            return False
        return await asyncio.to_thread(self.engine.cancel, entry[1].request_id)

    # ---- the front end's view ----------------------------------------------------------------------------------
    async def poll(self, wait_s: float = 0.05) -> dict:
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
        return {"tokens": out, "snapshots": snaps, "kv_events": events, "kv_next_seq": next_seq,
                "stats": stats, "time": time.time()}

    async def kv_snapshot(self):
        return self.publisher.snapshot()  # the publisher's own lock: consistent with its sequence numbers

    async def reset(self, incarnation: str) -> None:
        """Empty the prefix cache (a fresh store, same size and policy) under a new incarnation."""
        await asyncio.to_thread(self._reset, incarnation)

    def _reset(self, incarnation: str) -> None:
        from grserve.kvcache.prefix_kv import PrefixKVStore

        core = self.engine.core
        with core.lock:
            if core.prefix_cache is not None:
                c = self.cfg.llm
                core.prefix_cache = PrefixKVStore.for_storage(core._storage, c.prefix_cache_tokens,
                                                              c.prefix_cache_policy)
            for k in ("prefix_hit_tokens", "prefill_tokens"):
                core.stats[k] = 0
            self.publisher = self._attach(incarnation)

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.engine.stop()


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


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - only for the start-up line
        pass
    return "127.0.0.1"
