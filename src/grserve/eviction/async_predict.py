"""ASYNC prediction (Algorithm 1, Lines 31–32): predictions are computed off the request path and may be stale.

Keys are queued as they are accessed. A job (predict a batch of queued keys) is launched only when the previous
job has completed and at least ``batch`` keys are queued (the paper's DLRM condition: "only if the previous task
has completed, which can prevent task accumulation"). Results land in a mailbox that the policy drains at its next
event (double buffering), so the policy's data structures are only touched by the request thread.

``threaded=True`` runs jobs on a daemon thread; ``threaded=False`` is the deterministic emulation used by the
benchmark and tests: the job runs at the launch point and its results become visible at the next drain, so
predictions lag the accesses by at most ``batch`` requests.
"""

from __future__ import annotations

import threading
from typing import Any, Hashable


class AsyncPredictionJobs:
    def __init__(self, predictor: Any, batch: int = 64, threaded: bool = False):
        self.predictor = predictor
        self.batch = max(1, batch)
        self.threaded = threaded
        self._queued: dict[Hashable, int] = {}  # key -> access time (latest)
        self._mailbox: list[tuple[list[Hashable], list[float]]] = []
        self._lock = threading.Lock()
        self._busy = False
        self.jobs = 0
        self.predicted = 0
        self._work = threading.Condition(self._lock)
        self._pending_job: tuple[list[Hashable], int] | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._worker, name="laru-async-predict", daemon=True)
            self._thread.start()

    def submit(self, key: Hashable, now: int) -> None:
        self._queued[key] = now
        if len(self._queued) >= self.batch:
            self._maybe_launch(now)

    def _maybe_launch(self, now: int) -> None:
        with self._lock:
            if self._busy:
                return  # previous task still running: keep queueing (no task accumulation)
            self._busy = True
            keys = list(self._queued)
            self._queued.clear()
            if self.threaded:
                self._pending_job = (keys, now)
                self._work.notify()
                return
        self._run(keys, now)

    def _run(self, keys: list[Hashable], now: int) -> None:
        vals = list(self.predictor.predict(keys, now))
        with self._lock:
            self._mailbox.append((keys, vals))
            self._busy = False
            self.jobs += 1
            self.predicted += len(keys)

    def _worker(self) -> None:
        while True:
            with self._lock:
                while self._pending_job is None and not self._stop:
                    self._work.wait()
                if self._stop:
                    return
                keys, now = self._pending_job
                self._pending_job = None
            try:
                self._run(keys, now)
            except Exception:  # noqa: BLE001 - a failed job only leaves predictions stale
                with self._lock:
                    self._busy = False

    def drain(self) -> list[tuple[list[Hashable], list[float]]]:
        if not self._mailbox:
            return []
        with self._lock:
            out, self._mailbox = self._mailbox, []
        return out

    def close(self) -> None:
        if self._thread is not None:
            with self._lock:
                self._stop = True
                self._work.notify()
            self._thread.join(timeout=5)
            self._thread = None
