"""The step latency model of co-location (xLLM's "performance model based on the Roofline Model and online factor
learning", digest §3.2): the time of one engine iteration predicted from what it computes.

    t(step) = a + b · prefill_tokens + c · decode_requests + d · context_tokens

Roofline-shaped: ``a`` is the fixed cost of a step (reading the weights once, launch and Python overhead — the
memory-bound floor of a small batch), ``b`` the compute per new prompt token (the FLOP-bound part), ``c`` the
per-request cost of a decode row (its sampling, its share of the weight-bound matmuls), ``d`` the attention cost
per cached token read (K/V bytes: memory-bound). The factors are learned online: every executed step adds its
measured duration to an exponentially forgotten least-squares fit (``forget`` per sample, so the model follows a
machine whose speed drifts), solved with a small ridge and with every factor kept ≥ 0 (an active-set pass: a
negative factor is fixed at 0 and the rest refitted). Until ``min_samples`` steps were seen the model does not
predict (``predict`` returns None): the caller decides what to do without a model. ``correction`` (EWMA of
measured / predicted time over latency-strict steps, ``observe_strict``) scales the predictions the co-location
admission uses: the "online factor learning" on top of the Roofline-shaped fit.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class StepFeatures(NamedTuple):
    prefill_tokens: int = 0  # new tokens computed by prompt (or partial-prompt) rows
    decode_requests: int = 0  # rows computing exactly their next token
    context_tokens: int = 0  # tokens each row attends over, summed

    def __add__(self, o: "StepFeatures") -> "StepFeatures":  # type: ignore[override]
        return StepFeatures(self.prefill_tokens + o.prefill_tokens, self.decode_requests + o.decode_requests,
                            self.context_tokens + o.context_tokens)

    def row(self) -> np.ndarray:
        return np.array([1.0, self.prefill_tokens, self.decode_requests, self.context_tokens])


def item_features(num_tokens: int, num_computed: int, num_new: int) -> StepFeatures:
    """One scheduled row: a request with ``num_tokens`` tokens, ``num_computed`` cached, computing ``num_new``."""
    if num_new == 1 and num_computed == num_tokens - 1:
        return StepFeatures(0, 1, num_tokens)
    return StepFeatures(num_new, 0, num_computed + num_new)


class StepLatencyModel:
    def __init__(self, forget: float = 0.995, ridge: float = 1e-9, min_samples: int = 8,
                 correction_rate: float = 0.05, refit_every: int = 16):
        self.forget, self.ridge, self.min_samples = forget, ridge, min_samples
        self.refit_every = refit_every  # solve again after this many new steps (each step asks: a solve each was
        #                                 ~2-4 % of a small model's decode step; the fit forgets over ~200 steps)
        self._since_fit = 0
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        self.samples = 0
        self._coef: np.ndarray | None = None
        self.correction, self.correction_rate = 1.0, correction_rate

    def observe_strict(self, predicted: float, seconds: float) -> None:
        """A latency-strict step (one with online work) took ``seconds`` where ``predict`` said ``predicted``:
        update ``correction``, the EWMA of measured / predicted over such steps (clipped to [0.5, 2]). The fit
        is dominated by the most frequent steps (big offline batches); the admission multiplies its predictions
        by ``correction``, learned where its error matters."""
        ratio = min(2.0, max(0.5, seconds / predicted))
        self.correction += self.correction_rate * (ratio - self.correction)

    def observe(self, f: StepFeatures, seconds: float) -> None:
        x = f.row()
        self._xtx = self.forget * self._xtx + np.outer(x, x)
        self._xty = self.forget * self._xty + x * seconds
        self.samples += 1
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._coef = None

    @property
    def coef(self) -> np.ndarray | None:
        """(a, b, c, d), every one ≥ 0; None before ``min_samples`` observations."""
        if self.samples < self.min_samples:
            return None
        if self._coef is None:
            self._coef = self._solve()
            self._since_fit = 0
        return self._coef

    def _solve(self) -> np.ndarray:
        scale = np.sqrt(np.maximum(np.diag(self._xtx), 1e-30))  # columns differ by orders of magnitude
        a = self._xtx / np.outer(scale, scale)
        y = self._xty / scale
        active = np.ones(4, dtype=bool)
        coef = np.zeros(4)
        for _ in range(4):
            idx = np.flatnonzero(active)
            sub = a[np.ix_(idx, idx)] + self.ridge * np.eye(len(idx))
            coef = np.zeros(4)
            coef[idx] = np.linalg.lstsq(sub, y[idx], rcond=None)[0]
            if (coef >= 0).all():
                break
            active &= coef > 0
        return np.maximum(coef, 0.0) / scale

    def predict(self, f: StepFeatures) -> float | None:
        c = self.coef
        return None if c is None else float(c @ f.row())
