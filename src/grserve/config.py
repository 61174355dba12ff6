"""Every knob, one frozen dataclass per concern. Defaults, help texts and checks live here, once.

The command line is generated from these classes (``grserve.flags``: a field declared with ``flag(...)`` is a
flag); the CLI and the servers build them, nothing else reads flags or environment variables. A config built in
code is checked exactly like one built from flags (``Checked.__post_init__``).

Per concern: ``ModelConfig`` (which model), ``CatalogConfig`` (retrieval items), ``SearchConfig`` (SID beam
search), ``SchedulerConfig`` (GR batching), ``ServerConfig`` (HTTP, retrieval limits), ``RankingConfig`` (BAT
engine), ``RankingDataConfig`` (ranking users/items at start-up), ``RankingLimits`` (ranking request limits),
``LLMConfig`` (LLM engine and scheduler). One top-level config per served mode composes them:
``ServeConfig`` (retrieval), ``RankingServeConfig``, ``LLMServeConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from grserve.flags import (
    Checked,
    ConfigError,
    at_least,
    comma_list,
    device_name,
    flag,
    fraction,
    non_negative,
    port_number,
    positive,
    positive_int,
)

Scoring = Literal["renormalized", "hf"]
TopBWImpl = Literal["vectorized", "heap"]
DTYPES = ("float32", "bfloat16", "float16", "float64")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
RANKING_POLICIES = ("bat", "user_prefix", "item_prefix", "greedy_size", "recompute")
LLM_SCHEDULERS = ("fcfs", "chunked", "aptserve", "aptserve-kv")
PREFIX_CACHE_POLICIES = ("lru", "lfu", "laru", "density", "leader")


@dataclass(frozen=True)
class ModelConfig(Checked):
    source: str = flag("tiny", "a model preset (tiny, tiny-mha, tiny-bat, qwen3-0.6b, qwen3-1.7b, qwen2-1.5b; "
                               "seeded random weights) or a Hugging Face-format directory (config.json + "
                               "*.safetensors)", name="model", metavar="PRESET_OR_DIR")
    dtype: str = flag("float32", "model weights and activations dtype", choices=DTYPES)
    device: str = flag("cpu", "where the model runs", check=device_name, metavar="cpu|cuda|cuda:N")
    seed: int = flag(0, "seed of a preset's random weights (and of generated data)", check=non_negative)


@dataclass(frozen=True)
class CatalogConfig(Checked):
    path: str | None = flag(None, "item catalog file (.jsonl, .csv or .grcat; see 'grserve catalog'); default: "
                                  "generate one with --num-items/--depth/--codebook-size", name="catalog",
                            metavar="FILE")
    num_items: int = flag(20_000, "items in the generated catalog", check=positive_int)
    depth: int = flag(3, "SID tokens per item in the generated catalog", check=positive_int)
    codebook_size: int = flag(256, "codes per SID level in the generated catalog", check=positive_int)
    token_offset: int = flag(16, "first SID token id in the model vocabulary", check=non_negative, cli=False)
    seed: int = flag(0, "seed of the generated catalog", check=non_negative)

    def check(self) -> None:
        if self.path is None and self.num_items > self.codebook_size ** self.depth:
            raise ConfigError("num_items", f"{self.num_items} items do not fit in "
                                           f"{self.codebook_size}**{self.depth} SIDs")


@dataclass(frozen=True)
class SearchConfig(Checked):
    """SID beam search. K (per-beam top-k) defaults to the beam width, as in the paper's square examples."""

    beam_width: int = flag(128, "beam width used when a request does not give one", check=positive_int,
                           metavar="BW")
    max_beam_width: int = flag(512, "largest beam width a request may ask for ('grserve serve' raises it to "
                                    "--beam-width)", check=positive_int)
    top_k: int | None = flag(None, "per-beam top-k (default: min(beam width, codebook size))", check=positive_int,
                             cli=False)
    # "renormalized" (xGR): the item mask is added before the softmax, so log-probs renormalise over valid
    # tokens. "hf": log_softmax over the full vocabulary, then mask (HF transformers' prefix_allowed_tokens_fn).
    scoring: Scoring = flag("renormalized", "renormalized: mask before the softmax (xGR); hf: mask after a "
                                            "full-vocabulary log_softmax (HF prefix_allowed_tokens_fn)",
                            choices=("renormalized", "hf"))
    topbw: TopBWImpl = flag("vectorized", "top-BW selection: vectorized, or the early-terminated heap scan "
                                          "(reference)", choices=("vectorized", "heap"), cli=False)
    overlap_masks: bool = flag(True, "build the next step's mask on a host thread while the forward runs",
                               cli=False)

    def check(self) -> None:
        if self.beam_width > self.max_beam_width:
            raise ConfigError("max_beam_width", f"{self.max_beam_width} is smaller than the default beam width "
                                                f"{self.beam_width}")


