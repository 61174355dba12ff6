"""The engines' ``stats()`` on ``/metrics``, read at scrape time, typed as Prometheus means them: a running total is
a counter (``_total``: ``rate()`` works on it and a restart shows as a reset), a current value a gauge. Names follow
vLLM's where vLLM has one (``kv_cache_usage_perc`` is a fraction in [0, 1], as vLLM's).

- LLM (``LLMStatsCollector``): gauges ``grserve_llm_running``, ``_waiting``, ``_free_blocks``,
  ``_kv_cache_usage_perc``, the co-location split (``_running_online`` …) and ``_offline_deferred`` (per step);
  counters ``grserve_llm_preemptions_total``, ``_prefix_hit_tokens_total``, ``_prefill_tokens_total``,
  ``_offline_preemptions_total``, ``_requests_expired_total``, ``_step_errors_total``. With the server's model name
  (``serve llm``), each carries ``model_name`` and vLLM's families are served too: gauges
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``; counters
  ``vllm:num_preemptions_total``, ``vllm:prefix_cache_queries_total`` (prompt tokens looked up: computed + hit)
  and ``vllm:prefix_cache_hits_total`` (tokens).
- Retrieval and ranking (``GRStatsCollector``): counters ``grserve_batches_run_total``,
  ``grserve_batches_failed_total``, ``grserve_requests_expired_total``; ranking adds its caches
  (``grserve_ranking_user_cache_lookups_total`` / ``_hits_total``, ``grserve_ranking_item_kv_tokens_total`` /
  ``_hit_tokens_total``, prompt / computed / cached token totals) and their hit rates since start as gauges. GR
  retrieval with ``--prefix-cache-tokens`` adds its prefix cache: counters ``grserve_retrieval_prompt_tokens_total``,
  ``_prompt_tokens_computed_total``, ``_prompt_tokens_reused_total``, ``_prefix_cache_stored_blocks_total``,
  ``_prefix_cache_evictions_total``, ``_prefix_cache_spills_total``, ``_prefix_cache_gave_way_blocks_total``; gauges
  ``grserve_retrieval_prefix_cache_hit_rate`` and ``grserve_retrieval_prefix_cache_bytes{tier}``.

A key the engine does not report (a cluster front end sums fewer) is left out; a scrape never fails because the
engine is shutting down (the family is left out).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LLM_GAUGES = (  # engine.stats() key → help; exported as grserve_llm_<key>
    ("running", "Requests holding cache blocks."),
    ("waiting", "Requests waiting (new or preempted)."),
    ("free_blocks", "Free blocks in the unified pool."),
    ("offline_deferred", "Offline rows the latency model kept out of a step with online work (per step)."),
    ("running_online", "Online requests holding cache blocks."),
    ("running_offline", "Offline requests holding cache blocks."),
    ("waiting_online", "Online requests waiting."),
    ("waiting_offline", "Offline requests waiting."),
)
LLM_COUNTERS = (  # engine.stats() key → (name, help); exported as grserve_llm_<name>_total
    ("preemptions", "preemptions", "Preemptions (recompute)."),
    ("prefix_hit_tokens", "prefix_hit_tokens", "Prompt tokens copied from the prefix cache instead of computed."),
    ("prefill_tokens", "prefill_tokens", "Prompt tokens computed."),
    ("offline_preemptions", "offline_preemptions", "Preemptions of offline requests (co-location)."),
    ("requests_expired", "requests_expired", "Requests dropped uncomputed at their queue deadline."),
    ("errors", "step_errors", "Engine iterations that raised (their running requests failed)."),
)
GR_COUNTERS = (
    ("batches_run", "batches_run", "Engine batches executed."),
    ("batches_failed", "batches_failed", "Engine batches that failed (their requests failed)."),
    ("requests_expired", "requests_expired", "Requests dropped uncomputed at their queue deadline."),
)
PREFIX_COUNTERS = (  # RetrievalEngine.stats() prefix_* key → (name, help); exported as grserve_retrieval_<name>_total
    ("prefix_prompt_tokens", "prompt_tokens", "Prompt tokens of retrieval requests looked up in the prefix cache."),
    ("prefix_computed_tokens", "prompt_tokens_computed", "Prompt tokens that entered a prefill."),
    ("prefix_reused_tokens", "prompt_tokens_reused", "Prompt tokens whose K/V came from the prefix cache."),
    ("prefix_stored_blocks", "prefix_cache_stored_blocks", "Prompt blocks stored in the prefix cache."),
    ("prefix_evicted_blocks", "prefix_cache_evictions", "Prefix blocks evicted from the cache's last tier."),
    ("prefix_spilled_blocks", "prefix_cache_spills", "Prefix blocks moved from the device tier to the host tier."),
    ("prefix_gave_way_blocks", "prefix_cache_gave_way_blocks", "Prefix blocks that left the device tier to make "
                                                                "room for a batch's beam KV (the KV budget)."),
)
RANKING_COUNTERS = (  # RankingStats.summary() key → (name, help); exported as grserve_ranking_<name>_total
    ("user_lookups", "user_cache_lookups", "User-as-prefix requests that looked the user's KV up."),
    ("user_hits", "user_cache_hits", "User-KV lookups that hit."),
    ("ip_item_tokens", "item_kv_tokens", "Candidate tokens of item-as-prefix requests."),
    ("cached_item_tokens", "item_kv_hit_tokens", "Candidate tokens whose KV came from the item-KV pool."),
    ("total_tokens", "prompt_tokens", "Prompt tokens of every ranked request."),
    ("computed_tokens", "computed_tokens", "Prompt tokens that entered a forward."),
    ("cached_tokens", "cached_tokens", "Prompt tokens served from a KV cache (user or item)."),
)
RANKING_RATES = (
    ("user_hit_rate", "user_cache_hit_rate", "User-KV cache hits / lookups since start."),
    ("item_hit_rate", "item_kv_hit_rate", "Item-KV pool hit tokens / item-as-prefix candidate tokens since start."),
)


def _safe(fn: Callable[[], dict]) -> dict:
    try:
        return dict(fn())
    except Exception:  # noqa: BLE001 - an engine shutting down: nothing this scrape
        return {}


def _family(kind: type, name: str, help_text: str, value: float, model_name: str | None = None) -> Metric:
    """One value as a family of ``kind``, labelled with ``model_name`` when given."""
    if model_name is None:
        return kind(name, help_text, value=value)
    m = kind(name, help_text, labels=["model_name"])
    m.add_metric([model_name], value)
    return m


def _counters(prefix: str, table: tuple, stats: dict, model_name: str | None = None) -> Iterator[Metric]:
    for key, name, help_text in table:
        if key in stats:
            yield _family(CounterMetricFamily, f"{prefix}{name}", help_text, float(stats[key]), model_name)


VLLM_GAUGES = (("running", "num_requests_running", "Requests in model execution batches."),
               ("waiting", "num_requests_waiting", "Requests waiting to be processed."))
VLLM_COUNTERS = (("preemptions", "num_preemptions", "Cumulative number of preemptions."),)


class LLMStatsCollector:
    """The LLM engine's ``stats()`` as gauges and counters (module docstring); ``model_name``: their label, and
    vLLM's families beside grserve's."""

    def __init__(self, stats: Callable[[], dict], model_name: str | None = None) -> None:
        self.stats, self.model_name = stats, model_name

    def describe(self) -> list:
        return []  # read at scrape time only: the families depend on what the engine reports

    def _one(self, kind: type, name: str, help_text: str, value: float) -> Metric:
        return _family(kind, name, help_text, value, self.model_name)

    def collect(self) -> Iterator[Metric]:
        s = _safe(self.stats)
        for key, help_text in LLM_GAUGES:
            if key in s:
                yield self._one(GaugeMetricFamily, f"grserve_llm_{key}", help_text, float(s[key]))
        used = None
        if s.get("total_blocks"):
            used = 1.0 - float(s.get("free_blocks", 0)) / float(s["total_blocks"])
            yield self._one(GaugeMetricFamily, "grserve_llm_kv_cache_usage_perc", "Fraction of the KV/hidden block "
                            "pool in use (0 to 1).", used)
        yield from _counters("grserve_llm_", LLM_COUNTERS, s, self.model_name)
        if self.model_name is None:
            return
        for key, name, help_text in VLLM_GAUGES:
            if key in s:
                yield self._one(GaugeMetricFamily, f"vllm:{name}", help_text, float(s[key]))
        if used is not None:
            yield self._one(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage (0 to 1).", used)
        yield from _counters("vllm:", VLLM_COUNTERS, s, self.model_name)
        if "prefix_hit_tokens" in s:
            hits = float(s["prefix_hit_tokens"])
            yield self._one(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the "
                            "prefix cache.", hits + float(s.get("prefill_tokens", 0)))
            yield self._one(CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix "
                            "cache.", hits)


class GRStatsCollector:
    """A retrieval or ranking engine's batch totals; with ``ranking`` (the runner's ``stats.summary``), the
    ranking caches' totals and hit rates."""

    def __init__(self, stats: Callable[[], dict], ranking: Callable[[], dict] | None = None) -> None:
        self.stats, self.ranking = stats, ranking

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Metric]:
        s = _safe(self.stats)
        yield from _counters("grserve_", GR_COUNTERS, s)
        yield from _counters("grserve_retrieval_", PREFIX_COUNTERS, s)
        if "prefix_hit_rate" in s:
            yield GaugeMetricFamily("grserve_retrieval_prefix_cache_hit_rate", "Prompt tokens reused / prompt tokens "
                                    "looked up since start.", value=float(s["prefix_hit_rate"]))
            tiers = GaugeMetricFamily("grserve_retrieval_prefix_cache_bytes", "Bytes of K/V held by the prefix "
                                      "cache, per tier (device counts against --kv-budget-bytes).", labels=["tier"])
            for key, value in s.items():
                if key.startswith("prefix_bytes_"):
                    tiers.add_metric([key.removeprefix("prefix_bytes_")], float(value))
            yield tiers
        if self.ranking is None:
            return
        r = _safe(self.ranking)
        yield from _counters("grserve_ranking_", RANKING_COUNTERS, r)
        for key, name, help_text in RANKING_RATES:
            if key in r:
                yield GaugeMetricFamily(f"grserve_ranking_{name}", help_text, value=float(r[key]))
