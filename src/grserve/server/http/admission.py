"""Admission on the routes that queue work: a request accepted at the edge counts against ``--max-waiting`` from
that moment — while its body arrives, is parsed, validated, tokenized — until the engine's queue takes it
(``hand_over``, which ``lifecycle.finish`` calls) or its answer ends. So a burst past capacity is refused at the
edge, before its bodies are read (429 ``overloaded`` with ``Retry-After``), instead of piling up in front of an
engine queue that looks short (the issue: 500 concurrent LLM requests, ``--max-waiting 64``, never a 429, 40 s at the
median). The engine's own check at submit stays the authority for its queue.

Only the event loop touches the count (the edge and the routes run there): no lock.
"""

from __future__ import annotations

from grserve.engine.protocol import Engine
from grserve.server.http.errors import ApiError, overloaded

TICKET = "grserve.admission"  # the scope key of an admitted request's place


class Admission:
    """Requests admitted at the edge and not yet in the engine's queue (``pending``), bounded together with the
    engine's queue by its ``max_waiting``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pending = 0

    def refusal(self, holding: bool = False) -> ApiError | None:
        """429 when the engine's queue and the pending requests fill ``max_waiting`` (``holding``: the asking
        request is admitted already and does not count against itself), else None."""
        bound = getattr(self.engine, "max_waiting", None)  # the engine's queue bound (absent or None: none)
        if bound is None:
            return None
        depth, pending = int(self.engine.queue_depth), self.pending - int(holding)
        if depth + pending < bound:
            return None
        return overloaded(f"{depth} requests waiting and {pending} being read or tokenized (max_waiting={bound})")

    def admit(self, scope: dict) -> None:
        self.pending += 1
        scope[TICKET] = self


def hand_over(scope: dict) -> None:
    """The request is in the engine's queue now, or its answer has ended: it no longer counts as pending (a second
    call does nothing)."""
    admission = scope.pop(TICKET, None)
    if admission is not None:
        admission.pending -= 1
