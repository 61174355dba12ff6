"""Sampling parameters and the sampler, vectorised over the batch and numerically safe for every accepted value.

One ``sample(logits, rows)`` call per engine step: the logits of every request that samples a token now (one row
each) go through

1. **logit processing** (``process_logits``; vLLM's order and semantics): a structured-output request's grammar
   mask first (``SampleRow.allowed``: its matcher's allowed-token bitmask, ``engine/structured.py``; every other
   token's logit becomes −inf), then ``logit_bias`` added, ``min_tokens``
   masking EOS and ``stop_token_ids`` while too few tokens are out, then repetition (prompt + output tokens:
   positive logits ÷ r, negative × r), frequency (− f · count in the output) and presence (− p if in the output)
   penalties. Each is one batched tensor operation over the rows that use it;
2. **choice** (``choose``), in float64 and in log space: NaN logits count as −inf; a row with +inf logits chooses
   among those (uniformly); a row with no finite logit is an *error for that row only* (``SampleOutput.errors``).
   Temperature below ``SAMPLING_EPS`` (1e-5, as vLLM) is greedy (argmax, lowest id on ties); otherwise the
   log-weights ``(logits − max) / T`` (maximum exactly 0: no overflow for any T), then top-k, min-p
   (``log p ≥ log min_p + log p_max``, no underflow) and top-p on what top-k and min-p keep (cumulative mass
   *before* a token < top_p, so the most likely token is always kept: ``top_p = 1e-300`` is greedy, never empty).
   The kept tokens are always a prefix of the sorted order (log-weight descending, *token id ascending among
   equal log-weights*, on every path: where only the K tokens any row can keep are sorted, they are the full
   stable sort's first K, a tie across the K-th place included, so neither K, the batch's maximum, nor ``topk``'s
   order of ties decides a row's tokens) and
   the draw is an inverse-CDF lookup whose target stays below the kept mass, so it lands on a kept token of
   positive weight: no value of T, top_p, top_k, min_p or of the logits can produce NaN or an empty distribution;
3. **the draw** takes its uniform from ``(seed, position)`` only (``draw_uniform``: a splitmix64 mix of the
   request's seed and the absolute position of the token being sampled, i.e. prompt + output tokens before it).
   A request therefore samples the same tokens whatever shares its batch, after a preemption, and when a replay
   (failover) re-submits prompt + generated-so-far with the same seed: nothing per request is carried across steps.

``logprobs`` (``SamplingParams.logprobs = k``) are the model's raw log-probabilities (log_softmax of the logits
before any processing, vLLM's default): the chosen token's and the top k.

The steps above, as written, are ``_sample_reference`` (``sample(..., reference=True)``); ``sample`` runs
``_sample_fast``, which returns the same token ids, logprobs and errors bit for bit: per-thread scratch buffers
reused across steps, in place, argmax only for greedy rows, and no full stable float64 sort (``_draw_filtered_fast``).
"""

from __future__ import annotations

import bisect
import math
import operator
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from grserve.engine.structured import StructuredSpec, mask_logits

SAMPLING_EPS = 1e-5  # temperature below this is greedy
MASK64 = (1 << 64) - 1
NEG_INF_LOGPROB = -9999.0  # what a -inf log-probability is reported as (JSON has no -inf; vLLM's value)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's log-probability and the top k
    structured: StructuredSpec | None = None  # structured output: a grammar masks the tokens (engine/structured.py)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 = off)")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if any(not math.isfinite(b) for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be finite")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def processes_logits(self) -> bool:
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.structured is not None)

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the model's logits as they are (the executor may pick the argmax itself)."""
        return self.greedy and not self.processes_logits and self.logprobs is None