@dataclass(frozen=True)
class SchedulerConfig(Checked):
    """Dynamic batching by token capacity and an SLO-derived waiting quota (xGR §7)."""

    token_capacity: int = flag(8192, "prompt tokens per batch; a single longer request runs alone",
                               check=positive_int)
    max_batch_requests: int = flag(64, "requests per batch", check=positive_int)
    slo_ms: float = flag(200.0, "P99 latency budget; a request waits up to wait_quota_fraction x this for its "
                                "batch to fill", check=positive)
    wait_quota_fraction: float = flag(0.1, "waiting quota as a fraction of the SLO", check=fraction, cli=False)
    max_inflight_batches: int = flag(2, "batches executing concurrently", check=positive_int)
    max_queue: int = flag(4096, "requests waiting beyond this are refused (503)", check=positive_int)

    @property
    def wait_quota_ms(self) -> float:
        return self.slo_ms * self.wait_quota_fraction


@dataclass(frozen=True)
class ServerConfig(Checked):
    host: str = flag("127.0.0.1", "address to listen on (0.0.0.0: all)")
    port: int = flag(8000, "TCP port to listen on", check=port_number)
    max_prompt_tokens: int = flag(8192, "longest prompt a /v1/recommend history may lay out to",
                                  check=positive_int)
    max_top_n: int = flag(512, "largest top_n a request may ask for", check=positive_int)
    log_level: str = flag("info", "uvicorn / grserve log level", choices=LOG_LEVELS)


