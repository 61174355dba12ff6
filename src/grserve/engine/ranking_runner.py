"""The BAT ranking runner: per-request prefix choice, one packed prefill per batch, user/item KV caches.

scheduler (a ``PrefixPolicy``: which side is the cached prefix) → this engine (gathers cached KV, packs the
computed tokens of a batch into one forward through ``BipartiteBatchContext``, scores, writes caches back) →
results. The policy sees only sizes and cache/hotness state (``PrefixQuery``); it never touches tensors.

Per request (``RankingRunner.run``):

1. the cache meta service records the access (hotness) and returns the user's predicted frequency f_u;
2. the policy picks user-as-prefix (UP) or item-as-prefix (IP) and whether to read/admit the user's KV;
3. UP: the user's KV comes from the user cache on a hit (items + instruction computed); on a miss everything is
   computed and the user KV is admitted if the policy says so. IP: the candidates' KV comes from the item
   source (local pool or HRCS KV-cache workers); items it lacks are computed inline and written back to a local
   pool; the user and instruction are computed. Recompute computes the whole UP prompt.
4. one forward over the packed computed tokens of the batch; each request's last token → identifier-token
   softmax → top-k.

A cached token is never recomputed: ``computed_tokens`` counts exactly the tokens that entered the forward.
Batches run one at a time (``engine/ranking_engine.py`` gives the runner one executor thread): cache decisions and
writes are sequential, so each request sees the cache state left by the previous batch (on 2 CPU cores one forward
already uses every core).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from grserve.config import RankingConfig
from grserve.attention.bipartite import BipartiteBatchContext, BipartiteRequest
from grserve.engine.types import RankingRequest, RankingResult
from grserve.kvcache.item_pool import ItemKVPool, ItemKVSource
from grserve.kvcache.meta import CacheMetaService
from grserve.kvcache.paged import PagedKVStore
from grserve.kvcache.user_cache import UserKVCache
from grserve.model import Decoder
from grserve.ranking.layouts import ITEM_PREFIX, USER_PREFIX, BipartitePrompt, build_prompt
from grserve.ranking.registry import RankingRegistry
from grserve.ranking.scoring import full_vocab_lse, score_candidates
from grserve.scheduler.prefix_choice import PrefixDecision, PrefixPolicy, PrefixQuery, make_policy


@dataclass
class RankingStats:
    requests: int = 0
    batches: int = 0
    total_tokens: int = 0  # prompt tokens of every request (instruction included)
    computed_tokens: int = 0  # tokens that entered a forward
    cached_user_tokens: int = 0
    cached_item_tokens: int = 0
    up_requests: int = 0
    ip_requests: int = 0
    user_lookups: int = 0  # UP requests of a policy with a user cache
    user_hits: int = 0
    ip_item_tokens: int = 0  # candidate tokens of IP requests
    user_admissions: int = 0
    user_admission_failures: int = 0
    user_evictions: int = 0
    items_written_back: int = 0
    item_fetch_s: float = 0.0  # reading cached item KV from the item source (a cluster's: the KV-cache workers)
    forward_s: float = 0.0
    busy_s: float = 0.0

    @property
    def cached_tokens(self) -> int:
        return self.cached_user_tokens + self.cached_item_tokens

    def summary(self) -> dict:
        d = asdict(self)
        tot = max(self.total_tokens, 1)
        d.update(
            cached_tokens=self.cached_tokens,
            cached_token_fraction=self.cached_tokens / tot,
            computed_token_fraction=self.computed_tokens / tot,
            user_hit_rate=self.user_hits / self.user_lookups if self.user_lookups else 0.0,
            item_hit_rate=self.cached_item_tokens / self.ip_item_tokens if self.ip_item_tokens else 0.0,
            up_share=self.up_requests / max(self.requests, 1),
        )
        return d


def _kv_store(model: Decoder, capacity_bytes: int, page_size: int) -> PagedKVStore:
    s = model.spec
    return PagedKVStore.with_capacity_bytes(capacity_bytes, s.num_hidden_layers, s.num_key_value_heads,
                                            s.head_dim, page_size=page_size, dtype=model.dtype, device=model.device)


@torch.no_grad()
def precompute_item_kv(model: Decoder, items: Sequence[tuple[int, np.ndarray]],
                       put: Callable[[int, torch.Tensor], object],
                       notation: np.ndarray | None = None, notation_kv: torch.Tensor | None = None,
                       batch_tokens: int = 8192, progress: bool = False) -> int:
    """Compute every item's KV alone (IP positions, after the notation) and hand it to ``put(item_id, kv)``.

    Items are packed into item-as-prefix prompts with a one-token dummy tail; each item's K/V inside such a
    prompt equal the item computed alone (tested), so the pool entry is the same whatever else was packed.
    """
    head = np.zeros(0, dtype=np.int64) if notation is None else np.asarray(notation, dtype=np.int64)
    chunks: list[list[tuple[int, np.ndarray]]] = [[]]
    n = 0
    for iid, toks in items:
        if chunks[-1] and n + len(toks) > batch_tokens:
            chunks.append([])
            n = 0
        chunks[-1].append((iid, toks))
        n += len(toks)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc="item KV pool", unit="item", leave=False)
    done = 0
    for chunk in chunks:
        if not chunk:
            continue
        prompt = BipartitePrompt(ITEM_PREFIX, head, tuple(t for _, t in chunk), np.zeros(1, dtype=np.int64))
        ctx = BipartiteBatchContext([BipartiteRequest(prompt, head_kv=notation_kv if len(head) else None)],
                                    device=model.device)
        model.forward(ctx.input_ids, ctx.positions, ctx)
        for i, (iid, _) in enumerate(chunk):
            put(iid, ctx.item_kv(0, i))
        done += len(chunk)
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return done


class RankingRunner:
    """Executes batches of ranking requests with one prefix policy and its caches (no threads)."""

    def __init__(self, model: Decoder, registry: RankingRegistry, cfg: RankingConfig | None = None,
                 item_source: ItemKVSource | None = None, meta: CacheMetaService | None = None,
                 policy: PrefixPolicy | None = None, progress: bool = False):
        self.model = model
        self.registry = registry
        self.cfg = cfg = cfg or RankingConfig()
        self.policy = policy or make_policy(cfg.policy, **({"item_tokens": cfg.bat_item_tokens}
                                                          if cfg.policy == "bat" else {}))
        self.meta = meta or CacheMetaService(cfg.user_window_s, cfg.item_window_s)
        self.instruction = registry.instruction
        self.notation = registry.notation
        self._lock = threading.RLock()
        self.stats = RankingStats()
        self._bytes_per_token = model.spec.kv_bytes_per_token(torch.empty(0, dtype=model.dtype).element_size())
        # the fixed IP head (notation tokens) is computed once and always read from cache
        self.notation_kv: torch.Tensor | None = None
        if len(self.notation):
            with torch.no_grad():
                p = BipartitePrompt(ITEM_PREFIX, self.notation, (np.zeros(1, dtype=np.int64),),
                                    np.zeros(1, dtype=np.int64))
                ctx = BipartiteBatchContext([BipartiteRequest(p)], device=model.device)
                model.forward(ctx.input_ids, ctx.positions, ctx)
                self.notation_kv = ctx.head_kv(0)
        # user cache
        self.user_cache: UserKVCache | None = None
        if self.policy.user_replacement is not None:
            freq = (lambda users: self.meta.user_frequencies(users, self._now)) \
                if self.policy.user_replacement == "frequency" else None
            self.user_cache = UserKVCache(_kv_store(model, cfg.user_cache_bytes, cfg.page_size),
                                          self.policy.user_replacement, freq)
        # item KV: an external source (cluster) or a local pool precomputed for the whole catalog
        self.item_pool: ItemKVPool | None = None
        self.item_source: ItemKVSource | None = None
        if self.policy.uses_item_cache:
            if item_source is not None:
                self.item_source = item_source
            else:
                ids = registry.item_ids()
                cap = cfg.item_pool_bytes
                if cap is None:
                    pages = sum(-(-len(registry.item_tokens(i)) // cfg.page_size) for i in ids)
                    cap = int((pages * (1 + cfg.item_pool_headroom) + 1) * cfg.page_size * self._bytes_per_token)
                self.item_pool = ItemKVPool(_kv_store(model, cap, cfg.page_size))
                precompute_item_kv(model, [(i, registry.item_tokens(i)) for i in ids], self.item_pool.put,
                                   self.notation, self.notation_kv, cfg.precompute_batch_tokens, progress)
                self.item_source = self.item_pool
        self._now = 0.0
        registry.on_change(self._invalidate)

    # ---- cache maintenance --------------------------------------------------------------------------------
    def _invalidate(self, kind: str, key: int) -> None:
        with self._lock:
            if kind == "user" and self.user_cache is not None:
                self.user_cache.remove(key)
            elif kind == "item" and self.item_pool is not None:
                self.item_pool.remove(key)
                self.add_items([key])
            elif kind == "item" and hasattr(self.item_source, "forget"):  # the cluster's: computed inline until
                self.item_source.forget(key)  # the front end has its new KV computed into the KV-cache workers

    def add_items(self, item_ids: Sequence[int]) -> int:
        """Precompute and store the KV of newly registered (or changed) items in the local pool."""
        if self.item_pool is None:
            return 0
        with self._lock:
            return precompute_item_kv(self.model, [(i, self.registry.item_tokens(i)) for i in item_ids],
                                      self.item_pool.put, self.notation, self.notation_kv,
                                      self.cfg.precompute_batch_tokens)

    @property
    def kv_bytes_per_token(self) -> int:
        return self._bytes_per_token

    # ---- one batch ----------------------------------------------------------------------------------------
    def _decide(self, req: RankingRequest, f_u: float) -> PrefixDecision:
        n_u = len(req.user_tokens)
        item_lens = [len(t) for t in req.item_tokens]
        cached_items = 0
        if self.item_source is not None and req.item_ids is not None:
            known = [i for i in req.item_ids if i is not None]
            flags = iter(self.item_source.has(known))
            cached_items = sum(n for i, n in zip(req.item_ids, item_lens) if i is not None and next(flags))
        uc = self.user_cache
        cacheable = uc is not None and req.user_id is not None and uc.fits_at_all(n_u)
        cached = cacheable and req.user_id in uc
        q = PrefixQuery(
            user_tokens=n_u, item_tokens=sum(item_lens), cached_item_tokens=cached_items,
            cacheable_user=cacheable, user_cached=cached, user_frequency=f_u,
            min_cached_frequency=uc.min_frequency() if uc is not None and uc.replacement == "frequency"
            else float("inf"),
            user_fits_free=cacheable and uc.fits_free(n_u),
            user_evictable=cacheable and uc.plan_admission(n_u, f_u) is not None,
        )
        return self.policy.choose(q)

    def _write_back(self, req: RankingRequest, plan: BipartiteRequest, d: PrefixDecision,
                    ctx: BipartiteBatchContext, r: int, hit: bool, f_u: float) -> None:
        """Cache writes after the forward: admit the user's KV (UP) or store items computed inline (IP)."""
        st, p = self.stats, plan.prompt
        if d.layout == USER_PREFIX and d.admit_user and not hit and self.user_cache is not None:
            victims = self.user_cache.plan_admission(len(p.head), f_u)
            if victims is not None:
                ok = self.user_cache.admit(req.user_id, ctx.head_kv(r), victims)
                st.user_admissions += ok
                st.user_admission_failures += not ok
                st.user_evictions += len(victims) if ok else 0
            else:
                st.user_admission_failures += 1
        if d.layout == ITEM_PREFIX and self.item_pool is not None and self.cfg.write_back_items \
                and req.item_ids is not None:
            for k, x in enumerate(plan.item_kv):
                iid = req.item_ids[k]
                if x is None and iid is not None and self.item_pool.put(iid, ctx.item_kv(r, k)):
                    st.items_written_back += 1

    @torch.no_grad()
    def run(self, requests: Sequence[RankingRequest]) -> list[RankingResult]:
        with self._lock:
            return self._run(requests)

    def _run(self, requests: Sequence[RankingRequest]) -> list[RankingResult]:
        t0 = time.perf_counter()
        plans: list[BipartiteRequest] = []
        decisions: list[PrefixDecision] = []
        freqs: list[float] = []
        hits: list[bool] = []
        for req in requests:
            self._now = req.now if req.now is not None else time.time()
            ids = [i for i in (req.item_ids or []) if i is not None]
            f_u = self.meta.record_request(req.user_id, ids, self._now)
            d = self._decide(req, f_u)
            prompt = build_prompt(d.layout, req.user_tokens, req.item_tokens, self.instruction, self.notation)
            head_kv = None
            item_kv: list = [None] * len(req.item_tokens)
            cached_items_kv = None
            hit = False
            if d.layout == USER_PREFIX and d.read_user_cache and self.user_cache is not None:
                head_kv = self.user_cache.get(req.user_id)
                hit = head_kv is not None
            if d.layout == ITEM_PREFIX:
                head_kv = self.notation_kv
                if d.read_item_cache and self.item_source is not None and req.item_ids is not None:
                    pos = [k for k, i in enumerate(req.item_ids) if i is not None]
                    tf = time.perf_counter()
                    kv, flags = self.item_source.fetch([req.item_ids[k] for k in pos])
                    self.stats.item_fetch_s += time.perf_counter() - tf
                    if any(flags):
                        cached_items_kv = kv
                        for k, f in zip(pos, flags):
                            if f:
                                item_kv[k] = True
            plans.append(BipartiteRequest(prompt, head_kv, item_kv, cached_items_kv))
            decisions.append(d)
            freqs.append(f_u)
            hits.append(hit)
        ctx = BipartiteBatchContext(plans, device=self.model.device)
        tf = time.perf_counter()
        hidden = self.model.forward(ctx.input_ids, ctx.positions, ctx)
        forward_s = time.perf_counter() - tf
        last = hidden[torch.tensor([ctx.last_index(r) for r in range(len(plans))], device=hidden.device)]
        w = self.model.lm_head.weight
        lse = full_vocab_lse(last, w)  # per request: log-probabilities comparable across requests
        done = time.perf_counter()
        results = []
        st = self.stats
        for r, (req, plan, d) in enumerate(zip(requests, plans, decisions)):
            p = plan.prompt
            ident = torch.from_numpy(p.identifier_tokens).to(w.device)
            ranked = score_candidates(last[r], w, ident, req.top_k, lse[r])
            cached_user = len(p.head) if (d.layout == USER_PREFIX and plan.head_kv is not None) else 0
            cached_item = sum(len(p.items[k]) for k, x in enumerate(plan.item_kv) if x is not None)
            total = p.num_tokens - (len(p.head) if d.layout == ITEM_PREFIX else 0)  # notation is not request data
            computed = total - cached_user - cached_item
            self._write_back(req, plan, d, ctx, r, hits[r], freqs[r])
            # stats
            st.requests += 1
            st.total_tokens += total
            st.computed_tokens += computed
            st.cached_user_tokens += cached_user
            st.cached_item_tokens += cached_item
            if d.layout == USER_PREFIX:
                st.up_requests += 1
                if self.user_cache is not None and req.user_id is not None:
                    st.user_lookups += 1
                    st.user_hits += hits[r]
            else:
                st.ip_requests += 1
                st.ip_item_tokens += sum(p.item_lengths)
            results.append(RankingResult(
                request_id=req.request_id, order=ranked.order, scores=ranked.scores, layout=d.layout,
                total_tokens=total, computed_tokens=computed, cached_tokens=cached_user + cached_item,
                user_cache_hit=hits[r], queue_ms=(t0 - req.arrival) * 1e3, compute_ms=(done - t0) * 1e3,
                batch_size=len(requests), logprobs=ranked.logprobs or []))
        st.batches += 1
        st.forward_s += forward_s
        st.busy_s += time.perf_counter() - t0
        return results
