"""What a client of the cluster sees of one request: each token position exactly once, and its text.

Tokens come from an instance as reports (``wire.TokenReport``: attempt, index within the attempt, ids, text);
attempt ``a`` was started with the ``base`` tokens delivered before it, so its token ``j`` is position ``base + j``
of the output. A report whose positions were all delivered already is skipped (a re-sent report), one that starts
beyond the next position is a gap and is refused, and so is one that overlaps the delivered ones only in part (its
text cannot be split by token): neither can happen, every attempt resumes exactly at the last delivered position.
Reports of an attempt that is no longer the request's current one (a fenced instance's late poll) are ignored.

The text is the instance engines' own: an attempt continues the request's text where the previous one left it
(``engine.types.Handover``: its engine replays the delivered tokens through its decoder), so stop strings and
held-back characters work across moves exactly as in one engine, and nothing is decoded twice here.
"""

from __future__ import annotations

from grserve.cluster.wire import TokenReport


class TokenStream:
    def __init__(self) -> None:
        self.output_ids: list[int] = []
        self.attempt = 0
        self.base = 0  # output tokens delivered when the current attempt started
        self.text = ""
        self.duplicates = 0  # positions an instance re-sent (skipped)

    def new_attempt(self) -> int:
        """A resubmission: its tokens start at the next undelivered position."""
        self.attempt += 1
        self.base = len(self.output_ids)
        return self.attempt

    def accept(self, report: TokenReport) -> tuple[list[int], str]:
        """The new tokens of an instance's report and the text they add (empty for a stale or re-sent report)."""
        if report.attempt != self.attempt:
            return [], ""
        ids = report.token_ids
        pos = self.base + report.index
        if pos > len(self.output_ids):
            raise AssertionError(f"token gap: position {pos} after {len(self.output_ids)} delivered")
        if not ids:  # an end without a token (an error or a cancel): nothing to deliver
            return [], ""
        skip = len(self.output_ids) - pos
        if skip >= len(ids):
            self.duplicates += len(ids)
            return [], ""
        if skip > 0:
            raise AssertionError(f"a report overlapping delivered positions: {pos}… after {len(self.output_ids)}")
        self.output_ids.extend(ids)
        self.text += report.text
        return list(ids), report.text