@dataclass
class SampleRow:
    """What the sampler needs about one request at this step."""

    params: SamplingParams
    seed: int  # the request's seed (``params.seed``, or one drawn when it was admitted)
    position: int  # absolute position of the token being sampled (tokens before it)
    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    allowed: np.ndarray | None = None  # int32 bitmask [ceil(V / 32)] of the tokens its grammar allows (None: all)


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    errors: list[str | None]  # a message for a row that could not be sampled (that request fails, no one else)


# ---- the draw ---------------------------------------------------------------------------------------------------
def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix64(seed: int, position: int) -> int:
    """A stable 64-bit mix of (seed, position); any Python ints (negative and > 64-bit seeds fold in)."""
    return _splitmix64(_splitmix64(seed & MASK64) ^ (position & MASK64))


def draw_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that the token at ``position`` of a request seeded ``seed`` is drawn with."""
    return (mix64(seed, position) >> 11) * 2.0 ** -53


# ---- logit processing -------------------------------------------------------------------------------------------
def _padded(lists: list[Sequence[int]], fill: int, device) -> torch.Tensor:
    n = max((len(x) for x in lists), default=0)
    out = torch.full((len(lists), max(n, 1)), fill, dtype=torch.long)
    for i, x in enumerate(lists):
        if len(x):
            out[i, :len(x)] = torch.as_tensor(list(x), dtype=torch.long)
    return out.to(device)


def _presence(lists: list[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[B, V] counts of each token in each list (ids outside the vocabulary ignored)."""
    ids = _padded(lists, vocab, device).clamp(0, vocab)
    counts = torch.zeros(len(lists), vocab + 1, dtype=torch.float64, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float64))
    return counts[:, :vocab]


def process_logits(x: torch.Tensor, rows: list[SampleRow], eos_token_id: int | None = None) -> torch.Tensor:
    """Apply logit_bias, min_tokens, repetition / frequency / presence penalties to float64 logits [B, V], each
    vectorised over the rows that use it; returns ``x`` (modified in place)."""
    B, V = x.shape
    dev = x.device
    sel = [i for i, r in enumerate(rows) if r.allowed is not None]
    if sel:
        mask_logits(x, sel, np.stack([rows[i].allowed for i in sel]))
    sel = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if sel:
        ids = _padded([[t for t, _ in rows[i].params.logit_bias] for i in sel], V, dev)
        bias = torch.zeros(len(sel), V + 1, dtype=x.dtype, device=dev)
        vals = [[b for _, b in rows[i].params.logit_bias] for i in sel]
        bias.scatter_add_(1, ids.clamp(0, V), _padded_float(vals, ids.shape[1], dev))
        x[sel] += bias[:, :V]
    sel = [i for i, r in enumerate(rows) if len(r.output_ids) < r.params.min_tokens]
    if sel:
        banned = [list(rows[i].params.stop_token_ids) + ([eos_token_id] if eos_token_id is not None else [])
                  for i in sel]
        mask = _presence(banned, V, dev) > 0
        x[sel] = x[sel].masked_fill(mask, float("-inf"))
    sel = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if sel:
        seen = _presence([list(rows[i].prompt_ids) + list(rows[i].output_ids) for i in sel], V, dev) > 0
        r = torch.tensor([rows[i].params.repetition_penalty for i in sel], dtype=x.dtype, device=dev)[:, None]
        sub = x[sel]
        x[sel] = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    sel = [i for i, r in enumerate(rows) if r.params.presence_penalty or r.params.frequency_penalty]
    if sel:
        counts = _presence([rows[i].output_ids for i in sel], V, dev)
        f = torch.tensor([rows[i].params.frequency_penalty for i in sel], dtype=x.dtype, device=dev)[:, None]
        p = torch.tensor([rows[i].params.presence_penalty for i in sel], dtype=x.dtype, device=dev)[:, None]
        x[sel] -= f * counts + p * (counts > 0).to(x.dtype)
    return x


