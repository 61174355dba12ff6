"""LLM serving workloads (arrivals × length distributions) and the SLO metrics of Apt-Serve §2.4.

Lengths are synthetic (no dataset can be downloaded here). Pairs are drawn and then filtered as the authors'
sampling scripts (eddiegaoo/Apt-Serve, ``sample_from_*.py``, vLLM's ShareGPT filter) do: drop a pair whose prompt
or output is < 4 tokens or whose prompt + output > 2048 (OPT's positions) — rejection, not clipping:
- ``sharegpt``: the first two turns of ShareGPT_V3 under that filter. Prompt lognormal(median 160, σ 1.0),
  output lognormal(median 130, σ 0.95): filtered means ≈ 245 / 197 tokens, matching what vLLM's filter gives on
  that file (1,000 requests: 245,995 prompt / 196,273 reference-output tokens with the Llama-2 tokenizer,
  229,711 / 203,068 with Llama-3.1; vLLM issue threads, docs/llm.md). The medians (σ) are our assumption;
  before issue 17 the output was lognormal(200, 0.9), mean ≈ 300 (``SHAREGPT_PRE17``);
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
    return rng.lognormal(np.log(160), 1.0, n), rng.lognormal(np.log(130), 0.95, n)


def SHAREGPT_PRE17(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The ShareGPT model before issue 17 (outputs ≈ 1.5× too long); kept for the reconstruction ladder."""
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


def sample_lengths(draw, n: int, rng: np.random.Generator, *, max_len: int = 2048, min_len: int = 4,
                   scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (prompt, output) pairs from ``draw(k, rng)``, filtered as the authors' sampling scripts: both sides
    ≥ ``min_len`` and prompt + output ≤ ``max_len`` tokens (pairs failing it are redrawn), then × ``scale``."""
    ps, os_, have = [], [], 0
    while have < n:
        p, o = (np.round(x) for x in draw(max(n - have, 16) * 2, rng))
        keep = (p >= min_len) & (o >= min_len) & (p + o <= max_len)
        ps.append(p[keep]), os_.append(o[keep])
        have += int(keep.sum())
    p, o = np.concatenate(ps)[:n], np.concatenate(os_)[:n]
    p = np.maximum(np.round(p * scale), 1).astype(int)
    o = np.maximum(np.round(o * scale), 1).astype(int)
    return p, o


def make_trace(dataset: str, n: int, rate: float, *, cv: float = 1.0, seed: int = 0, max_len: int = 2048,
               scale: float = 1.0, lengths=None) -> list[TraceItem]:
    """``n`` requests; the same seed gives the same lengths at every rate (only arrivals stretch). ``lengths``
    overrides the dataset's length model (a ``(n, rng) -> (prompts, outputs)`` callable)."""
    rng = np.random.default_rng(seed + 7919)
    draw = lengths or (lambda k, g: LENGTH_DISTRIBUTIONS.create(dataset, k, g))
    p, o = sample_lengths(draw, n, rng, max_len=max_len, scale=scale)
    t = arrivals(n, rate, cv, seed)
    return [TraceItem(float(a), int(x), int(y)) for a, x, y in zip(t, p, o)]


def p99(xs: list[float]) -> float:
    """Per-request P99 of its TBTs (0 with fewer than two output tokens, as the Repo's client)."""
    return float(np.percentile(xs, 99)) if xs else 0.0


def attainment(records, ttft_slo: float, tbt_slo: float, *, strict: bool = False) -> dict[str, float]:
    """SLO attainment = share of requests meeting both TTFT and P99-TBT SLOs (plus each one alone).

    The Repo's client (``gen_client_requests.calculate_SLO``): per request, P99 (numpy, linear) of its inter-token
    latencies excluding the first interval (the TTFT), 0 with ≤ 1 output token; a request attains iff
    TTFT < SLO and P99 < SLO (``strict=True``; default ≤, which only differs on exact ties)."""
    n = len(records)
    ok = (lambda x, slo: x < slo) if strict else (lambda x, slo: x <= slo)
    ttft_ok = [ok(r.ttft, ttft_slo) for r in records]
    tbt_ok = [ok(p99(r.tbts), tbt_slo) for r in records]
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
