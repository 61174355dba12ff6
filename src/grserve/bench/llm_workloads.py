"""LLM serving workloads (arrivals × length distributions) and the SLO metrics of Apt-Serve §2.4.

Lengths are synthetic (no dataset can be downloaded here), matching the paper's qualitative descriptions and
OPT's 2048-token limit (prompt + output ≤ ``max_len``):
- ``sharegpt``: chat; long, high-variance outputs (lognormal prompt median 180, output median 200, σ ≈ 0.9);
- ``humaneval``: code completion; prompts ~140 ± 40, short low-variance outputs ~90 ± 30;
- ``longbench``: summarisation; long prompts (lognormal median 1200, σ 0.4), outputs median 150.
``scale`` multiplies every length (the CPU engine runs the same shapes scaled down).

Arrivals: Poisson(rate), or Gamma with shape 1/CV², scale 1/(rate·shape) (CV = 1 is Poisson).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grserve.registry import Registry

# Prompt and output lengths per dataset: ``(n, rng) -> (prompt lengths, output lengths)`` before scaling.
LENGTH_DISTRIBUTIONS: Registry[tuple[np.ndarray, np.ndarray]] = Registry("dataset")


@LENGTH_DISTRIBUTIONS.register("sharegpt")
def _sharegpt(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return rng.lognormal(np.log(180), 0.9, n), rng.lognormal(np.log(200), 0.9, n)


@LENGTH_DISTRIBUTIONS.register("humaneval")
def _humaneval(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return rng.normal(140, 40, n), rng.normal(90, 30, n)


@LENGTH_DISTRIBUTIONS.register("longbench")
def _longbench(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return rng.lognormal(np.log(1200), 0.4, n), rng.lognormal(np.log(150), 0.6, n)


DATASETS = LENGTH_DISTRIBUTIONS.names()


@dataclass(frozen=True)
class TraceItem:
    arrival: float
    prompt_len: int
    output_len: int


def arrivals(n: int, rate: float, cv: float = 1.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if cv == 1.0:
        gaps = rng.exponential(1.0 / rate, n)
    else:
        shape = 1.0 / cv**2
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    return np.cumsum(gaps)


def make_trace(dataset: str, n: int, rate: float, *, cv: float = 1.0, seed: int = 0, max_len: int = 2048,
               scale: float = 1.0) -> list[TraceItem]:
    """``n`` requests; the same seed gives the same lengths at every rate (only arrivals stretch)."""
    rng = np.random.default_rng(seed + 7919)
    p, o = LENGTH_DISTRIBUTIONS.create(dataset, n, rng)
    p = np.clip(np.round(p * scale), 4, None).astype(int)
    o = np.clip(np.round(o * scale), 4, None).astype(int)
    cap = int(max_len * scale)
    p = np.minimum(p, cap - 4)
    o = np.minimum(o, cap - p)
    t = arrivals(n, rate, cv, seed)
    return [TraceItem(float(a), int(x), int(y)) for a, x, y in zip(t, p, o)]


def p99(xs: list[float]) -> float:
    """Per-request P99 of its TBTs (0 with fewer than two output tokens, as the Repo's client)."""
    return float(np.percentile(xs, 99)) if xs else 0.0


def attainment(records, ttft_slo: float, tbt_slo: float) -> dict[str, float]:
    """SLO attainment = share of requests meeting both TTFT and P99-TBT SLOs (plus each one alone)."""
    n = len(records)
    ttft_ok = [r.ttft <= ttft_slo for r in records]
    tbt_ok = [p99(r.tbts) <= tbt_slo for r in records]
    both = [a and b for a, b in zip(ttft_ok, tbt_ok)]
    return {"attainment": sum(both) / n, "ttft_attainment": sum(ttft_ok) / n, "tbt_attainment": sum(tbt_ok) / n}


def effective_throughput(rates: list[float], attains: list[float], level: float = 0.9) -> float:
    """Highest rate of the sweep with attainment ≥ level (0 if none); linear interpolation to the first failing
    rate after it, as the crossing point of the attainment curve."""
    best = 0.0
    for i, (r, a) in enumerate(zip(rates, attains)):
        if a >= level:
            best = r
            if i + 1 < len(rates) and attains[i + 1] < level:
                r2, a2 = rates[i + 1], attains[i + 1]
                best = r + (r2 - r) * (a - level) / (a - a2)
        elif best:
            break
    return best
