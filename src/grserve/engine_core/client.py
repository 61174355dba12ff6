"""The Engine contract in a front-end process, over an engine-core process (``core_process.py``).

``EngineCoreClient`` is what the app is handed instead of an in-process engine: ``submit`` checks what can be known
here (the core's status, the request's fit, this front end's queue bound) and pushes the request to the core — it
never waits on the core; one receiver thread reads the core's batches and feeds each request's handle (events,
then its result or failure). ``/health`` and ``/metrics`` read the last heartbeat (``CoreStatus``), never the core.

When the core dies — its pid is gone, or no heartbeat for ``SILENT_AFTER_S`` (then it is killed) — every request in it fails at once
with ``EngineCoreDied`` (503, Retry-After), new requests are refused with 503 while the supervisor starts another
core, ``/health`` says ``restarting``. The first heartbeat of the new incarnation starts its **catch-up**: every
recorded state change (``BroadcastLog``: catalog reloads, registered users and items) is sent to it, each with its
own call id, and the front end goes back in service only when the core has acknowledged every one of them — so no
request is answered from the flags' state while the front end holds another. A change recorded during the catch-up
is caught up in the next round; a change the new core refuses fences it (killed: its supervisor starts the next,
and gives up after its restart budget), so a core that disagrees with the front end never serves. Nothing waits
forever: a request is either in the core, whose death ends it, or answered.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from grserve.cluster.gr.broadcast_log import BroadcastLog
from grserve.engine.protocol import EngineHealth, EngineOverloaded, EngineStopped, RequestHandle
from grserve.engine_core.core_process import Endpoints
from grserve.engine_core.messages import (
    HELLO,
    Cancel,
    Control,
    CoreStatus,
    EngineCoreDied,
    Submit,
    decode_out,
    encode_in,
    rebuild_error,
    token_event,
)

log = logging.getLogger("grserve.engine_core")
SILENT_AFTER_S = 10.0  # no heartbeat for this long from a core whose pid lives: taken for dead (hung)
HELLO_EVERY_S = 0.2  # while waiting for a core (start, restart)
_ids = itertools.count()


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _fence(pid: int) -> None:
    """End a core that stopped answering (its late answers must never be taken for a live core's)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


class EngineCoreClient:
    def __init__(self, endpoints: Endpoints, *, max_waiting: int | None = None,
                 precheck: Callable[[Any], None] | None = None, on_close: Callable[[], None] | None = None,
                 owns_core: bool = True):
        import zmq

        self.zmq = zmq
        self.endpoints = endpoints
        self.max_waiting = max_waiting
        self.precheck = precheck
        self.on_close = on_close  # the supervisor's stop (the front end that started the core)
        self.owns_core = owns_core
        self.identity = f"fe-{os.getpid()}-{next(_ids)}".encode()
        self.ctx = zmq.Context()
        self._push = self.ctx.socket(zmq.PUSH)
        # no bound: admission bounds what is in flight. A connecting socket queues for its peer while it is away
        # (a restart): what was meant for the dead core reaches the new one, which drops it (another incarnation)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.connect(endpoints.inbox)
        self._push_lock = threading.Lock()
        self._dealer = self.ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, self.identity)
        self._dealer.setsockopt(zmq.RCVHWM, 0)
        self._dealer.connect(endpoints.outbox)
        self._lock = threading.Lock()
        self._open: dict[str, RequestHandle] = {}
        self._waiting: set[str] = set()  # submitted, no event yet: this front end's part of the queue
        self._replies: dict[int, Future] = {}
        self._calls = itertools.count()
        self.state = "starting"  # starting | ok | draining | restarting | stopped
        self.core: CoreStatus | None = None
        self.incarnation = 0
        self.deaths = 0
        self.gave_up: str | None = None  # the supervisor stopped restarting: why
        self.log = BroadcastLog()  # the state changes (reloads, registrations): replayed to every new core
        self._catch_up: set[int] = set()  # call ids of the replayed changes the new core has not acknowledged yet
        self._catch_up_generation = -1  # the log's generation those changes were read at
        self.catch_up_error: str | None = None  # why the last catch-up failed (shown in /health)
        self.on_batch: Callable[[int, int], None] | None = None  # the core's batches (the batch histograms)
        self._last_heard = time.monotonic()
        self._closing = False
        self._thread = threading.Thread(target=self._receive, name="grserve-core-client", daemon=True)
        self._thread.start()

    # ---- start-up -------------------------------------------------------------------------------------------
    def wait_ready(self, alive: Callable[[], bool] = lambda: True, timeout_s: float | None = None) -> dict:
        """Block until the core's first heartbeat (returns its ``info``); ``RuntimeError`` if ``alive()`` turns
        False first (the core failed to start) or ``timeout_s`` passes."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.state != "ok":
            if not alive():
                raise RuntimeError("the engine-core process exited before it was ready")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"the engine-core process was not ready within {timeout_s:g} s")
            time.sleep(0.02)
        assert self.core is not None
        return self.core.info

    def start(self) -> EngineCoreClient:
        return self

    # ---- the contract ------------------------------------------------------------------------------------------
    def submit(self, request: Any) -> RequestHandle:
        if self.state != "ok":
            raise EngineStopped(f"engine core is {self.state}" + (f" ({self.gave_up})" if self.gave_up else ""))
        if self.precheck is not None:
            self.precheck(request)  # ValueError: it can never run
        rid = request.request_id
        handle: RequestHandle = RequestHandle(rid, self.cancel)
        with self._lock:
            if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
                raise EngineOverloaded(f"{len(self._waiting)} requests waiting (max_waiting={self.max_waiting})")
            if rid in self._open:
                raise ValueError(f"request id {rid} is already running")
            self._open[rid] = handle
            self._waiting.add(rid)
            incarnation = self.incarnation
        if not self._send(Submit(self.identity, incarnation, request)):
            with self._lock:
                self._open.pop(rid, None)
                self._waiting.discard(rid)
            raise EngineStopped("the engine process is not reachable (restarting)")
        return handle

    def cancel(self, request_id: str) -> bool:
        if request_id not in self._open:
            return False
        self._send(Cancel(self.incarnation, request_id))
        return True

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def health(self) -> EngineHealth:
        core = self.core
        serving = core is not None and self.state in ("ok", "draining")
        detail = dict(core.health_detail) if serving else {}  # a core not in service serves no state to show
        detail.update({"engine_core_pid": core.pid if core is not None else None,
                       "engine_core_restarts": self.deaths, "front_end_pid": os.getpid()})
        if self.gave_up:
            detail["engine_core_error"] = self.gave_up
        elif self.catch_up_error and not serving:
            detail["engine_core_error"] = self.catch_up_error
        status = self.state if self.state in ("ok", "draining") else (
            "stopped" if self.state == "stopped" else "restarting")
        running = core.running if core is not None and self.state in ("ok", "draining") else 0
        return EngineHealth(status, self.queue_depth, running, detail)  # type: ignore[arg-type]

    def stats(self) -> dict[str, float]:
        stats = dict(self.core.stats) if self.core is not None else {}
        stats["engine_core_restarts"] = self.deaths
        return stats

    def drain(self, timeout_s: float | None = None) -> bool:
        if self.state == "ok":
            self.state = "draining"
        answer = self._call("drain", timeout_s, wait_s=None if timeout_s is None else timeout_s + 5)
        return bool(answer) if answer is not None else not self._open

    def change(self, change: Any, wait_s: float = 600.0) -> Any:
        """A change of the engine's state (a ``cluster.wire`` ``CatalogReplace`` or ``RegistryUpdate``), applied by
        the core in order with the requests around it; recorded and replayed to every new core after a restart.
        Raises what the core raised."""
        with self._lock:  # recorded before a catch-up reads the log, or seen by it as a newer generation
            self.log.record(change)
            live = self.state in ("ok", "draining")
        if not live:
            return None  # no core in service: the catch-up of the next one carries the change
        answer = self._call("state", change, wait_s)
        if answer is None and self.state == "ok":
            raise EngineStopped(f"the engine process did not apply a state change within {wait_s:g} s")
        return answer

    def broadcast(self, change: Any) -> list[Any]:
        """``change`` to the one engine process (what a cluster front end sends to all its instances): its answer,
        in a list."""
        return [self.change(change)]

    def stop(self) -> None:
        if self._closing:
            return
        self.state = "stopped"
        if self.owns_core:
            self._call("stop", None, wait_s=15)
        self._fail_open(EngineStopped("engine stopped"))
        self._closing = True
        self._thread.join(timeout=5)
        if self.on_close is not None:
            self.on_close()
        self._dealer.close(linger=0)
        self._push.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> EngineCoreClient:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the core's death (the supervisor tells, or the receiver finds it) ----------------------------------
    def core_died(self, why: str, planned: bool = False) -> None:
        """Fail every request in the dead core and refuse new ones until a new incarnation says hello. ``planned``:
        it exited as told (SIGTERM: it drained first), logged as such."""
        with self._lock:
            if self.state in ("restarting", "stopped"):
                return
            planned = planned or self.state == "draining"  # a service manager's SIGTERM reached the core too
            self.state = "restarting"
            self.deaths += 1
        if planned:
            log.info("engine core exited as told (%s)", why)
        else:
            log.error("engine core died (%s): failing its requests, waiting for a new one", why)
        self._fail_open(EngineCoreDied(f"the engine-core process died ({why}); the request was not finished"))

    def give_up(self, why: str, planned: bool = False) -> None:
        """The supervisor will not restart the core again: refuse everything from now on (503)."""
        self.gave_up = why
        self.core_died(why, planned)
        self.state = "stopped"

    def _fail_open(self, exc: BaseException) -> None:
        with self._lock:
            handles = list(self._open.values())
            self._open.clear()
            self._waiting.clear()
        for h in handles:
            if not h.future.done():
                h.future.set_exception(exc)
        for fut in list(self._replies.values()):
            if not fut.done():
                fut.set_result(None)

    # ---- wire ---------------------------------------------------------------------------------------------------
    def _send(self, msg: Submit | Cancel | Control) -> bool:
        """Push a message without ever waiting. With no high-water mark a message for a core that is away (dead,
        starting) waits in the socket for the next one, which drops it as another incarnation's; False only if
        ZeroMQ would block all the same."""
        frame = encode_in(msg)
        with self._push_lock:
            try:
                self._push.send(frame, self.zmq.NOBLOCK)
            except self.zmq.Again:
                return False
        return True

    def _call(self, op: str, arg: Any, wait_s: float | None) -> Any:
        """Send a control and wait for its answer (None: no core, or no answer within ``wait_s``)."""
        if self.state == "restarting" or self.core is None or not pid_alive(self.core.pid):
            return None
        call_id = next(self._calls)
        fut: Future = Future()
        self._replies[call_id] = fut
        if not self._send(Control(self.identity, self.incarnation, call_id, op, arg)):  # type: ignore[arg-type]
            self._replies.pop(call_id, None)
            return None
        try:
            answer = fut.result(timeout=wait_s)
        except FutureTimeout:
            return None
        finally:
            self._replies.pop(call_id, None)
        if answer is None:  # failed by the core's death
            return None
        value, error = answer
        if error is not None:
            raise error
        return value

    def _receive(self) -> None:
        zmq = self.zmq
        last_hello = 0.0
        while not self._closing:
            now = time.monotonic()
            if self.state in ("starting", "restarting") and now - last_hello >= HELLO_EVERY_S:
                self._dealer.send(HELLO)
                last_hello = now
            if self._dealer.poll(100):
                while True:
                    try:
                        frame = self._dealer.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._last_heard = time.monotonic()
                    pushed: list[RequestHandle] = []
                    for row in decode_out(frame):
                        self._dispatch(row, pushed)
                    RequestHandle.wake_all(pushed)  # one wake-up of the event loop per batch
            elif self.state in ("ok", "draining") and self.core is not None:
                if not pid_alive(self.core.pid):
                    self.core_died(f"pid {self.core.pid} exited")
                elif time.monotonic() - self._last_heard > SILENT_AFTER_S:
                    _fence(self.core.pid)  # hung: killed, so that its supervisor starts a new one
                    self.core_died(f"no heartbeat for {SILENT_AFTER_S:g} s")

    def _dispatch(self, row: list, pushed: list[RequestHandle]) -> None:
        kind = row[0]
        if kind == "t" or kind == "e":
            rid = row[1]
            handle = self._open.get(rid)
            if handle is not None:
                self._waiting.discard(rid)
                handle.push(token_event(row) if kind == "t" else pickle.loads(row[2]), wake=False)
                pushed.append(handle)
        elif kind == "r" or kind == "x":
            rid = row[1]
            with self._lock:
                handle = self._open.pop(rid, None)
                self._waiting.discard(rid)
            if handle is not None and not handle.future.done():
                if kind == "r":
                    handle.future.set_result(pickle.loads(row[2]))
                else:
                    handle.future.set_exception(rebuild_error(row[2], row[3]))
        elif kind == "h":
            status: CoreStatus = pickle.loads(row[2])
            if status.incarnation != self.incarnation:
                if self.state in ("ok", "draining"):  # a new core while we thought the old one alive
                    self.core_died(f"a new incarnation {status.incarnation} answered")
                with self._lock:
                    self.incarnation = status.incarnation
                    self._start_catch_up()
            self.core = status
            if self.on_batch is not None:
                for n, tokens in status.batches:
                    self.on_batch(n, tokens)
        elif kind == "c":
            if row[1] in self._catch_up:
                self._caught_up(row[1], pickle.loads(row[2]))
                return
            fut = self._replies.get(row[1])
            if fut is not None and not fut.done():
                fut.set_result(pickle.loads(row[2]))

    # ---- a new core's catch-up (the module docstring) ------------------------------------------------------------
    def _start_catch_up(self) -> None:
        """Send the new core every recorded state change, each with a call id to acknowledge (under ``_lock``);
        with nothing recorded it is in service at once."""
        self._catch_up_generation = self.log.generation
        self._catch_up = set()

        def send(change: Any) -> None:
            call_id = next(self._calls)
            self._catch_up.add(call_id)
            self._send(Control(self.identity, self.incarnation, call_id, "state", change))

        self.log.replay(send)
        if not self._catch_up:
            self._in_service()

    def _caught_up(self, call_id: int, answer: tuple[Any, BaseException | None]) -> None:
        """The core's acknowledgement of one replayed change: the last one puts it in service, unless the log
        changed meanwhile (then another round); a refused one fences the core."""
        _, error = answer
        with self._lock:
            self._catch_up.discard(call_id)
            if error is not None:
                self._catch_up = set()
                self.catch_up_error = (f"engine incarnation {self.incarnation} refused a recorded state change "
                                       f"({type(error).__name__}: {error}); it was stopped")
                log.error("%s", self.catch_up_error)
                if self.core is not None:
                    _fence(self.core.pid)  # never in service with another state than the front end's
                return
            if self._catch_up:
                return
            if self.log.generation != self._catch_up_generation:
                self._start_catch_up()  # a change was recorded while the core caught up
            else:
                self._in_service()

    def _in_service(self) -> None:
        if self.state in ("starting", "restarting"):
            self.catch_up_error = None
            self.state = "ok"
