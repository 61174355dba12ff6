"""Synthetic cache traces for ``grserve bench cache`` (digest §10.2). All generators are seeded and return
plain Python lists (keys are ints; prefix requests are int64 token arrays).

* ``zipf``: Zipf(α) over ``n_keys`` keys; with ``drift`` > 0, every ``drift_every`` requests that fraction of the
  popularity ranks is re-assigned to fresh keys (popularity churn).
* ``loop``: the keys 0..n−1 requested cyclically (LRU's worst case when n > cache).
* ``scan_hot``: a Zipf hot set interleaved with long one-touch scans.
* ``conversations``: multi-turn prompts with the Online-QA statistics (LCR §5.1): mean 3.63 turns per
  conversation; each prompt contains all earlier turns; the number of requests from *other* conversations between
  two turns is lognormal with mean 266 and sd 77.5 (σ ≈ 0.2854, μ ≈ 5.5428); a shared system prompt.
* ``dlrm_batches``: DLRM sparse-feature batches (B samples × pooling factor ids, power-law ids with churn).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def _zipf_ranks(rng: np.random.Generator, n_keys: int, alpha: float, size: int) -> np.ndarray:
    w = np.arange(1, n_keys + 1, dtype=np.float64) ** (-alpha)
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(size), side="right"), n_keys - 1)


def zipf(n_requests: int, n_keys: int = 100_000, alpha: float = 0.9, drift: float = 0.0,
         drift_every: int = 10_000, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    ranks = _zipf_ranks(rng, n_keys, alpha, n_requests)
    perm = rng.permutation(n_keys)  # rank -> key
    out = np.empty(n_requests, dtype=np.int64)
    next_key = n_keys
    for start in range(0, n_requests, drift_every if drift > 0 else n_requests):
        end = min(start + (drift_every if drift > 0 else n_requests), n_requests)
        out[start:end] = perm[ranks[start:end]]
        if drift > 0:
            m = int(drift * n_keys)
            which = rng.choice(n_keys, m, replace=False)
            perm[which] = np.arange(next_key, next_key + m)  # these ranks now map to brand-new keys
            next_key += m
    return out.tolist()


def loop(n_requests: int, n_keys: int = 1500) -> list[int]:
    return (np.arange(n_requests) % n_keys).tolist()


def scan_hot(n_requests: int, n_hot: int = 1000, alpha: float = 0.8, scan_len: int = 2000,
             scan_every: int = 5000, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    hot = _zipf_ranks(rng, n_hot, alpha, n_requests).tolist()
    out: list[int] = []
    scan_key = n_hot
    i = 0
    while len(out) < n_requests:
        out.extend(hot[i:i + scan_every])
        i += scan_every
        # a scan: interleave one-touch keys with the hot traffic (1 scan key per hot request)
        for _ in range(scan_len):
            out.append(scan_key)
            scan_key += 1
            if i < len(hot):
                out.append(hot[i])
                i += 1
    return out[:n_requests]


@dataclass
class PrefixRequest:
    conversation: int
    turn: int
    tokens: np.ndarray  # int64 prompt tokens (all earlier turns + this turn's message)


ONLINE_QA = dict(conversations=2000, turns_mean=3.63, prompt_mean=3455, gap_mean=266.0, gap_sd=77.5)


def conversations(n_conversations: int = 2000, turns_mean: float = 3.63, prompt_mean: float = 3455.0,
                  gap_mean: float = 266.0, gap_sd: float = 77.5, system_tokens: int = 64,
                  output_tokens: int = 256, scale: float = 1.0, seed: int = 0) -> list[PrefixRequest]:
    """Online-QA-like multi-turn prefix trace. ``scale`` shrinks token counts (not turns/gaps) for quick runs.

    Turns per conversation: 1 + Poisson(turns_mean − 1). Turn messages are sized so that the average prompt is
    ~prompt_mean tokens; each prompt = system prompt + all earlier (message, 256-token answer) + this message.
    The inter-turn gap g (requests from other conversations) is lognormal(μ, σ) fitted to the given mean/sd;
    requests are laid out by giving every turn a target position and sorting (arrival order)."""
    rng = np.random.default_rng(seed)
    sigma = math.sqrt(math.log(1.0 + (gap_sd / gap_mean) ** 2))
    mu = math.log(gap_mean) - sigma ** 2 / 2.0
    turns = 1 + rng.poisson(turns_mean - 1.0, n_conversations)
    out_tok = max(1, int(output_tokens * scale))
    sys_tok = max(1, int(system_tokens * scale))
    # mean prompt of turn j (1-based) ≈ sys + j·msg + (j−1)·out; average over turns ≈ prompt_mean
    mean_j = float(np.mean([(t + 1) / 2.0 for t in turns]))
    msg_mean = max(8.0, (prompt_mean * scale - sys_tok - (mean_j - 1.0) * out_tok) / mean_j)
    system = np.arange(sys_tok, dtype=np.int64)
    next_tok = sys_tok
    events: list[tuple[float, int, int, np.ndarray]] = []
    n_total = int(turns.sum())
    rate_span = n_total  # conversations start uniformly over the trace
    for c in range(n_conversations):
        pos = rng.random() * rate_span
        prefix = system
        for j in range(int(turns[c])):
            m = max(4, int(rng.exponential(msg_mean)))
            msg = np.arange(next_tok, next_tok + m, dtype=np.int64)
            next_tok += m
            prompt = np.concatenate([prefix, msg])
            events.append((pos, c, j, prompt))
            ans = np.arange(next_tok, next_tok + out_tok, dtype=np.int64)
            next_tok += out_tok
            prefix = np.concatenate([prompt, ans])
            pos += 1.0 + rng.lognormal(mu, sigma)
    events.sort(key=lambda e: e[0])
    return [PrefixRequest(c, j, toks) for _, c, j, toks in events]


def dlrm_batches(n_batches: int, batch_size: int = 128, pooling: int = 50, n_ids: int = 200_000,
                 alpha: float = 1.05, churn: float = 0.01, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(indices, offsets) per batch, offsets in the EmbeddingBag sense (start of each sample's bag)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n_ids)
    out = []
    for _ in range(n_batches):
        ranks = _zipf_ranks(rng, n_ids, alpha, batch_size * pooling)
        idx = perm[ranks].astype(np.int64)
        offsets = np.arange(0, batch_size * pooling, pooling, dtype=np.int64)
        out.append((idx, offsets))
        m = int(churn * n_ids)
        a, b = rng.choice(n_ids, m, replace=False), rng.choice(n_ids, m, replace=False)
        perm[a], perm[b] = perm[b].copy(), perm[a].copy()  # popularity churn between batches
    return out
