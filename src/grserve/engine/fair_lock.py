"""The engine lock: a reentrant lock granted in arrival order (FIFO), handed directly from owner to waiter.

The engine thread holds ``LLMEngine.lock`` for a whole model step and takes it again right after releasing it;
other threads (a submit, a cancel, a cluster instance's KV export or reset) wait on the same lock between steps.
``threading.RLock`` is not fair: the releasing thread usually takes it back before a woken waiter runs, so under
CPU load a busy engine starved a submit for seconds (a test saw a mean wait of 24 steps and a maximum of 140 with
one other thread; in the cluster, healthy instances missed heartbeats and were fenced).

Here ``release`` gives the lock to the oldest waiter *before* it returns, so the engine thread, asking again, queues
behind every thread that was already waiting: a waiter waits for at most the step in progress plus the short holds
of the waiters ahead of it. Re-entry by the owner (``step`` → ``fail`` → ``_finish`` …) only counts. The lock is
uncontended most of the time (one engine thread), where it costs one small mutex round trip more than an RLock.
"""

from __future__ import annotations

import threading
from collections import deque


class FairRLock:
    """A reentrant FIFO lock: ``with lock:``, ``acquire(blocking=True, timeout=-1)``, ``release()``."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()  # guards the fields below; held only for a few operations
        self._owner: int | None = None
        self._count = 0
        self._waiters: deque[tuple[int, threading.Lock]] = deque()  # (thread id, its parked lock), oldest first

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me:
                self._count += 1
                return True
            if self._owner is None and not self._waiters:
                self._owner, self._count = me, 1
                return True
            if not blocking:
                return False
            park = threading.Lock()
            park.acquire()
            entry = (me, park)
            self._waiters.append(entry)
        if park.acquire(timeout=timeout):  # released by ``release``, which made this thread the owner
            return True
        with self._mutex:  # timed out: leave the queue, unless the lock was handed over meanwhile
            if self._owner == me:
                return True
            self._waiters.remove(entry)
            return False

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release un-acquired lock")
            self._count -= 1
            if self._count:
                return
            if self._waiters:
                self._owner, park = self._waiters.popleft()
                self._count = 1
                park.release()
            else:
                self._owner = None

    def locked(self) -> bool:
        return self._owner is not None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
