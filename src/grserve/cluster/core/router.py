"""The front end's router (xLLM §3.4 "KV-cache-aware scheduling"): one request → one instance.

The router takes a request as the layer above sent it — an LLM ``Attempt`` (its prompt: the prompt plus, for a
resumed request, the tokens delivered so far; its ``max_tokens``), a ``RetrievalRequest`` (its history's SID
tokens) or a ``RankingRequest`` (its user's and candidates' tokens, its user id) — and reads what the cost needs:
the tokens to compute, the tokens it will generate, and the KV an instance may already hold for it.

Every policy is the same router with a different cost; the load it uses is what the router itself booked at
decision time (so two requests routed in the same millisecond see each other), released as the request moves on:

- ``kv`` (KV-aware): cost(i) = queued prefill tokens(i) + the request's tokens − ``cache_weight`` · its tokens
  cached on i + ``decode_weight`` · decode tokens running on i (``cache_weight`` 1: the tokens i would compute; > 1
  favours keeping a conversation where its KV is over balancing). "Cached on i": for an LLM prompt, the longest
  common block prefix of its block keys in the global KV index, each block weighted by its tier
  (``tier_weights``: a block in a slower tier saves less); for a ranking request, its user's profile tokens where
  the index holds the user's KV (``user_key``); for a retrieval request, as for an LLM prompt, the longest common
  block prefix of its prompt's block keys (the instances' prompt-prefix caches, ``kvcache/prefix_blocks.py``, publish
  their blocks; without ``--prefix-cache-tokens`` the index holds none and the cost is load alone).
  Argmin; ties → fewer requests booked, then the lowest index.
- ``least_loaded``: the same cost without the cache term.
- ``round_robin``: the next live instance in turn.

Booked load per instance: ``prefill_tokens`` (uncached tokens of requests not past their first token),
``decode_tokens`` (tokens still to generate of requests past it), ``requests``. Decisions are counted by reason:
``prefix`` (the chosen instance had a cached prefix), ``load`` (no cached prefix anywhere counted: the least
loaded), ``round_robin``, and ``recovery`` (a request moved off a dead instance).
"""

from __future__ import annotations

import threading
from collections.abc import Collection

import numpy as np
from dataclasses import dataclass

from grserve.cluster.core.kv_index import GlobalKVIndex, user_key
from grserve.cluster.wire import Attempt, Tier
from grserve.config import ROUTING_POLICIES  # "kv", "least_loaded", "round_robin"
from grserve.engine.types import RankingRequest, RetrievalRequest
from grserve.kvcache.block_hash import chained_block_hashes

Routable = Attempt | RetrievalRequest | RankingRequest
DEFAULT_TIER_WEIGHTS: dict[Tier, float] = {"hbm": 1.0, "dram": 0.9, "ssd": 0.5}


@dataclass
class InstanceLoad:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    requests: int = 0


@dataclass
class _Booking:
    instance: int
    prefill: int
    decode: int
    past_prefill: bool = False


@dataclass(frozen=True)
class Decision:
    instance: int
    reason: str
    cached_tokens: int  # prompt tokens the index says are cached there (all tiers)
    cost: float


class NoInstance(RuntimeError):
    """No live instance to route to."""