def _padded_float(vals: list[list[float]], width: int, device) -> torch.Tensor:
    out = torch.zeros(len(vals), width, dtype=torch.float64)
    for i, v in enumerate(vals):
        if v:
            out[i, :len(v)] = torch.tensor(v, dtype=torch.float64)
    return out.to(device)


# ---- choice -----------------------------------------------------------------------------------------------------
def sanitize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN → −inf; a row with +inf entries keeps only those (as equal logits 0). Returns (x, its row maxima, row
    has a candidate, i.e. a finite maximum)."""
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    mx = _only_posinf(x, x.max(dim=1).values)
    return x, mx, torch.isfinite(mx)


def _only_posinf(x: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` whose maximum ``mx`` is +inf keep only their +inf entries, as equal logits 0 (in place);
    returns the row maxima after that."""
    has_pos = torch.isposinf(mx)
    if bool(has_pos.any()):
        rows = has_pos.nonzero().flatten()
        x[rows] = torch.where(torch.isposinf(x[rows]), 0.0, float("-inf")).to(x.dtype)
        mx = torch.where(has_pos, 0.0, mx)
    return mx


def _filtered_sorted(logp: torch.Tensor, rows: list[SampleRow], full_sort: bool = False, ids: bool = True,
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Log-probabilities [b, V] (up to a per-row constant: every rule below is relative to the row's maximum) →
    (sorted logp, sorted ids, number of kept tokens per row) after top-k, min-p and
    top-p (each keeps a prefix of the sorted order, the first token always; top-p on the probabilities
    renormalised over what top-k and min-p keep, as vLLM).

    Only the K best tokens are sorted (``_top_candidates``: the first K of the full stable sort, ties by id), K the
    most any row can keep: top-k's k, min-p's count, and for
    top-p the tokens above ``p_max (1 − top_p) / V`` (a token at or below it has at least ``Z·top_p`` of mass
    before it, so top-p drops it). ``full_sort`` sorts everything (a test checks they agree). ``ids=False`` (the
    fast path): ``topk``'s values only, sorted ids None (everything but the ids is a function of the values)."""
    V = logp.shape[1]
    dev = logp.device
    lmax = logp.max(dim=1, keepdim=True).values
    k = torch.tensor([min(r.params.top_k, V) if r.params.top_k > 0 else V for r in rows], device=dev)
    min_p = torch.tensor([r.params.min_p for r in rows], dtype=torch.float64, device=dev)[:, None]
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float64, device=dev)
    floor_m = torch.log(min_p) + lmax  # log(min_p · p_max); -inf when min_p = 0
    n1 = torch.minimum(k, (logp >= floor_m).sum(dim=1)).clamp(min=1)  # what top-k and min-p keep
    cand = n1
    if bool((top_p < 1).any()):
        floor_p = lmax + torch.log1p(-top_p)[:, None] - math.log(V)
        cand = torch.minimum(cand, (logp > floor_p).sum(dim=1).clamp(min=1))
    K = V if full_sort else int(cand.max())
    if K * 4 < V:
        slp, sid = _top_candidates(logp, K) if ids else (logp.topk(K, dim=1, sorted=True).values, None)
    else:
        K = V
        slp, sid = logp.sort(dim=1, descending=True, stable=True)
    keep_n = torch.minimum(n1, torch.tensor(K, device=dev))
    if bool((top_p < 1).any()):
        ranks = torch.arange(K, device=dev)[None, :]
        p = torch.exp(slp - lmax).masked_fill(ranks >= keep_n[:, None], 0.0)
        z = _kept_mass(logp, lmax, floor_m, k, n1, p, K)
        before = torch.cumsum(p, dim=1) - p
        keep_n = torch.minimum(keep_n, (before < top_p[:, None] * z[:, None]).sum(dim=1).clamp(min=1))
    return slp, sid, keep_n


def _top_candidates(logp: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first K entries (K + 1 <= V) of the full stable descending sort of each row of ``logp`` (log-weight
    descending, token id ascending), values and ids, from ``topk``, which alone would leave two things to K (the
    batch's maximum) and to its implementation: which of the tokens tied at a row's K-th value it returns (a tie
    straddling the cut: ``topk`` of K + 1 shows it, and that row takes the lowest ids of the tie), and the order
    of equal values (the ids are sorted by (tie group, id): the groups, runs of equal values, stay in place)."""
    V = logp.shape[1]
    slp, sid = logp.topk(K + 1, dim=1, sorted=True)
    kth = slp[:, K - 1]
    straddle = (slp[:, K] == kth).nonzero().flatten().tolist()
    slp, sid = slp[:, :K], sid[:, :K].clone()
    for i in straddle:
        above = int((slp[i] > kth[i]).sum())
        sid[i, above:] = (logp[i] == kth[i]).nonzero().flatten()[:K - above]
    group = torch.zeros_like(sid)
    torch.cumsum(slp[:, 1:] != slp[:, :-1], dim=1, out=group[:, 1:])
    sid = group.mul_(V).add_(sid).sort(dim=1).values.remainder_(V)
    return logp.gather(1, sid), sid


def _kept_mass(logp: torch.Tensor, lmax: torch.Tensor, floor_m: torch.Tensor, k: torch.Tensor, n1: torch.Tensor,
               p: torch.Tensor, K: int) -> torch.Tensor:
    """Σ exp(logp − max) over what top-k and min-p keep: from the K sorted columns when it lies within them,
    else from the whole row (the min-p mask, and for a top-k beyond K its k-th value, ties counted exactly)."""
    z = p.sum(dim=1)
    wide = (n1 > K).nonzero().flatten()
    if len(wide):
        z[wide] = (torch.exp(logp[wide] - lmax[wide]) * (logp[wide] >= floor_m[wide])).sum(dim=1)
    for i in wide[k[wide] < logp.shape[1]].tolist():  # a top-k beyond the K columns (rare): its k-th value
        e = torch.exp(logp[i] - lmax[i]) * (logp[i] >= floor_m[i])
        t = logp[i].topk(int(k[i])).values[-1]
        above = logp[i] > t
        e = e * above + torch.exp(t - lmax[i]) * (logp[i] >= floor_m[i]) * (logp[i] == t) \
            * ((int(k[i]) - int(above.sum())) / max(int((logp[i] == t).sum()), 1))
        z[i] = e.sum()
    return z


def _draw(w: torch.Tensor, keep_n: torch.Tensor | None, rows: list[SampleRow]) -> torch.Tensor:
    """Inverse-CDF draw over the first ``keep_n`` entries (all when None) of each row of the log-weights ``w``
    (maximum 0 per row); returns positions, not token ids. The target is kept below the total mass, so the
    chosen position always has a positive weight (the CDF rises there)."""
    dev = w.device
    p = torch.exp(w)
    if keep_n is not None:
        p = p.masked_fill(torch.arange(w.shape[1], device=dev)[None, :] >= keep_n[:, None], 0.0)
    cdf = torch.cumsum(p, dim=1)
    return _inverse_cdf(cdf, rows, cdf[:, -1:])


def _inverse_cdf(cdf: torch.Tensor, rows: list[SampleRow], total: torch.Tensor) -> torch.Tensor:
    """The draw's lookup on a cumulative sum [b, n] whose kept mass is ``total`` [b, 1]: the first position where
    the CDF passes ``u · total`` (``u`` from (seed, position)), the target held below ``total`` so the position
    has a positive weight."""
    u = torch.tensor([draw_uniform(r.seed, r.position) for r in rows], dtype=cdf.dtype, device=cdf.device)[:, None]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)


def choose(x: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[str | None]]:
    """Processed float64 logits [B, V] → (token ids, per-row errors); see the module docstring."""
    x, mx, ok = sanitize(x)
    tokens = torch.argmax(x, dim=1)  # greedy rows (and a placeholder for failed ones)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy and bool(ok[i])]
    if sampled:
        sub_rows = [rows[i] for i in sampled]
        temp = torch.tensor([r.params.temperature for r in sub_rows], dtype=torch.float64, device=x.device)
        # log-weights: log-probabilities up to a per-row constant, maximum exactly 0 (no overflow for any T)
        w = (x[sampled] - mx[sampled, None]) / temp[:, None]
        filt = [j for j, r in enumerate(sub_rows) if r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0]
        plain = [j for j in range(len(sub_rows)) if j not in set(filt)]
        if plain:
            tokens[[sampled[j] for j in plain]] = _draw(w[plain], None, [sub_rows[j] for j in plain])
        if filt:
            slp, sid, keep_n = _filtered_sorted(w[filt], [sub_rows[j] for j in filt])
            at = _draw(slp, keep_n, [sub_rows[j] for j in filt])
            tokens[[sampled[j] for j in filt]] = sid.gather(1, at[:, None]).squeeze(1)
    errors = [None if bool(ok[i]) else "no token has a finite logit (the model produced NaN or every token was "
                                       "masked)" for i in range(len(rows))]
    return tokens.tolist(), errors


def _logprobs(raw: torch.Tensor, tokens: list[int], rows: list[SampleRow]) -> list[TokenLogprobs | None]:
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if not want:
        return out
    lp = torch.log_softmax(torch.nan_to_num(raw[want], nan=float("-inf")), dim=1)
    lp = torch.nan_to_num(lp, nan=NEG_INF_LOGPROB, neginf=NEG_INF_LOGPROB)
    k = min(max(rows[i].params.logprobs or 0 for i in want), raw.shape[1])
    top_v, top_i = lp.topk(k, dim=1) if k else (lp[:, :0], lp[:, :0].long())
    for j, i in enumerate(want):
        kk = rows[i].params.logprobs or 0
        top = list(zip(top_i[j, :kk].tolist(), top_v[j, :kk].tolist()))
        out[i] = TokenLogprobs(tokens[i], float(lp[j, tokens[i]]), top)
    return out


# ---- the fast path: the reference's results, bit for bit, with fewer passes and no full float64 sort -------------
_WORKSPACE_MAX_ELEMS = 1 << 22  # a buffer up to 4M elements (32 MiB float64) is kept per thread; larger ones are not


class _Workspace(threading.local):
    """Per-thread scratch tensors reused across steps: a fresh [B, V] float64 tensor costs a page fault per 4 KiB
    when first written (2 µs each on the measured VM: ~4.5 ms for 8 MiB, more than the arithmetic on it)."""

    def __init__(self) -> None:
        self.bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, n: int, V: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        numel = n * V
        if numel > _WORKSPACE_MAX_ELEMS:
            return torch.empty(n, V, dtype=dtype)
        buf = self.bufs.get((name, dtype))
        if buf is None or buf.numel() < numel:
            cap = V * min(1 << max(n - 1, 0).bit_length(), max(_WORKSPACE_MAX_ELEMS // V, n))
            buf = self.bufs[(name, dtype)] = torch.empty(cap, dtype=dtype)
        return buf[:numel].view(n, V)


_WS = _Workspace()


def _rows_of(x: torch.Tensor, idx: list[int], name: str) -> torch.Tensor:
    """``x[idx]``: a view when ``idx`` is a run of consecutive rows, else a copy into a workspace buffer."""
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return x[idx[0]:idx[0] + len(idx)]
    out = _WS.get(name, len(idx), x.shape[1], x.dtype)
    torch.index_select(x, 0, torch.tensor(idx), out=out)
    return out


def _draw_plain_fast(w: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """``_draw(w, None, rows)`` in place on ``w`` (the caller's scratch rows): exp, cumsum, lookup."""
    w.exp_()
    w.cumsum_(dim=1)
    return _inverse_cdf(w, rows, w[:, -1:])


def _count(a: np.ndarray, op, floor: np.ndarray) -> torch.Tensor:
    """Per row i, how many entries e of ``a[i]`` have ``op(e, floor[i])`` (row by row: no [b, V] temporary; the
    reference's ``Tensor.sum`` of a bool tensor first widens it to a fresh int64 one)."""
    return torch.tensor([int(np.count_nonzero(op(r, f))) for r, f in zip(a, floor.tolist())])


def _sort_bf16_values(y: torch.Tensor) -> None:
    """Sort the rows of a float32 [b, V] tensor whose values are all bfloat16 values (low 16 bits zero), ascending,
    in place: a radix sort (numpy's stable sort of int16) of order keys made from the high halves h (sign-extended:
    ``h ^ ((h >> 15) & 0x7FFF)`` turns sign-magnitude into two's complement order, and is its own inverse). NaN-free
    rows only."""
    b, V = y.shape
    bits = y.view(torch.int32)
    h = _WS.get("h32", b, V, torch.int32)
    key = _WS.get("key16", b, V, torch.int16)
    torch.bitwise_right_shift(bits, 16, out=h)  # the high half, sign-extended
    bits.bitwise_right_shift_(31).bitwise_and_(0x7FFF)  # y's memory as scratch from here on
    key.copy_(h.bitwise_xor_(bits))
    key.numpy().sort(axis=1, kind="stable")
    h.copy_(key)
    torch.bitwise_right_shift(h, 31, out=bits)
    h.bitwise_xor_(bits.bitwise_and_(0x7FFF))
    torch.bitwise_left_shift(h, 16, out=bits)


def _draw_filtered_fast(x: torch.Tensor, mx: torch.Tensor, temp: torch.Tensor, rows: list[SampleRow],
                        exact32: bool, exact16: bool = False) -> torch.Tensor:
    """Token ids of ``_filtered_sorted`` + ``_draw`` + ``sid.gather`` on the log-weights ``w = (x − mx) / T`` of
    the rows ``x`` [b, V] (sanitized, processed), the same bits without the full stable sort of ``w``:

    * the reference's K (the most tokens any row can keep) is computed the same way; below V / 4 the reference
      itself runs on ``topk``'s values only (``ids=False``: the values are the stable sort's first K whichever
      tied ids ``topk`` returns, and the draw's position is a function of the values), the id as below;
    * else the *values* of the stable descending sort of ``w`` are the sorted ``x`` mapped by ``(x − mx) / T``
      (monotone: rounding is monotone, T > 0), so ``x`` is sorted instead, as float32 when every value is a float32
      (``exact32``: unprocessed fp32 / bf16 / fp16 logits; bf16 ones, ``exact16``, by a radix sort of their 16
      bits), as float64 otherwise, by numpy, values only (as −x ascending; ``(−x + mx) / −T`` is ``(x − mx) / T`` bit for bit, rounding being symmetric). Equal values (±0
      included) have equal weights, so everything summed over the sorted values (the kept mass, the cumulative
      sums, the draw's position) is the reference's, computed by the same ops on the same layout;
    * one cumulative sum serves top-p and the draw: ``cumsum`` is sequential (its prefix does not depend on what
      follows), and the draw's target lies below the kept mass, so the first entry above it is the same whether
      the entries after the kept ones are zeroed (the reference) or not;
    * the token at the drawn position ``j`` is the one the stable sort puts there: among the ids with ``w`` equal
      to the value ``v`` at ``j``, in id order, number ``j − #{w > v}`` (``#{w > v}``: where ``v`` starts in the
      sorted values)."""
    b, V = x.shape
    w = _WS.get("wf", b, V)
    torch.sub(x, mx[:, None], out=w)
    w.div_(temp[:, None])
    wn = w.numpy()
    # the reference's K (``_filtered_sorted``); lmax = max w is ±0 ((mx − mx) / T), so floors need no lmax
    k = torch.tensor([min(r.params.top_k, V) if r.params.top_k > 0 else V for r in rows])
    min_p = [r.params.min_p for r in rows]
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float64)
    if any(m > 0 for m in min_p):  # log(min_p) + lmax
        floor_m = torch.log(torch.tensor(min_p, dtype=torch.float64)[:, None])[:, 0].numpy()
        n1 = torch.minimum(k, _count(wn, operator.ge, floor_m)).clamp(min=1)
    else:  # floor −inf: every (non-NaN) entry counts
        n1 = torch.minimum(k, torch.tensor(V)).clamp(min=1)
    cand = n1
    sub_p = bool((top_p < 1).any())
    if sub_p:  # lmax + log1p(−top_p) − log V
        floor_p = (torch.log1p(-top_p)[:, None] - math.log(V))[:, 0].numpy()
        cand = torch.minimum(cand, _count(wn, operator.gt, floor_p).clamp(min=1))
    if int(cand.max()) * 4 < V:
        slp, _, keep_n = _filtered_sorted(w, rows, ids=False)
        return _stable_ids(wn, slp.numpy(), _draw(slp, keep_n, rows).tolist())
    # the sorted values: −x ascending (sorted in place), mapped to w
    y = _WS.get("sortx", b, V, torch.float32 if exact32 else torch.float64)
    y.copy_(x).neg_()
    if exact16:
        _sort_bf16_values(y)
    else:
        y.numpy().sort(axis=1)
    slp = _WS.get("slp", b, V)
    slp.copy_(y).add_(mx[:, None]).div_(-temp[:, None])  # (copy first: a float32 + float64 add makes a temporary)
    e = _WS.get("exp", b, V)
    torch.exp(slp, out=e)  # exp(slp − lmax) = exp(slp): lmax is ±0
    p = e
    if bool((n1 < V).any()):
        p = _WS.get("masked", b, V)
        p.copy_(e).masked_fill_(torch.arange(V)[None, :] >= n1[:, None], 0.0)
    keep_n = n1
    cdf = _WS.get("cdf", b, V)
    torch.cumsum(p, dim=1, out=cdf)
    if sub_p:
        z = p.sum(dim=1)  # _kept_mass: n1 <= K = V, so the sorted columns hold all of it
        before = _WS.get("before", b, V)
        torch.sub(cdf, p, out=before)
        thr = (top_p[:, None] * z[:, None])[:, 0].numpy()
        keep_n = torch.minimum(keep_n, _count(before.numpy(), operator.lt, thr).clamp(min=1))
    # _draw(slp, keep_n): total = the cumulative sum at the last kept entry
    at = _inverse_cdf(cdf, rows, cdf.gather(1, (keep_n - 1)[:, None])).tolist()
    return _stable_ids(wn, slp.numpy(), at)


def _stable_ids(wn: np.ndarray, sn: np.ndarray, at: list[int]) -> torch.Tensor:
    """The ids the stable descending sort of the rows ``wn`` puts at positions ``at``, given the sorted values ``sn``
    (at least up to those positions): among the ids of value ``v = sn[i, j]``, in id order, number ``j − #{w > v}``
    (``#{w > v}``: where ``v`` starts in the sorted values)."""
    out = []
    for i, j in enumerate(at):
        v = sn[i, j]
        start = bisect.bisect_left(sn[i], -v, 0, j + 1, key=operator.neg)  # first sorted entry <= v
        out.append(int(np.flatnonzero(wn[i] == v)[j - start]))
    return torch.tensor(out)


def _sample_fast(logits: torch.Tensor, rows: list[SampleRow], eos_token_id: int | None) -> SampleOutput:
    """``_sample_reference``'s tokens, logprobs and errors, in reused scratch buffers and in place (see
    ``_draw_filtered_fast`` for the filtered rows)."""
    B, V = logits.shape
    raw = _WS.get("raw", B, V)
    raw.copy_(logits.detach())
    x = raw
    if any(r.params.logprobs is not None for r in rows):
        x = _WS.get("x", B, V)  # the logprobs read the raw logits
        x.copy_(raw)
    x = process_logits(x, rows, eos_token_id)
    # sanitize, in place (max propagates NaN: a row without NaN has none to replace)
    mx = x.max(dim=1).values
    if bool(mx.isnan().any()):
        x.nan_to_num_(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
        mx = x.max(dim=1).values
    mx = _only_posinf(x, mx)
    ok = torch.isfinite(mx).tolist()
    tokens = [0] * B
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy and ok[i]]
    in_sampled = set(sampled)
    rest = [i for i in range(B) if i not in in_sampled]  # greedy (and failed: a placeholder) rows: argmax
    if rest:
        for i, t in zip(rest, torch.argmax(_rows_of(x, rest, "rest"), dim=1).tolist()):
            tokens[i] = t
    filt = [i for i in sampled if rows[i].params.top_k > 0 or rows[i].params.top_p < 1 or rows[i].params.min_p > 0]
    in_filt = set(filt)
    plain = [i for i in sampled if i not in in_filt]
    if filt:  # before the plain rows: those may be worked on in place in x
        xf = _rows_of(x, filt, "xf")
        unprocessed = not any(rows[i].params.processes_logits or rows[i].allowed is not None for i in filt)
        exact32 = unprocessed and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
        exact16 = unprocessed and logits.dtype == torch.bfloat16 and sys.byteorder == "little"
        temp = torch.tensor([rows[i].params.temperature for i in filt], dtype=torch.float64)
        got = _draw_filtered_fast(xf, mx[filt], temp, [rows[i] for i in filt], exact32, exact16)
        for i, t in zip(filt, got.tolist()):
            tokens[i] = t
    if plain:
        w = _rows_of(x, plain, "wp")
        temp = torch.tensor([rows[i].params.temperature for i in plain], dtype=torch.float64)
        w.sub_(mx[plain][:, None]).div_(temp[:, None])
        for i, t in zip(plain, _draw_plain_fast(w, [rows[i] for i in plain]).tolist()):
            tokens[i] = t
    errors = [None if ok[i] else "no token has a finite logit (the model produced NaN or every token was "
                                 "masked)" for i in range(B)]
    return SampleOutput(tokens, _logprobs(raw, tokens, rows), errors)


def _sample_reference(logits: torch.Tensor, rows: list[SampleRow], eos_token_id: int | None = None) -> SampleOutput:
    """The plain implementation (float64 copies, a full stable sort): ``sample``'s contract, which the fast path
    reproduces bit for bit (tests/grserve/engine/test_sampling.py compares them)."""
    raw = logits.detach().to(torch.float64)
    x = raw
    if any(r.params.processes_logits or r.allowed is not None for r in rows) and (
            raw.data_ptr() == logits.data_ptr() or any(r.params.logprobs is not None for r in rows)):
        x = raw.clone()  # processing works in place: keep the caller's logits, and the raw ones for logprobs
    x = process_logits(x, rows, eos_token_id)
    tokens, errors = choose(x, rows)
    return SampleOutput(tokens, _logprobs(raw, tokens, rows), errors)


def sample(logits: torch.Tensor, rows: list[SampleRow], eos_token_id: int | None = None,
           reference: bool = False) -> SampleOutput:
    """logits [B, V] (one row per request, any float dtype) → one token per row (+ logprobs, per-row errors).
    ``reference=True`` runs the plain implementation (``_sample_reference``); the default fast path returns the
    same token ids, logprobs and errors (CPU tensors; other devices run the reference)."""
    if reference or logits.device.type != "cpu" or not rows or logits.shape[1] == 0:
        return _sample_reference(logits, rows, eos_token_id)
    return _sample_fast(logits, rows, eos_token_id)