@dataclass(frozen=True)
class ServeConfig:
    """``grserve serve`` (GR retrieval)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    catalog: CatalogConfig = field(default_factory=CatalogConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


# ---- ranking (BAT) -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankingConfig(Checked):
    """The BAT ranking engine: prefix policy, caches, batching."""

    policy: str = flag("bat", "prefix-choice policy", choices=RANKING_POLICIES)
    user_cache_bytes: int = flag(64 << 20, "user-prefix KV cache capacity in bytes (whole pages)",
                                 check=non_negative)
    item_pool_bytes: int | None = flag(None, "item KV pool capacity in bytes (default: the registered catalog "
                                             "plus --item-pool-headroom)", check=positive_int)
    item_pool_headroom: float = flag(0.25, "spare fraction of the item pool for items registered later",
                                     check=at_least(0))
    page_size: int = flag(16, "tokens per KV page", check=positive_int)
    user_window_s: float = flag(1800.0, "W, the window of the users' decayed sliding-window frequency (seconds)",
                                check=positive, name="window_s")
    item_window_s: float = flag(3600.0, "window of the items' hotness (seconds; HRCS re-replication)",
                                check=positive)
    bat_item_tokens: str = flag("all", "BAT rule's item tokens: all candidate tokens or only the cached ones",
                                choices=("all", "cached"))
    write_back_items: bool = flag(True, "item-as-prefix: store items computed inline (cache miss) in the pool")
    max_batch_requests: int = flag(8, "requests per batch", check=positive_int)
    token_capacity: int = flag(16384, "prompt tokens per batch; a single longer request runs alone",
                               check=positive_int)
    max_queue: int = flag(1024, "requests waiting beyond this are refused (503)", check=positive_int)
    precompute_batch_tokens: int = flag(8192, "item tokens per forward when precomputing the item pool",
                                        check=positive_int, cli=False)


@dataclass(frozen=True)
class RankingDataConfig(Checked):
    """The users and items a ranking server starts with: JSON-lines files, or a generated synthetic set."""

    items_file: str | None = flag(None, "JSON lines {item_id, tokens} (the last token is the identifier token)",
                                  metavar="FILE")
    users_file: str | None = flag(None, "JSON lines {user_id, tokens}", metavar="FILE")
    instruction: str | None = flag(None, "comma-separated instruction token ids (default: generated)",
                                   check=comma_list(int, each=non_negative))
    num_items: int = flag(2000, "generated catalog size", check=positive_int)
    num_users: int = flag(200, "generated users", check=positive_int)
    scale: float = flag(0.25, "generated profile-length scale", check=positive)
    seed: int = flag(0, "seed of the generated users and items", check=non_negative)


@dataclass(frozen=True)
class RankingLimits(Checked):
    max_candidates: int = flag(256, "most candidates per /v1/rank request", check=positive_int)
    max_profile_tokens: int = flag(8192, "longest user profile in tokens", check=positive_int)
    max_item_tokens: int = flag(64, "longest item in tokens", check=positive_int)
    max_top_k: int = flag(256, "largest top_k a request may ask for", check=positive_int)


@dataclass(frozen=True)
class RankingServeConfig:
    """``grserve serve ranking``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    ranking: RankingConfig = field(default_factory=RankingConfig)
    data: RankingDataConfig = field(default_factory=RankingDataConfig)
    limits: RankingLimits = field(default_factory=RankingLimits)
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=8001))


# ---- LLM (Apt-Serve) -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LLMConfig(Checked):
    """The continuous-batching LLM engine: block pool, scheduling policy and its SLOs, prefix cache."""

    scheduler: str = flag("aptserve", "scheduling policy (aptserve-kv: Apt-Serve with the KV cache only)",
                          choices=LLM_SCHEDULERS)
    num_blocks: int = flag(4096, "blocks in the unified KV/hidden pool", check=at_least(2))
    block_size: int = flag(16, "tokens per block", check=positive_int)
    ttft_slo: float = flag(5.0, "TTFT SLO in seconds (aptserve)", check=positive)
    tbt_slo: float = flag(1.0, "P99 TBT SLO in seconds (aptserve)", check=positive)
    rho: float | None = flag(None, "hidden-cache cost per cached token in seconds (default: profiled at start-up)",
                             check=non_negative)
    token_budget: int = flag(512, "tokens per iteration (chunked)", check=positive_int)
    max_batched_tokens: int = flag(2048, "prefill tokens per iteration", check=positive_int)
    max_num_seqs: int = flag(256, "running requests at most", check=positive_int)
    prefix_cache_tokens: int = flag(0, "prompt-prefix KV cache size in tokens (0 = off): requests sharing a "
                                       "prompt prefix copy its K/V instead of computing it", check=non_negative)
    prefix_cache_policy: str = flag("lru", "eviction policy of the prefix cache (laru: learning-augmented LRU)",
                                    choices=PREFIX_CACHE_POLICIES)
    prefix_cache_mode: str = flag("share", "share: requests attach cached full blocks of the pool (ref-counted); "
                                           "copy: cached K/V are copied from a separate store", choices=("share", "copy"))
    served_model_name: str | None = flag(None, "model id in the API (default: --model)")


@dataclass(frozen=True)
class LLMServeConfig:
    """``grserve serve llm``."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(source="tiny-mha"))
    llm: LLMConfig = field(default_factory=LLMConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