class Router:
    def __init__(self, num_instances: int, policy: str = "kv", *, block_size: int = 16,
                 index: GlobalKVIndex | None = None, decode_weight: float = 0.1, cache_weight: float = 1.0,
                 tier_weights: dict[Tier, float] | None = None):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}")
        self.policy = policy
        self.block_size = block_size
        self.index = index if index is not None else GlobalKVIndex()
        self.decode_weight = decode_weight
        self.cache_weight = cache_weight
        self.tier_weights = dict(DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights)
        self.load = [InstanceLoad() for _ in range(num_instances)]
        self.up = [True] * num_instances
        self._book: dict[str, _Booking] = {}
        self._rr = 0
        self._lock = threading.Lock()
        self.decisions: dict[str, int] = {"prefix": 0, "load": 0, "round_robin": 0, "recovery": 0}
        self.routed = [0] * num_instances
        self.cached_tokens_routed = 0  # Σ tokens the index promised at the chosen instances

    # ---- instance state -------------------------------------------------------------------------------------
    def mark_down(self, instance: int) -> None:
        with self._lock:
            self.up[instance] = False

    def mark_up(self, instance: int) -> None:
        with self._lock:
            self.up[instance] = True
            self.load[instance] = InstanceLoad()

    def live(self) -> list[int]:
        return [i for i, u in enumerate(self.up) if u]

    # ---- the decision -----------------------------------------------------------------------------------------
    def costs(self, request: Routable, exclude: Collection[int] = ()) -> dict[int, tuple[float, int]]:
        """Cost and cached tokens of every live instance (not in ``exclude``) for ``request``."""
        live = [i for i in self.live() if i not in exclude]
        n, _ = size(request)
        cached, raw = self._cached(request, live)
        out = {}
        for i in live:
            ld = self.load[i]
            out[i] = (ld.prefill_tokens + (n - self.cache_weight * cached[i]) + self.decode_weight * ld.decode_tokens,
                      raw[i])
        return out

    def _cached(self, request: Routable, live: list[int]) -> tuple[dict[int, float], dict[int, int]]:
        """Per live instance: the request's tokens cached there, weighted by tier and raw (``kv`` policy only)."""
        cached = {i: 0.0 for i in live}
        raw = {i: 0 for i in live}
        if self.policy != "kv":
            return cached, raw
        if isinstance(request, RankingRequest):
            if request.user_id is not None:  # the user's KV in an instance's BAT user cache: its profile tokens
                held = self.index.prefix_match([user_key(request.user_id)], live)
                for i in live:
                    raw[i] = len(request.user_tokens) if held[i] else 0
                    cached[i] = float(raw[i])
        elif isinstance(request, (Attempt, RetrievalRequest)) and _prompt(request).size > 1:
            prompt = _prompt(request)
            keys = chained_block_hashes(prompt[:len(prompt) - 1], self.block_size)  # the last token is computed
            for i, tiers in self.index.prefix_match(keys, live).items():
                raw[i] = sum(tiers.values()) * self.block_size
                cached[i] = sum(c * self.block_size * self.tier_weights.get(t, 0.0) for t, c in tiers.items())
        return cached, raw

    def route(self, request: Routable, exclude: Collection[int] = (), recovery: bool = False) -> Decision:
        """Choose an instance for ``request`` and book its load there (under its ``request_id``)."""
        with self._lock:
            live = [i for i in self.live() if i not in exclude]
            if not live:
                raise NoInstance("no live instance")
            costs = self.costs(request, exclude)
            if self.policy == "round_robin":
                order = sorted(live, key=lambda i: (i - self._rr) % len(self.up))
                best = order[0]
                self._rr = (best + 1) % len(self.up)
                reason = "round_robin"
            else:
                best = min(live, key=lambda i: (costs[i][0], self.load[i].requests, i))
                reason = "prefix" if costs[best][1] > 0 else "load"
            if recovery:
                reason = "recovery"
            cost, cached = costs[best]
            n, decode = size(request)
            prefill = max(1, n - cached)
            self._book[request.request_id] = _Booking(best, prefill, decode)
            ld = self.load[best]
            ld.prefill_tokens += prefill
            ld.requests += 1
            self.decisions[reason] += 1
            self.routed[best] += 1
            self.cached_tokens_routed += cached
            return Decision(best, reason, cached, cost)

    def book(self, request_id: str, instance: int, prefill: int, decode: int) -> None:
        """Book a request on an instance chosen elsewhere (PD: ``cluster/llm/pd_disagg.py`` picks by role)."""
        with self._lock:
            self._book[request_id] = _Booking(instance, prefill, decode)
            ld = self.load[instance]
            ld.prefill_tokens += prefill
            ld.requests += 1
            self.routed[instance] += 1

    def decode_requests(self) -> list[int]:
        """Per instance: booked requests past their first token (PD role monitor)."""
        with self._lock:
            out = [0] * len(self.load)
            for b in self._book.values():
                out[b.instance] += b.past_prefill
            return out

    # ---- the request moves on ----------------------------------------------------------------------------------
    def on_tokens(self, request_id: str, n: int) -> None:
        """``n`` tokens of the request arrived: its prefill is done (first token), its decode shrinks."""
        with self._lock:
            b = self._book.get(request_id)
            if b is None or n <= 0:
                return
            ld = self.load[b.instance]
            if not b.past_prefill:
                b.past_prefill = True
                ld.prefill_tokens -= b.prefill
                ld.decode_tokens += b.decode
            d = min(n, b.decode)
            b.decode -= d
            ld.decode_tokens -= d

    def release(self, request_id: str) -> None:
        """The request finished, failed, moved or was cancelled: its booking goes."""
        with self._lock:
            b = self._book.pop(request_id, None)
            if b is None:
                return
            ld = self.load[b.instance]
            if b.past_prefill:
                ld.decode_tokens -= b.decode
            else:
                ld.prefill_tokens -= b.prefill
            ld.requests -= 1


def size(request: Routable) -> tuple[int, int]:
    """(tokens to compute without a cache, tokens it will generate) of a request."""
    if isinstance(request, Attempt):
        return len(request.tokens), request.max_new_tokens
    return max(1, request.num_tokens), 0  # retrieval / ranking: one step, nothing to decode


def _prompt(request: Attempt | RetrievalRequest) -> np.ndarray:
    """The token ids whose prefix an instance may hold: an attempt's tokens, a retrieval request's prompt."""
    tokens = request.tokens if isinstance(request, Attempt) else request.prompt_tokens
    return np.asarray(tokens)
