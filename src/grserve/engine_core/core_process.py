"""The engine-core process: the engine (scheduler + model, its step thread) and one I/O thread that talks to the
front ends over ZeroMQ (``messages.py``), as vLLM's V1 engine core does beside its API servers.

The I/O thread (this process's main thread) polls three things: the inbox (a PULL socket every front end pushes
requests, cancels and controls to), the outbox (a ROUTER socket: each front end's DEALER says hello there and
receives its batches), and a pipe the engine's thread writes one byte to when it queues output into an empty
outbox. Every wake-up sends what has been queued since, one frame per front end: the events of one decode step for
all of a front end's requests travel together. A heartbeat (``CoreStatus``) goes to every front end every
``HEARTBEAT_S``.

The process ignores SIGINT (Ctrl-C reaches the whole process group: whoever started it orders it to drain and stop,
``Control``); SIGTERM makes it drain and stop by itself (a service manager that signals every process of the
server); it stops by itself when its parent dies (kill -9 of the server: no orphan keeps the model's memory).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grserve.engine_core.messages import (
    HEARTBEAT_S,
    HELLO,
    Cancel,
    Control,
    CoreStatus,
    Submit,
    decode_in,
    encode_out,
    end_row,
    event_row,
    reply_row,
    status_row,
)


@dataclass(frozen=True)
class Endpoints:
    """Where a core listens: two Unix-domain sockets in a private directory (no TCP port is opened)."""

    inbox: str
    outbox: str

    @classmethod
    def fresh(cls) -> Endpoints:
        d = tempfile.mkdtemp(prefix="grserve-core-")  # mode 0700: only this user reaches the core
        return cls(f"ipc://{d}/in", f"ipc://{d}/out")

    @property
    def error_file(self) -> str:
        """Where a core that cannot start writes why (its front end reports it as a usage error)."""
        return os.path.join(os.path.dirname(self.inbox.removeprefix("ipc://")), "start-error")

    def remove(self) -> None:
        for path in (self.inbox.removeprefix("ipc://"), self.outbox.removeprefix("ipc://"), self.error_file):
            try:
                os.unlink(path)
            except OSError:
                pass
        try:
            os.rmdir(os.path.dirname(self.inbox.removeprefix("ipc://")))
        except OSError:
            pass


@dataclass(frozen=True)
class CoreSpec:
    """What a core process builds and where it listens (pickled to the spawned process)."""

    kind: str  # a key of ``builders()``
    config: Any  # the serving config the builder reads
    endpoints: Endpoints
    incarnation: int
    parent_pid: int


def builders() -> dict[str, Callable[[Any, Callable[[int, int], None]], tuple[Any, dict]]]:
    """kind -> build(config, on_batch) -> (an unstarted engine, its info for the front ends)."""
    from grserve.engine_core.builders import build_llm, build_ranking, build_retrieval

    return {"llm": build_llm, "retrieval": build_retrieval, "ranking": build_ranking}


def run_core(spec: CoreSpec) -> None:
    """The spawned process's target: build the engine, serve the front ends until told to stop."""
    from grserve.memory import settle_allocator

    settle_allocator(getattr(spec.config, "process", None))  # bounded oneDNN caches, 2 arenas, malloc_trim
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    terms: list[CoreLoop] = []  # SIGTERM to this process too (a service manager's, or the interpreter exit of
    #                             its parent): drain, then stop — as the front end would order
    signal.signal(signal.SIGTERM, lambda *_: terms[0].terminate() if terms else os._exit(0))
    batches: list[Callable[[int, int], None]] = []  # the loop's on_batch, once it exists
    try:
        engine, info = builders()[spec.kind](spec.config, lambda n, t: batches[0](n, t) if batches else None)
    except (ValueError, KeyError, OSError) as exc:  # a bad model, file or flag: the user's to fix
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        with open(spec.endpoints.error_file, "w") as f:
            f.write(message)
        sys.exit(3)
    engine.start()
    gc.collect()  # the model and everything built at start-up out of the cyclic collector's sight (as a front
    gc.freeze()  # end's settle_heap): a full collection then walks only what requests allocated
    loop = CoreLoop(engine, info, spec)
    batches.append(loop.on_batch)
    terms.append(loop)
    loop.run()
    # Stopped as told, everything answered and the sockets closed: leave without the interpreter's teardown, where
    # extension modules torch loaded (triton's nanobind bindings) print pages of "leaked instance" noise at exit;
    # multiprocessing's own exit work (its finalizers: tqdm's lock's semaphore given back) still runs.
    from multiprocessing import util

    util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class CoreLoop:
    def __init__(self, engine: Any, info: dict, spec: CoreSpec):
        import zmq

        self.engine, self.info, self.spec = engine, info, spec
        self.zmq = zmq
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(spec.endpoints.inbox)
        self.outbox = self.ctx.socket(zmq.ROUTER)
        self.outbox.setsockopt(zmq.SNDHWM, 0)  # never drop a front end's batch (a ROUTER drops at its bound);
        self.inbox.setsockopt(zmq.RCVHWM, 0)  # the front ends' admission bounds what can be in flight
        self.outbox.bind(spec.endpoints.outbox)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._queued: deque[tuple[bytes, tuple]] = deque()
        self._wake_pending = False
        self._in_step = False
        self._lock = threading.Lock()  # the heartbeat's batch list
        if hasattr(engine, "step_hooks"):  # the LLM engine: the rows of a step leave together when it ends
            engine.step_hooks = (self._step_began, self._step_ended)
        self.front_ends: set[bytes] = set()
        self.done = False
        self._batches: list[tuple[int, int]] = []  # the engine's on_batch calls since the last heartbeat
        self.beat = getattr(engine, "beat", None)  # the mode's own facts for every heartbeat (ranking's stats)

    # ---- output (any thread) --------------------------------------------------------------------------------
    def _queue(self, front_end: bytes, row: tuple) -> None:
        """Queue a row for its front end (no lock: a deque append is atomic). Inside an engine step the I/O thread
        is woken once, when the step ends (``_step_ended``): one frame per front end carries the whole step, and
        the engine's thread never hands the interpreter lock to the I/O thread mid-step."""
        self._queued.append((front_end, row))
        if not self._in_step:
            self._wake()

    def _wake(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:  # the pipe is full: the I/O thread is awake already
                pass

    def _step_began(self) -> None:
        self._in_step = True

    def _step_ended(self) -> None:
        self._in_step = False
        if self._queued:
            self._wake()

    def _relay(self, front_end: bytes, request_id: str, handle: Any) -> None:
        handle.forward(lambda ev: self._queue(front_end, event_row(request_id, ev)))

        def ended(fut: Any) -> None:
            exc = fut.exception()
            self._queue(front_end, end_row(request_id, None if exc is not None else fut.result(), exc))

        handle.future.add_done_callback(ended)

    def _flush(self) -> None:
        self._wake_pending = False  # before draining: a row queued from now on wakes the I/O thread again
        queued = []
        while True:
            try:
                queued.append(self._queued.popleft())
            except IndexError:
                break
        if not queued:
            return
        by_front_end: dict[bytes, list[tuple]] = {}
        for fe, row in queued:
            by_front_end.setdefault(fe, []).append(row)
        for fe, rows in by_front_end.items():
            if fe:
                self.outbox.send_multipart([fe, encode_out(rows)])

    def status(self) -> CoreStatus:
        h = self.engine.health()
        with self._lock:
            batches, self._batches = self._batches, []
        return CoreStatus(self.spec.incarnation, os.getpid(), h.status, int(h.queue_depth), int(h.running),
                          dict(h.detail), dict(self.engine.stats()), self.info, batches,
                          self.beat() if self.beat is not None else {})

    def on_batch(self, requests: int, tokens: int) -> None:
        """The engine's per-batch callback: sent with the next heartbeat (the front ends' batch histograms)."""
        with self._lock:
            self._batches.append((requests, tokens))

    def _beat(self, front_ends: set[bytes] | None = None) -> None:
        frame = encode_out([status_row(self.status())])
        for fe in front_ends if front_ends is not None else self.front_ends:
            self.outbox.send_multipart([fe, frame])

    # ---- input (the I/O thread) -----------------------------------------------------------------------------
    def _apply(self, msg: Submit | Cancel | Control) -> None:
        if msg.incarnation != self.spec.incarnation:
            return  # sent to a core that died: its front end has failed it already
        if isinstance(msg, Submit):
            rid = msg.request.request_id
            try:
                handle = self.engine.submit(msg.request)
            except Exception as exc:  # noqa: BLE001 - a refusal (queue full, draining, never fits): its answer
                self._queue(msg.front_end, end_row(rid, None, exc))
                return
            self._relay(msg.front_end, rid, handle)
        elif isinstance(msg, Cancel):
            self.engine.cancel(msg.request_id)
        elif msg.op in ("drain", "stop"):  # they wait on the engine: a thread of their own
            threading.Thread(target=self._control, args=(msg,), name=f"grserve-core-{msg.op}", daemon=True).start()
        else:
            self._control(msg)  # a state change: in order with the requests around it

    def _control(self, msg: Control) -> None:
        answer, error = None, None
        try:
            if msg.op == "drain":
                answer = self.engine.drain(msg.arg)
            elif msg.op == "stop":
                self.engine.stop()
                answer = True
                self.done = True
            elif msg.op == "state":
                from grserve.cluster.gr.state_change import apply_change

                answer = apply_change(self.engine, msg.arg)
            else:
                raise ValueError(f"unknown control {msg.op!r}")
        except Exception as exc:  # noqa: BLE001 - the caller's failure, raised there
            error = exc
        if msg.op == "state" and error is None:
            self._beat()  # the new state in a heartbeat before the answer: a front end's /health agrees at once
        self._queue(msg.front_end, reply_row(msg.call_id, answer, error))

    def terminate(self) -> None:
        """SIGTERM: finish what runs (the edge's shutdown timeout), then stop."""
        timeout = getattr(getattr(self.spec.config, "edge", None), "shutdown_timeout", 30.0)

        def drain_then_stop() -> None:
            self.engine.drain(timeout)
            self.engine.stop()
            self.done = True
            self._queue(b"", ("n",))  # wake the I/O thread (a row for no front end: dropped)

        threading.Thread(target=drain_then_stop, name="grserve-core-sigterm", daemon=True).start()

    def run(self) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.outbox, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self.done:
                ready = dict(poller.poll(max(0.0, next_beat - time.monotonic()) * 1000))
                if self.inbox in ready:
                    while True:
                        try:
                            frame = self.inbox.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._apply(decode_in(frame))
                if self.outbox in ready:
                    hello: set[bytes] = set()
                    while True:
                        try:
                            fe, frame = self.outbox.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if frame == HELLO:
                            hello.add(fe)
                    self.front_ends |= hello
                    self._beat(hello)
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                self._flush()
                if time.monotonic() >= next_beat:
                    self._beat()
                    next_beat = time.monotonic() + HEARTBEAT_S
                    if os.getppid() != self.spec.parent_pid:  # the server died (kill -9): nothing to serve
                        self.engine.stop()
                        break
            self._flush()  # the answers of a stop: the requests it ended, the reply
        finally:
            self.inbox.close(linger=0)
            self.outbox.close(linger=2000)
            self.ctx.term()
