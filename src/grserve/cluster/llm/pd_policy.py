"""Dynamic prefill/decode disaggregation policy (xLLM §3.2, digest §3.3): pure decisions, no tensors, no Ray.

The real cluster (``cluster/pd``) and the discrete-event simulation (``grserve_bench/pd_sim``) both ask this module the
same questions: which pool is each instance in, is this request worth splitting, where does it prefill, where
does it decode, and should an instance flip role now.

Pieces, in the paper's words:

- ``RolePools``: the four elastic pools **P, D, P->D, D->P**. Instances are stateless: a flip only moves the
  instance to the other pool (no reload); requests running on it finish there. P->D holds former prefill instances
  that now decode, D->P the converse; flipping such an instance back returns it to its home pool (P or D), which
  is why the flip rules take from these pools first (hysteresis: the most recent flip is undone first).
- ``PDCostModel``: prefill throughput and the KV transfer cost; ``break_even_tokens`` is the split threshold.
- ``TTFTPredictor``: queueing delay + ``a + b·L + c·L²`` prefill time, fitted online by least squares.
- ``TPOTPredictor``: ``d0 + d1·batch + d2·context tokens`` (xllm-service's form), fitted online the same way.
- ``should_split`` / ``pick_prefill`` / ``pick_decode`` / ``decide_flip``: the two-level scheduling and the role
  switching rules.

Decisions where the paper is ambiguous (also in docs/cluster.md, "PD disaggregation: policy and simulation"):

- **Instances kept per role**: the report says at least two decode instances, xllm-service keeps one per role.
  We keep ``PDConfig.min_per_role`` per role (default 1: the bench has 3 instances), for both roles.
- **Dwell**: an instance may flip only ``min_dwell_s`` after it entered its current pool; the start counts as
  entering (no flip in the first ``min_dwell_s``).
- **Queueing delay** of an instance = ``b · queued_prefill_tokens`` (the linear term of the fitted prefill time
  applied to the uncached tokens queued there). A token count does not say how the queue splits into requests,
  so the quadratic term of queued requests is not known; xllm-service sums per-request estimates instead.
- **Split threshold**: splitting moves the prefill off the decode instance (which would otherwise stall its
  running decodes for ``L / prefill_tokens_per_s``) at the price of one KV transfer. It pays when the prefill time
  is at least the transfer time: ``L/R >= o + L·k/B``, i.e. ``L >= o / (1/R - k/B)`` (never when ``k/B >= 1/R``).
- **Predicted TTFT on an instance** = ``prefill_slowdown`` × (queueing delay + prefill time): an instance that
  prefills in small chunks between its running decodes (a decode-role instance taking an overflow prefill, or a
  flipped one still finishing decodes) is slower than the profile says; the monitor supplies the factor (1 when
  unknown). Without it a busy decode instance looks as fast as an idle prefill instance.
- **Prefill choice**: the prefill-role instance with the least predicted TTFT (ties: lowest index). When none
  meets the TTFT SLO, a decode-role instance that meets it is taken (xllm-service: "an overloaded prefill may be
  placed on a decode instance that has slack"); otherwise the least predicted TTFT of the prefill pool (and
  ``decide_flip`` converts a decode instance). So if any instance meets the SLO, the chosen one does.
- **Decode choice**: stay on the prefill instance (no KV transfer) when it is in the decode role and its predicted
  TPOT meets the SLO; else the first decode-role instance, lightest first (fewest running decode tokens), whose
  predicted TPOT meets the SLO; else the least predicted TPOT.
- **TTFT break** (D->P): even the best prefill-role instance's predicted TTFT for ``input_tokens`` exceeds the
  SLO; when prefills may overflow to decode instances (``allow_decode_instances``), the best of *every*
  instance (the report's pseudo-code converts an instance only when no candidate meets the SLO).
  **P->D**: "resource shortage" = a decode-role instance has decodes waiting for KV space
  (``waiting_decode_requests``); **TPOT break** = the request-weighted mean recent TPOT of the decode pool exceeds
  the SLO; **idle** = a prefill-role instance is idle while the decode pool holds running requests (the report's
  "prefill instances are idle"; an idle cluster does not flip). TTFT is checked first.
- **Margins**: the functions judge against the ``SLOConfig`` they are given; callers pass the SLOs scaled by
  ``PDConfig.slo_headroom`` (0.8) so that a prediction a little short does not put requests just past the SLO.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from grserve.config import PDConfig, SLOConfig

POOLS = ("P", "D", "P->D", "D->P")


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


_ROLE_OF_POOL = {"P": Role.PREFILL, "D->P": Role.PREFILL, "D": Role.DECODE, "P->D": Role.DECODE}
# flipping from a pool lands in: P->D / D->P go back home, P / D go to the converted pool
_FLIP_TO = {"P": "P->D", "P->D": "P", "D": "D->P", "D->P": "D"}


@dataclass
class InstanceSignals:
    """What a monitor knows about one instance at time ``now``."""

    queued_prefill_tokens: int = 0  # uncached prompt tokens booked/queued there
    running_decode_requests: int = 0
    running_decode_tokens: int = 0  # context tokens of running decodes (KV read per step)
    recent_tpot_s: float | None = None  # measured mean token interval over a recent window (None: no data)
    idle: bool = True  # nothing queued or running
    waiting_decode_requests: int = 0  # decodes whose KV waits for memory there (resource shortage)
    prefill_slowdown: float = 1.0  # how much slower than profiled this instance prefills now (e.g. in small
    #                                chunks between running decodes); predicted TTFT is scaled by it

    @property
    def load_tokens(self) -> int:
        """"The fewest tokens being processed" of the report: queued prefill + running decode context."""
        return self.queued_prefill_tokens + self.running_decode_tokens


class RolePools:
    """The four elastic pools P, D, P->D, D->P. Instance ids are ``0..n-1``; the first ``prefill_instances``
    start in P, the rest in D. ``flip`` refuses a flip that ``can_flip`` refuses (dwell, ``min_per_role``)."""

    def __init__(self, n: int, prefill_instances: int, cfg: PDConfig, now: float):
        k = cfg.min_per_role
        if not k <= prefill_instances <= n - k:
            raise ValueError(f"{prefill_instances} prefill of {n} instances leaves a role below "
                             f"min_per_role={k}")
        self.n = n
        self.min_per_role = k
        self.min_dwell_s = cfg.min_dwell_s
        self._pool = ["P" if i < prefill_instances else "D" for i in range(n)]
        self._since = [now] * n
        self._alive = [True] * n  # the real cluster's view (``set_alive``); the simulation's instances never die
        self.flips: dict[str, int] = {"p_to_d": 0, "d_to_p": 0}
        self.log: list[tuple[float, int, str, str]] = []  # (time, instance, from pool, to pool)

    def role(self, i: int) -> Role:
        return _ROLE_OF_POOL[self._pool[i]]

    def pool(self, i: int) -> str:
        return self._pool[i]

    def members(self, role: Role) -> list[int]:
        return [i for i in range(self.n) if self.role(i) is role]

    def in_pool(self, pool: str) -> list[int]:
        return [i for i in range(self.n) if self._pool[i] == pool]

    def set_alive(self, i: int, alive: bool) -> None:
        """A dead instance keeps its pool (a restarted one comes back in it) but neither flips nor counts toward
        ``min_per_role``."""
        self._alive[i] = bool(alive)

    def live_members(self, role: Role) -> list[int]:
        return [i for i in self.members(role) if self._alive[i]]

    def since(self, i: int) -> float:
        """When ``i`` entered its current pool."""
        return self._since[i]

    def can_flip(self, i: int, now: float) -> bool:
        dwell_ok = now - self._since[i] >= self.min_dwell_s
        return dwell_ok and self._alive[i] and len(self.live_members(self.role(i))) > self.min_per_role

    def flip(self, i: int, now: float) -> Role:
        if not self.can_flip(i, now):
            live = len(self.live_members(self.role(i)))
            raise ValueError(f"instance {i} may not flip at t={now}: dwell {self.min_dwell_s}s from "
                             f"t={self._since[i]}, alive {self._alive[i]}, {live} live in its role")
        old = self._pool[i]
        new = _FLIP_TO[old]
        self.flips["p_to_d" if _ROLE_OF_POOL[new] is Role.DECODE else "d_to_p"] += 1
        self._pool[i] = new
        self._since[i] = now
        self.log.append((now, i, old, new))
        return self.role(i)


@dataclass
class PDCostModel:
    """The costs the split decision needs (measured on the cluster, or given for the simulation)."""

    prefill_tokens_per_s: float  # R: uncached prompt tokens per second of one instance
    kv_bytes_per_token: int  # k: 2 · layers · kv_heads · head_dim · dtype bytes
    transfer_bytes_per_s: float  # B: link bandwidth between instances
    transfer_overhead_s: float  # o: fixed cost of one transfer (setup, one round trip)

    def transfer_s(self, tokens: int) -> float:
        """Seconds to move ``tokens`` tokens of KV: ``o + tokens · k / B``."""
        return self.transfer_overhead_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def break_even_tokens(self) -> int:
        """Shortest uncached prompt whose prefill time is at least its KV transfer time:
        ``L/R >= o + L·k/B  <=>  L >= o / (1/R - k/B)``; ``sys.maxsize``-like (2**62) when transfer per token is
        not cheaper than prefill per token (splitting never pays)."""
        per_token_gain = 1.0 / self.prefill_tokens_per_s - self.kv_bytes_per_token / self.transfer_bytes_per_s
        if per_token_gain <= 0:
            return 2 ** 62
        return max(1, math.ceil(self.transfer_overhead_s / per_token_gain - 1e-9))


class _OnlineLeastSquares:
    """Least squares over a growing set of (features, y) via the normal equations (3x3, ridge-free; solved by
    Gaussian elimination with partial pivoting). Falls back to the prior until the system is well posed."""

    def __init__(self, prior: tuple[float, ...]):
        self.coef = list(prior)
        d = len(prior)
        self._xtx = [[0.0] * d for _ in range(d)]
        self._xty = [0.0] * d
        self.n = 0

    def add(self, x: tuple[float, ...], y: float) -> None:
        d = len(x)
        for r in range(d):
            self._xty[r] += x[r] * y
            for c in range(d):
                self._xtx[r][c] += x[r] * x[c]
        self.n += 1
        if self.n >= d:
            sol = _solve([row[:] for row in self._xtx], self._xty[:])
            if sol is not None:
                self.coef = sol


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    d = len(b)
    # scale columns so that L and L² features do not ruin the conditioning
    scale = [math.sqrt(a[c][c]) or 1.0 for c in range(d)]
    for r in range(d):
        for c in range(d):
            a[r][c] /= scale[r] * scale[c]
        b[r] /= scale[r]
    for col in range(d):
        piv = max(range(col, d), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-10:
            return None
        a[col], a[piv] = a[piv], a[col]
        b[col], b[piv] = b[piv], b[col]
        for r in range(col + 1, d):
            f = a[r][col] / a[col][col]
            for c in range(col, d):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    x = [0.0] * d
    for r in range(d - 1, -1, -1):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, d))) / a[r][r]
    return [x[r] / scale[r] for r in range(d)]


class TTFTPredictor:
    """xLLM's TTFT predictor: ``TTFT = queueing delay + prefill(L)``, ``prefill(L) = a + b·L + c·L²``, fitted online
    by least squares on observed (input tokens, prefill seconds); queueing delay = ``b · queued tokens``. Until
    three distinct lengths are observed, the prior coefficients are used."""

    def __init__(self, a: float = 0.0, b: float = 1e-4, c: float = 0.0):
        self._fit = _OnlineLeastSquares((a, b, c))

    @property
    def coef(self) -> tuple[float, float, float]:
        a, b, c = self._fit.coef
        return a, b, c

    def observe(self, input_tokens: int, seconds: float) -> None:
        L = float(input_tokens)
        self._fit.add((1.0, L, L * L), seconds)

    def prefill_s(self, input_tokens: int) -> float:
        a, b, c = self.coef
        L = float(input_tokens)
        return max(0.0, a + b * L + c * L * L)

    def predict(self, queued_prefill_tokens: int, input_tokens: int) -> float:
        return max(0.0, self.coef[1]) * queued_prefill_tokens + self.prefill_s(input_tokens)


class TPOTPredictor:
    """xllm-service's TPOT model ``d0 + d1·batch + d2·context tokens``, fitted online like ``TTFTPredictor``."""

    def __init__(self, d0: float = 0.02, d1: float = 0.0, d2: float = 0.0):
        self._fit = _OnlineLeastSquares((d0, d1, d2))

    def observe(self, batch: int, context_tokens: int, seconds: float) -> None:
        self._fit.add((1.0, float(batch), float(context_tokens)), seconds)

    def predict(self, batch: int, context_tokens: int) -> float:
        d0, d1, d2 = self._fit.coef
        return max(0.0, d0 + d1 * batch + d2 * context_tokens)


