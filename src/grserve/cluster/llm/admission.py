"""Admission at the cluster front end: the server edge's bounded queue and queue deadline (``EdgeConfig``).

A single-process server bounds the requests that wait for their first schedule (``AsyncLLMEngine``:
``--max-waiting``, ``--request-timeout``). In a cluster the front end is the one place that sees every request, so
it is the authority: a request is *waiting* from its submission until its first token reaches the front end (the
front end cannot see an instance's scheduler, so a request in its prefill still counts as waiting — a stricter
bound than the single process's). Beyond ``max_waiting`` waiting requests a submission is refused
(``EngineOverloaded`` → HTTP 429 with ``Retry-After``); a request still waiting ``request_timeout`` seconds after its
submission is cancelled at its instance and failed with ``RequestTimedOut`` (HTTP 503 ``queue_timeout``). A request
moved off a dead instance before its first token keeps its submission time: the client has waited all along.
The instances' own engines run without a bound or deadline (``cluster/llm/instance.py``): a moved request must never
be refused by its new instance.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from grserve.engine.protocol import EngineOverloaded

if TYPE_CHECKING:
    from grserve.config import EdgeConfig


class FrontAdmission:
    def __init__(self, edge: EdgeConfig | None = None):
        self.max_waiting: int | None = edge.max_waiting if edge is not None else None  # None: no edge (in code)
        self.request_timeout_s: float | None = edge.request_timeout if edge is not None else None
        self.waiting: dict[str, float] = {}  # request id → monotonic submission time, until its first token
        self.refused = 0
        self.expired_total = 0

    def admit(self, request_id: str) -> None:
        """Book a new request as waiting, or raise ``EngineOverloaded`` (the caller holds the front end's lock)."""
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            self.refused += 1
            raise EngineOverloaded(f"{len(self.waiting)} requests waiting for their first token at the cluster front "
                                   f"end (max_waiting={self.max_waiting})")
        self.waiting[request_id] = time.monotonic()

    def started(self, request_id: str) -> None:
        """Its first token arrived (or it ended): it no longer waits."""
        self.waiting.pop(request_id, None)

    def expired(self, now: float | None = None) -> list[str]:
        """Requests waiting longer than the deadline, oldest first; they leave the waiting set."""
        if self.request_timeout_s is None or not self.waiting:
            return []
        limit = (time.monotonic() if now is None else now) - self.request_timeout_s
        out = []
        for rid, t in self.waiting.items():  # insertion order = submission order
            if t >= limit:
                break
            out.append(rid)
        for rid in out:
            del self.waiting[rid]
        self.expired_total += len(out)
        return out

    @property
    def depth(self) -> int:
        return len(self.waiting)
