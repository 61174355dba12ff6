"""The hybrid-cache scheduling problem (Definition 1) and Apt-Serve's greedy solver.

Each candidate request i has up to three options: none (value 0, memory 0), hidden cache (value g_h, memory c_h)
and KV cache (value g_kv = p_i, memory c_kv). Maximise Σ value subject to Σ memory ≤ M.

``greedy`` is Algorithm 1 of the appendix on marginal gains per unit memory (§5.3), generalised from the
paper's c_h = c_kv/2 to any block counts (so GQA, where c_h ≥ c_kv, simply never offers a hidden step):

- hidden allowed iff c_h < c_kv and g_h/c_h ≥ g_kv/c_kv (the paper's refinement p ≥ 2Nρm when c_h = c_kv/2);
  then two increments: hidden (θ = g_h/c_h, Δ = c_h) and upgrade (θ = (g_kv−g_h)/(c_kv−c_h), Δ = c_kv−c_h),
  and θ_hidden ≥ θ_upgrade holds (marginal gains are non-increasing);
- otherwise one increment: KV (θ = g_kv/c_kv, Δ = c_kv).

Feasibility fix (digest §5.5): increments that cannot fit even alone are dropped (a request whose KV cache can
never fit keeps a lone hidden increment when that has positive value), and V′ is the true value of the
break request alone at the level its break increment leads to (hidden for a hidden step, KV for an upgrade or a
KV step), which is ≥ θ·Δ — so ALG ≥ OPT/2 holds (tested against an exhaustive search over all 3^n
assignments, tests/grserve/scheduler/test_llm_schedulers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from grserve.kvcache.blocks import CacheKind


@dataclass(frozen=True)
class Candidate:
    req: int
    value_kv: float
    cost_kv: int
    value_hidden: float | None = None  # None: no hidden option
    cost_hidden: int | None = None
    theta_override: float | None = None  # SLO demotion: KV-only with this marginal gain (near-zero constant)


@dataclass(frozen=True)
class Increment:
    theta: float
    req: int
    delta: int
    to: CacheKind  # the request's cache kind after this increment
    value: float  # the request's total value after this increment
    upgrade: bool = False  # hidden → KV (only valid once the request's hidden increment was taken)


@dataclass
class Solution:
    choice: dict[int, CacheKind]  # selected requests → cache kind
    value: float
    used: int
    broke: bool = False  # the greedy hit an increment that did not fit
    single_won: bool = False  # V′ (the break request alone) beat the greedy prefix


def _hidden_allowed(c: Candidate) -> bool:
    if c.theta_override is not None or c.value_hidden is None or c.cost_hidden is None:
        return False
    if c.cost_hidden >= c.cost_kv:
        return False
    return c.value_hidden * c.cost_kv >= c.value_kv * c.cost_hidden and c.value_hidden > 0


def increments(cands: list[Candidate], budget: int) -> list[Increment]:
    """The candidate schedule set Υ (Eq. 10), minus increments that cannot fit on their own."""
    out: list[Increment] = []
    for c in cands:
        if _hidden_allowed(c):
            assert c.cost_hidden is not None and c.value_hidden is not None
            if c.cost_hidden > budget:
                continue
            out.append(Increment(c.value_hidden / c.cost_hidden, c.req, c.cost_hidden, "hidden", c.value_hidden))
            if c.cost_kv <= budget:
                out.append(Increment((c.value_kv - c.value_hidden) / (c.cost_kv - c.cost_hidden), c.req,
                                     c.cost_kv - c.cost_hidden, "kv", c.value_kv, upgrade=True))
        elif c.cost_kv > budget:  # KV cannot fit at all: hidden alone is the only option left
            if (c.theta_override is None and c.value_hidden is not None and c.cost_hidden is not None
                    and c.value_hidden > 0 and c.cost_hidden <= budget):
                out.append(Increment(c.value_hidden / c.cost_hidden, c.req, c.cost_hidden, "hidden",
                                     c.value_hidden))
        else:
            theta = c.theta_override if c.theta_override is not None else c.value_kv / c.cost_kv
            value = theta * c.cost_kv if c.theta_override is not None else c.value_kv
            out.append(Increment(theta, c.req, c.cost_kv, "kv", value))
    return out


def greedy(cands: list[Candidate], budget: int, *, keeping: bool = False) -> Solution:
    """Algorithm 1: sort increments by θ (stable: ties keep candidate order), take while they fit, break on the
    first that does not; return the better of the prefix and the break request alone.

    ``keeping=True`` is the decode-iteration variant (U = R: whom to *keep*; everyone not kept is preempted):
    no double check (the Repo's decode greedy has none — choosing the break request alone would preempt every
    other running request to keep one) and no break: an increment that does not fit is skipped and smaller
    ones after it are still taken, so nobody is preempted who still fits (the kept set is maximal)."""
    incs = sorted(increments(cands, budget), key=lambda x: -x.theta)
    choice: dict[int, CacheKind] = {}
    value_of: dict[int, float] = {}
    used, total = 0, 0.0
    broke = False
    for inc in incs:
        if used + inc.delta <= budget:
            if inc.upgrade and inc.req not in choice:
                continue  # its hidden step was skipped (only possible with keeping=True)
            used += inc.delta
            total += inc.value - value_of.get(inc.req, 0.0)
            value_of[inc.req] = inc.value
            choice[inc.req] = inc.to
        elif keeping:
            broke = True
        else:
            single_cost = inc.delta + (0 if inc.to == "hidden" or inc.req not in choice else
                                       _hidden_cost(cands, inc.req))
            if inc.value > total and single_cost <= budget:
                return Solution({inc.req: inc.to}, inc.value, single_cost, broke=True, single_won=True)
            return Solution(choice, total, used, broke=True)
    return Solution(choice, total, used, broke=broke)


def _hidden_cost(cands: list[Candidate], req: int) -> int:
    for c in cands:
        if c.req == req:
            return c.cost_hidden or 0
    return 0