def should_split(uncached_tokens: int, cfg: PDConfig, cost: PDCostModel) -> bool:
    """Split (prefill on one instance, decode on another) only when the uncached prompt is long enough that the
    transfer pays: ``cfg.split_min_tokens`` when > 0, else ``cost.break_even_tokens()``."""
    threshold = cfg.split_min_tokens if cfg.split_min_tokens > 0 else cost.break_even_tokens()
    return uncached_tokens >= threshold


def _argmin(ids: list[int], key) -> int:
    return min(ids, key=lambda i: (key(i), i))


def predicted_ttft(s: InstanceSignals, ttft: TTFTPredictor, input_tokens: int) -> float:
    """TTFT of a new prefill of ``input_tokens`` on the instance ``s`` describes: the predictor's queueing delay +
    prefill time, times the instance's ``prefill_slowdown``."""
    return s.prefill_slowdown * ttft.predict(s.queued_prefill_tokens, input_tokens)


def pick_prefill(pools: RolePools, signals: dict[int, InstanceSignals], ttft: TTFTPredictor, input_tokens: int,
                 slo: SLOConfig, allow_decode_instances: bool = True) -> int:
    """The prefill-role instance with the least predicted TTFT; if it breaks the SLO, a decode-role instance that
    meets it (the least predicted TTFT among those), when ``allow_decode_instances``; else the prefill-role best."""
    pred = {i: predicted_ttft(signals[i], ttft, input_tokens) for i in signals}
    best = _argmin(pools.members(Role.PREFILL), pred.__getitem__)
    if pred[best] <= slo.ttft_slo_s or not allow_decode_instances:
        return best
    meeting = [i for i in pools.members(Role.DECODE) if pred[i] <= slo.ttft_slo_s]
    return _argmin(meeting, pred.__getitem__) if meeting else best


