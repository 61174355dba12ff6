"""What a client of the cluster sees of one request: each token position exactly once, and its text.

Tokens come from an instance as (attempt, index within the attempt, ids); attempt ``a`` was started with the
``base`` tokens generated before it, so its token ``j`` is position ``base + j`` of the output. A position already
delivered is skipped (a replay overlapping what the client has), a position beyond the next one is a gap and is
refused (it cannot happen: every attempt resumes exactly at the last delivered position). Events of an attempt
that is no longer the request's current one (a fenced instance's late poll) are ignored.

The text is assembled here from all output ids (an instance that resumed a request only knows its own part), by
the engine's rules: stop strings cut the text and end the request, an unfinished UTF-8 character is held back, and
the longest stop string minus one character is held back until the end.
"""

from __future__ import annotations

from collections.abc import Callable


class TokenStream:
    def __init__(self, detokenize: Callable[[list[int]], str] | None, stop: tuple[str, ...] = ()):
        self.detokenize = detokenize
        self.stop = stop
        self.output_ids: list[int] = []
        self.attempt = 0
        self.base = 0  # output tokens delivered when the current attempt started
        self.text = ""
        self.emitted = 0
        self.stopped = False  # a stop string ended the text
        self.duplicates = 0  # positions an instance re-sent (skipped)

    def new_attempt(self) -> int:
        """A resubmission: its tokens start at the next undelivered position."""
        self.attempt += 1
        self.base = len(self.output_ids)
        return self.attempt

    def accept(self, attempt: int, index: int, ids: list[int]) -> list[int]:
        """The new tokens of an instance's report (``ids`` at positions ``base + index …``)."""
        if attempt != self.attempt or self.stopped:
            return []
        pos = self.base + index
        if pos > len(self.output_ids):
            raise AssertionError(f"token gap: position {pos} after {len(self.output_ids)} delivered")
        skip = len(self.output_ids) - pos
        self.duplicates += min(skip, len(ids))
        new = ids[skip:] if skip < len(ids) else []
        self.output_ids.extend(new)
        return new

    def text_delta(self, final: bool) -> str:
        """The text not yet shown, after the tokens accepted so far; sets ``stopped`` on a stop string."""
        if self.detokenize is None:
            return ""
        text = self.detokenize(self.output_ids)
        for s in self.stop:
            i = text.find(s)
            if i >= 0:
                text, self.stopped = text[:i], True
        self.text = text
        end = final or self.stopped
        hold = (max(len(s) for s in self.stop) - 1) if self.stop and not end else 0
        safe = len(text) if end else max(self.emitted, len(text) - hold)
        while safe > self.emitted and text[safe - 1] == "\ufffd" and not end:
            safe -= 1
        delta = text[self.emitted:safe]
        self.emitted = max(self.emitted, safe)
        return delta
