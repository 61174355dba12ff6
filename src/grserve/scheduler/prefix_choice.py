"""Prefix-choice policies (BAT §5.3): which side of a ranking request is the cached prefix.

Every policy answers one ``PrefixQuery`` (sizes, cache state, hotness; no tensors) with a ``PrefixDecision``.
Policies are chosen by name (``PREFIX_POLICIES``, ``make_policy``; aliases up, ip, greedy, re); the baselines are
policies too, so every comparison runs in the same engine:

| name          | layout                                   | user cache                      | item cache |
|---------------|------------------------------------------|---------------------------------|------------|
| ``bat``       | hotness-aware rule below                 | frequency replacement, admission| yes        |
| ``user_prefix`` (UP-only) | always UP                    | LRU, always admit               | no         |
| ``item_prefix`` (IP-only) | always IP                    | unused                          | yes        |
| ``greedy_size`` (cache-agnostic) | UP iff τ_u ≥ τ_i      | LRU, always admit               | yes        |
| ``recompute`` (RE) | UP, computed in full                | no                              | no         |

BAT's rule as printed:  prefix(r) = user if τ_u ≥ τ_i ∧ f_u > min_{p∈C_u} f_p, else item; with our readings of
the digest's ambiguities 9/10 (docs/ranking.md):

1. τ_u < τ_i → IP (τ_i = the candidates' total tokens; ``item_tokens="cached"`` compares against the cached
   candidates' tokens instead).
2. a user already cached is a hit → UP (the strict ">" would otherwise send the least-frequent cached user to IP);
3. the user fits in free space → UP, admitted (no one is displaced);
4. f_u > min f_p and enough lower-frequency users can be evicted → UP, admitted, evicting lowest f first;
5. otherwise IP. f_u is the *predicted* frequency: the window count **before** this request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from grserve.registry import Registry

USER_PREFIX = "user_prefix"  # same strings as grserve.ranking.layouts (the scheduler sits above ranking)
ITEM_PREFIX = "item_prefix"


@dataclass(frozen=True)
class PrefixQuery:
    user_tokens: int  # τ_u
    item_tokens: int  # τ_i: total tokens of the N candidates
    cached_item_tokens: int  # of τ_i, tokens whose item KV is in the item cache
    cacheable_user: bool  # the user has an id (raw token profiles cannot be cached) and fits the cache at all
    user_cached: bool
    user_frequency: float  # f_u, predicted (window frequency before this request)
    min_cached_frequency: float  # min f_p over cached users (+inf when none)
    user_fits_free: bool  # fits without evicting anyone
    user_evictable: bool  # enough space can be freed under the policy's replacement rule


@dataclass(frozen=True)
class PrefixDecision:
    layout: str  # USER_PREFIX | ITEM_PREFIX
    read_user_cache: bool = False  # UP hit: read the user's KV
    admit_user: bool = False  # UP miss: store the computed user KV (evicting per the replacement rule)
    read_item_cache: bool = False  # IP: read cached item KV

    @property
    def reason(self) -> str:
        return self.layout


class PrefixPolicy(Protocol):
    name: str
    user_replacement: str | None  # "lru" | "frequency" | None (no user cache)
    uses_item_cache: bool

    def choose(self, q: PrefixQuery) -> PrefixDecision: ...


PREFIX_POLICIES: Registry[PrefixPolicy] = Registry("prefix policy")  # each policy class below registers itself

_IP = PrefixDecision(ITEM_PREFIX, read_item_cache=True)


def _up(q: PrefixQuery, admit: bool = True) -> PrefixDecision:
    if q.user_cached:
        return PrefixDecision(USER_PREFIX, read_user_cache=True)
    return PrefixDecision(USER_PREFIX, admit_user=admit and q.cacheable_user and (q.user_fits_free or q.user_evictable))


@PREFIX_POLICIES.register("bat")
class BatPolicy:
    """BAT's hotness-aware prompt scheduler (§5.3)."""

    name = "bat"
    user_replacement = "frequency"
    uses_item_cache = True

    def __init__(self, item_tokens: str = "all"):
        if item_tokens not in ("all", "cached"):
            raise ValueError(f"item_tokens must be 'all' or 'cached', got {item_tokens!r}")
        self.item_tokens = item_tokens

    def choose(self, q: PrefixQuery) -> PrefixDecision:
        tau_i = q.item_tokens if self.item_tokens == "all" else q.cached_item_tokens
        if not q.cacheable_user or q.user_tokens < tau_i:
            return _IP
        if q.user_cached:
            return PrefixDecision(USER_PREFIX, read_user_cache=True)
        if q.user_fits_free:
            return PrefixDecision(USER_PREFIX, admit_user=True)
        if q.user_frequency > q.min_cached_frequency and q.user_evictable:
            return PrefixDecision(USER_PREFIX, admit_user=True)
        return _IP


@PREFIX_POLICIES.register("user_prefix", aliases=("up",))
class UserPrefixPolicy:
    """UP-only: user-as-prefix for every request, LRU user cache (the layout of existing GR systems)."""

    name = "user_prefix"
    user_replacement = "lru"
    uses_item_cache = False

    def choose(self, q: PrefixQuery) -> PrefixDecision:
        return _up(q)


@PREFIX_POLICIES.register("item_prefix", aliases=("ip",))
class ItemPrefixPolicy:
    """IP-only: item-as-prefix for every request."""

    name = "item_prefix"
    user_replacement = None
    uses_item_cache = True

    def choose(self, q: PrefixQuery) -> PrefixDecision:
        return _IP


@PREFIX_POLICIES.register("greedy_size", aliases=("greedy",))
class GreedySizePolicy:
    """Cache-agnostic (BAT §5.3): the larger side is the prefix; LRU user cache."""

    name = "greedy_size"
    user_replacement = "lru"
    uses_item_cache = True

    def choose(self, q: PrefixQuery) -> PrefixDecision:
        if q.cacheable_user and q.user_tokens >= q.item_tokens:
            return _up(q)
        return _IP


@PREFIX_POLICIES.register("recompute", aliases=("re",))
class RecomputePolicy:
    """RE: no prefix caching; the UP prompt is computed in full."""

    name = "recompute"
    user_replacement = None
    uses_item_cache = False

    def choose(self, q: PrefixQuery) -> PrefixDecision:
        return PrefixDecision(USER_PREFIX)


def make_policy(name: str, **kw) -> PrefixPolicy:
    return PREFIX_POLICIES.create(name, **kw)