def predicted_tpot(s: InstanceSignals, tpot: TPOTPredictor | None, context_tokens: int) -> float:
    """TPOT of ``s`` with one more request of ``context_tokens``: the TPOT model when given, else the measured
    recent TPOT (0 without data: an instance with no measurement is assumed to meet any SLO)."""
    if tpot is not None:
        return tpot.predict(s.running_decode_requests + 1, s.running_decode_tokens + context_tokens)
    return s.recent_tpot_s or 0.0


def pick_decode(pools: RolePools, signals: dict[int, InstanceSignals], slo: SLOConfig, prefill_instance: int | None,
                tpot: TPOTPredictor | None = None, context_tokens: int = 0) -> int:
    """Stay on ``prefill_instance`` (no KV transfer) when it is in the decode role and meets the TPOT SLO; else the
    first decode-role instance, lightest first, whose predicted TPOT meets it; else the least predicted TPOT.
    ``prefill_instance`` None: a request not split (both phases on the instance returned)."""
    pred = {i: predicted_tpot(signals[i], tpot, context_tokens) for i in signals}
    home = prefill_instance
    if home is not None and pools.role(home) is Role.DECODE and pred[home] <= slo.tpot_slo_s:
        return home
    members = sorted(pools.members(Role.DECODE), key=lambda i: (signals[i].running_decode_tokens, i))
    for i in members:
        if pred[i] <= slo.tpot_slo_s:
            return i
    return _argmin(members, pred.__getitem__)


