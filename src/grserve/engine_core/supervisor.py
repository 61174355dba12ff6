"""Starting, watching and restarting an engine-core process.

``CoreSupervisor`` spawns the core (``multiprocessing``'s spawn start: a fresh interpreter, nothing of the parent's
threads or torch state inherited), watches it, and when it dies unasked starts the next incarnation — at most
``max_restarts`` times within ``window_s`` — telling the front ends of this process (``listeners``: they fail the
dead core's requests at once and refuse new ones until the new core says hello). After that it gives up: the front
ends answer 503 with the reason, ``/health`` shows it. Front ends in other processes (``--api-servers``) find the
death themselves (the core's pid) and the new core by its heartbeat.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Any, Protocol

from grserve.engine_core.core_process import CoreSpec, Endpoints, run_core

log = logging.getLogger("grserve.engine_core")


class Listener(Protocol):
    def core_died(self, why: str) -> None: ...

    def give_up(self, why: str, planned: bool = False) -> None: ...


def exit_reason(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class CoreSupervisor:
    def __init__(self, kind: str, config: Any, max_restarts: int = 3, window_s: float = 600.0):
        self.kind, self.config = kind, config
        self.max_restarts, self.window_s = max_restarts, window_s
        self.endpoints = Endpoints.fresh()
        self.incarnation = 0
        self.proc: Any = None
        self.listeners: list[Listener] = []
        self.restarts: deque[float] = deque()
        self.gave_up: str | None = None
        self.ready = False  # set once the first core was ready: a core that fails to start is not restarted
        self._stopping = False
        self._watcher: threading.Thread | None = None

    def start(self) -> CoreSupervisor:
        self._spawn()
        self._watcher = threading.Thread(target=self._watch, name="grserve-core-supervisor", daemon=True)
        self._watcher.start()
        return self

    def started(self, info: dict) -> None:
        """The first core is ready (``info``: its start-up facts). Every later incarnation runs the torch thread
        count this one chose: at fp32 a few kernels (SDPA with one query row, MKL's sgemm on row counts that are not
        a multiple of 8) sum in another order with another thread count, so a count measured anew after a crash
        could move scores in their last bits -- a restart must not change an answer (issue 41)."""
        self.ready = True
        threads = info.get("threads")
        if threads:
            self.config = keep_threads(self.kind, self.config, int(threads))

    def _kept(self) -> str:
        part = getattr(self.config, "llm" if self.kind == "llm" else "process", None)
        threads = getattr(part, "threads", 0)
        return f", {threads} torch threads as before" if threads else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _spawn(self) -> None:
        self.incarnation += 1
        spec = CoreSpec(self.kind, self.config, self.endpoints, self.incarnation, os.getpid())
        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(target=run_core, args=(spec,), name=f"grserve-engine-core-{self.incarnation}",
                                daemon=True)
        self.proc.start()

    def _watch(self) -> None:
        while not self._stopping:
            proc = self.proc
            proc.join(0.2)
            if proc.exitcode is None or self._stopping:
                continue
            why = f"engine process pid {proc.pid}: {exit_reason(proc.exitcode)}"
            if proc.exitcode == 0:  # it stopped as told (SIGTERM to it: drained first): not restarted
                self.gave_up = f"{why} (it was stopped: SIGTERM)"
                for listener in self.listeners:
                    listener.give_up(self.gave_up, planned=True)
                return
            for listener in self.listeners:
                listener.core_died(why)
            if not self.ready:
                return  # it never started (start_core reports it)
            now = time.monotonic()
            while self.restarts and now - self.restarts[0] > self.window_s:
                self.restarts.popleft()
            if len(self.restarts) >= self.max_restarts:
                self.gave_up = (f"{why}; restarted {len(self.restarts)} times in {self.window_s:g} s, not "
                                f"restarting again")
                log.error("grserve: %s", self.gave_up)
                for listener in self.listeners:
                    listener.give_up(self.gave_up)
                return
            self.restarts.append(now)
            log.error("grserve: %s; starting engine incarnation %d", why, self.incarnation + 1)
            print(f"grserve: {why}; restarting it (incarnation {self.incarnation + 1}{self._kept()})", flush=True)
            self._spawn()

    def stop(self, timeout_s: float = 15.0) -> None:
        """After the core was told to stop (or died): wait for it, then end it by force; remove its sockets."""
        self._stopping = True
        proc = self.proc
        if proc is not None:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2)
        self.endpoints.remove()


def keep_threads(kind: str, config: Any, threads: int) -> Any:
    """``config`` with the engine's ``--threads`` set to ``threads`` (serve llm's own flag, or the retrieval and
    ranking engines' ``ProcessConfig.threads``); a count the user gave is kept as given."""
    part = "llm" if kind == "llm" else "process"
    section = getattr(config, part, None)
    if section is None or getattr(section, "threads", 1) != 0:
        return config
    return replace(config, **{part: replace(section, threads=threads)})