def pool_tpot(pools: RolePools, signals: dict[int, InstanceSignals]) -> float | None:
    """Request-weighted mean recent TPOT of the decode pool (None when no decode instance has data)."""
    num = den = 0.0
    for i in pools.members(Role.DECODE):
        s = signals[i]
        if s.recent_tpot_s is not None and s.running_decode_requests > 0:
            num += s.recent_tpot_s * s.running_decode_requests
            den += s.running_decode_requests
    return num / den if den else None


def _first_flippable(pools: RolePools, pool_order: tuple[str, ...], key, now: float) -> int | None:
    for name in pool_order:
        ids = [i for i in pools.in_pool(name) if pools.can_flip(i, now)]
        if ids:
            return _argmin(ids, key)
    return None


def decide_flip(pools: RolePools, signals: dict[int, InstanceSignals], ttft: TTFTPredictor, slo: SLOConfig,
                cfg: PDConfig, now: float, input_tokens: int = 0,
                allow_decode_instances: bool = False) -> tuple[int, Role] | None:
    """The report's role switching rule; returns (instance, new role) or None. Does not flip (the caller does).

    D->P when even the best prefill-role instance's predicted TTFT (for ``input_tokens``; with
    ``allow_decode_instances`` the best of every instance) breaks the SLO: the lightest instance of P->D, else of
    D. P->D when a decode instance has decodes waiting for memory or the decode pool's mean TPOT breaks the SLO
    (the lightest of D->P, else of P), or when a prefill-role instance is idle while decodes run (that idle
    instance, D->P first). ``min_per_role`` and ``min_dwell_s`` are respected (``RolePools.can_flip``)."""
    if not cfg.role_flips:
        return None
    load = lambda i: signals[i].load_tokens  # noqa: E731
    prefill = pools.members(Role.PREFILL)
    judged = list(signals) if allow_decode_instances else prefill
    best_ttft = min(predicted_ttft(signals[i], ttft, input_tokens) for i in judged)
    if best_ttft > slo.ttft_slo_s:
        i = _first_flippable(pools, ("P->D", "D"), load, now)
        return (i, Role.PREFILL) if i is not None else None
    tp = pool_tpot(pools, signals)
    shortage = any(signals[i].waiting_decode_requests > 0 for i in pools.members(Role.DECODE))
    if shortage or (tp is not None and tp > slo.tpot_slo_s):
        i = _first_flippable(pools, ("D->P", "P"), load, now)
        if i is not None:
            return i, Role.DECODE
    decoding = any(signals[i].running_decode_requests > 0 for i in pools.members(Role.DECODE))
    if decoding:
        idle = [i for i in prefill if signals[i].idle and pools.can_flip(i, now)]
        if idle:
            order = [i for i in idle if pools.pool(i) == "D->P"] or idle
            return min(order), Role.DECODE
    return None
