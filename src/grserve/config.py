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

import enum
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
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
QUANTIZATIONS = ("none", "int8", "int8-weight-only", "fp8")  # model/quantized_linear.py's SCHEMES
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
RANKING_POLICIES = ("bat", "user_prefix", "item_prefix", "greedy_size", "recompute")
LLM_SCHEDULERS = ("fcfs", "chunked", "aptserve", "aptserve-kv")
PREFIX_CACHE_POLICIES = ("lru", "lfu", "laru", "density", "leader")
TRUNCATE_MODES = ("left", "none")


@dataclass(frozen=True)
class ModelConfig(Checked):
    source: str = flag("tiny", "a model preset (tiny, tiny-mha, tiny-bat, qwen3-0.6b, qwen3-1.7b, qwen2-1.5b; "
                               "seeded random weights) or a Hugging Face-format directory (config.json + "
                               "*.safetensors)", name="model", metavar="PRESET_OR_DIR")
    dtype: str = flag("auto", "model weights and activations dtype; auto: bfloat16 on CUDA and where this CPU "
                              "computes bf16 faster than fp32 (a timed trial at start-up), else float32 "
                              "(model/dtype_choice.py; the start line says which and why)", choices=DTYPES)
    device: str = flag("cpu", "where the model runs", check=device_name, metavar="cpu|cuda|cuda:N")
    seed: int = flag(0, "seed of a preset's random weights (and of generated data)", check=non_negative)
    quantization: str = flag("none", "the decoder's projections quantized at load: int8 (W8A8: per-channel int8 "
                                     "weights, per-token int8 activations; CPUs with VNNI / AMX-INT8), "
                                     "int8-weight-only, fp8 (CUDA, compute capability >= 8.9); refused at start-up, "
                                     "with the reason, where this machine cannot run it fast "
                                     "(model/quantized_linear.py)", choices=QUANTIZATIONS)


@dataclass(frozen=True)
class CatalogConfig(Checked):
    path: str | None = flag(None, "item catalog file (.jsonl, .csv, .grcat, or an LC-Rec / MiniOneRec index .json; "
                                  "see 'grserve catalog'); default: "
                                  "generate one with --num-items/--depth/--codebook-size", name="catalog",
                            metavar="FILE")
    num_items: int = flag(20_000, "items in the generated catalog", check=positive_int)
    depth: int = flag(3, "SID tokens per item in the generated catalog", check=positive_int)
    codebook_size: int = flag(256, "codes per SID level in the generated catalog", check=positive_int)
    token_offset: int = flag(16, "first SID token id in the model vocabulary", check=non_negative, cli=False)
    seed: int = flag(0, "seed of the generated catalog", check=non_negative)
    popularity: str | None = flag(None, "item popularity, JSON {\"<item id>\": count}: the answer to a history "
                                        "with no items (cold start); default: every item counts 0 (item-id order)",
                                  metavar="FILE")
    duplicate_sids: str = flag("refuse", "several items with one SID in --catalog: refuse (the catalog does not load, "
                                         "naming both items), or popularity: serve every item of a SID, ranked by "
                                         "--popularity within it, each answer naming its own item",
                               choices=("refuse", "popularity"))

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
    warmup: bool = flag(True, "before the server is ready (/health ok), run one batch per warm-up beam width and "
                              "batch bucket, so the first requests do not pay for the set-up (engine/warmup.py)")
    warmup_beam_widths: str | None = flag(None, "comma-separated beam widths to warm up (default: --beam-width)",
                                          check=comma_list(int, each=positive_int), metavar="BW,...")

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

    @property
    def wait_quota_ms(self) -> float:
        return self.slo_ms * self.wait_quota_fraction


@dataclass(frozen=True)
class PrefixCacheConfig(Checked):
    """Prompt-prefix KV reuse across GR retrieval requests (``kvcache/prefix_blocks.py``; docs/architecture.md)."""

    prefix_cache_tokens: int = flag(0, "prompt-prefix KV cache size in tokens (0 = off): a request loads the "
                                       "longest cached block-aligned prefix of its prompt and prefills only the "
                                       "rest; the beams are the same", check=non_negative)
    prefix_cache_policy: str = flag("leader", "eviction policy of the prefix cache (as serve llm's; docs/eviction.md)",
                                    choices=PREFIX_CACHE_POLICIES)
    prefix_block_size: int = flag(16, "tokens per cached prefix block (only full blocks are cached)",
                                  check=positive_int)
    prefix_cache_host_tokens: int = flag(0, "CUDA only: a host tier of this many tokens (pinned memory) that "
                                            "blocks evicted from the device tier spill to", check=non_negative)
    kv_budget_bytes: int = flag(0, "device bytes for the beam KV of running batches plus the prefix cache "
                                   "(0: no bound but --prefix-cache-tokens); the cache gives way to a batch, "
                                   "never a request", check=non_negative)

    @property
    def enabled(self) -> bool:
        return self.prefix_cache_tokens > 0

    def check(self) -> None:
        if self.enabled and self.prefix_cache_tokens < self.prefix_block_size:
            raise ConfigError("prefix_cache_tokens", f"{self.prefix_cache_tokens} tokens do not hold one block of "
                                                     f"--prefix-block-size {self.prefix_block_size}")


@dataclass(frozen=True)
class ServerConfig(Checked):
    host: str = flag("127.0.0.1", "address to listen on (0.0.0.0: all)")
    port: int = flag(8000, "TCP port to listen on", check=port_number)
    max_prompt_tokens: int = flag(8192, "longest prompt a /v1/recommend history may lay out to",
                                  check=positive_int)
    max_top_n: int = flag(512, "largest top_n a request may ask for", check=positive_int)
    max_exclude_items: int = flag(4096, "longest exclude_items list a /v1/recommend request may give (413)",
                                  check=positive_int)
    max_include_items: int = flag(16384, "longest include_items allowlist a /v1/recommend request may give (413)",
                                  check=positive_int)
    max_history_entries: int = flag(16384, "longest history_items / history_sids / history_tokens list a "
                                           "/v1/recommend request may give when it is truncated (413); the newest "
                                           "entries that fit in --max-prompt-tokens are used", check=positive_int)
    truncate: str = flag("left", "a /v1/recommend history longer than --max-prompt-tokens, unless the request says: "
                                 "left keeps its newest items that fit (the answer counts the dropped ones), none "
                                 "refuses it (413)", choices=TRUNCATE_MODES)
    log_level: str = flag("info", "uvicorn / grserve log level", choices=LOG_LEVELS)


GATE_ACTIONS = ("fallback", "refuse")


@dataclass(frozen=True)
class PrecisionGateConfig(Checked):
    """The recall gate at start-up (``grserve serve``; ``precision_check.startup_gate``, docs/offline-eval.md):
    sampled histories run at float32 and at the served dtype, their top-N lists compared before the server
    listens; below the thresholds the server serves float32 (saying so on its start line) or refuses to start."""

    precision_gate_users: int = flag(0, "at start-up, run this many sampled histories at float32 and at the "
                                        "served --dtype (when it is not float32) and compare their top-N items "
                                        "(0 = off)", check=non_negative, metavar="N")
    precision_gate_top_n: int = flag(20, "items compared per history (overlap@N); at most --beam-width",
                                     check=positive_int)
    precision_gate_min_overlap: float = flag(0.95, "the gate: mean overlap@N at least this (above 1: never passes)",
                                             check=non_negative, metavar="X")
    precision_gate_min_top1: float = flag(0.0, "the gate: top-1 agreement at least this (above 1: never passes)",
                                          check=non_negative, metavar="X")
    precision_gate_action: str = flag("fallback", "below the gate: fallback (serve float32 and say so on the start "
                                                  "line) or refuse (exit 2 without serving)", choices=GATE_ACTIONS)
    # what the gate found, set at start-up (not a flag): the start lines print it
    outcome: str | None = flag(None, "the gate's verdict for the start line", cli=False)
    fell_back: bool = flag(False, "the gate replaced the asked dtype by float32", cli=False)

    @property
    def enabled(self) -> bool:
        return self.precision_gate_users > 0

    def label(self, dtype_label: str) -> str:
        """The start line's dtype text with the gate's verdict."""
        if self.outcome is None:
            return dtype_label
        return self.outcome if self.fell_back else f"{dtype_label}; {self.outcome}"


@dataclass(frozen=True)
class ServeConfig:
    """``grserve serve`` (GR retrieval)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    catalog: CatalogConfig = field(default_factory=CatalogConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    edge: "EdgeConfig" = field(default_factory=lambda: EdgeConfig())
    reload: "CatalogReloadConfig" = field(default_factory=lambda: CatalogReloadConfig())
    accel: "AccelConfig" = field(default_factory=lambda: AccelConfig())  # defined at the end (GPU fast path)
    cluster: "ClusterConfig" = field(default_factory=lambda: ClusterConfig())  # --instances N (end of file)
    state: "StateConfig" = field(default_factory=lambda: StateConfig())  # --state-dir (after the edge)
    beams: "BeamApiConfig" = field(default_factory=lambda: BeamApiConfig())  # the OpenAI beam routes
    prefix: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)  # prompt-prefix KV reuse (off by default)
    process: "ProcessConfig" = field(default_factory=lambda: ProcessConfig())  # engine process, --api-servers
    precision_gate: PrecisionGateConfig = field(default_factory=PrecisionGateConfig)  # the recall gate at start-up


@dataclass(frozen=True)
class BeamApiConfig(Checked):
    """The OpenAI routes of ``serve retrieval`` (``/v1/chat/completions``, ``/v1/completions``: beams as choices;
    docs/serving-gr-models.md)."""

    served_model_name: str | None = flag(None, "model id of the OpenAI routes (default: --model)")
    max_think_tokens: int = flag(1024, "largest max_think_tokens a request may ask for (0: no thinking)",
                                 check=non_negative)
    max_chat_messages: int = flag(2048, "most messages (and content parts) a chat may have (these routes and "
                                        "/v1/recommend's messages); at most --max-prompt-tokens too (400 "
                                        "too_many_messages, before the chat template)", check=positive_int, metavar="N")
    prompt_template: str | None = flag(None, "a Jinja template file: history_items / history_sids are written into "
                                             "it as the model's own prompt ({{ history }}: the items' SID text "
                                             "joined by ', '; {{ items }}, {{ item_ids }}; "
                                             "inputs/prompt_template.py); default: the bare SID tokens",
                                       metavar="FILE")
    prompt_format: str = flag("text", "how the rendered --prompt-template is encoded: text (as /v1/completions "
                                      "encodes a prompt) or chat (one user message in the model's chat template)",
                              choices=("text", "chat"))


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
    max_users: int = flag(100_000, "registered users at most (POST /v1/users beyond it: 409)", check=positive_int)
    max_items: int = flag(50_000, "registered items at most (POST /v1/items beyond it: 409)", check=positive_int)


@dataclass(frozen=True)
class HRCSConfig(Checked):
    """``serve ranking --instances N``: the item KV on KV-cache workers, placed by BAT's HRCS (docs/ranking.md)."""

    kv_cache_workers: int | None = flag(None, "KV-cache workers holding the item KV (hot items replicated, the rest "
                                              "sharded; default: one per instance); 0: every instance precomputes "
                                              "the whole item pool", check=non_negative)
    hrcs_alpha: float = flag(0.1, "HRCS: tolerable item-KV transfer time as a fraction of the prefill time",
                             check=non_negative)
    hrcs_link_gbps: float = flag(10.0, "HRCS: bandwidth between instances and KV-cache workers (Gbps)",
                                 check=positive)
    hrcs_prefill_s: float | None = flag(None, "HRCS: prefill seconds per request t (default: measured from the "
                                              "instances' batches)", check=non_negative)
    hrcs_interval_s: float = flag(300.0, "seconds between re-placements of the hot items from the items' hotness "
                                         "(0: never)", check=non_negative)


@dataclass(frozen=True)
class RankingServeConfig:
    """``grserve serve ranking``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    ranking: RankingConfig = field(default_factory=RankingConfig)
    data: RankingDataConfig = field(default_factory=RankingDataConfig)
    limits: RankingLimits = field(default_factory=RankingLimits)
    hrcs: HRCSConfig = field(default_factory=HRCSConfig)
    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=8001))
    edge: "EdgeConfig" = field(default_factory=lambda: EdgeConfig())
    cluster: "ClusterConfig" = field(default_factory=lambda: ClusterConfig())  # --instances N (end of file)
    state: "StateConfig" = field(default_factory=lambda: StateConfig())  # --state-dir (after the edge)
    process: "ProcessConfig" = field(default_factory=lambda: ProcessConfig())  # the engine in its own process


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
    prefix_cache_policy: str = flag("leader", "eviction policy of the prefix cache (leader: follows the best of "
                                              "LRU / window-LFU / a learned hit-density ranking; docs/eviction.md)",
                                    choices=PREFIX_CACHE_POLICIES)
    prefix_cache_mode: str = flag("share", "share: requests attach cached full blocks of the pool (ref-counted); "
                                           "copy: cached K/V are copied from a separate store", choices=("share", "copy"))
    served_model_name: str | None = flag(None, "model id in the API (default: --model)")
    threads: int = flag(0, "torch intra-op threads of the engine (0: measured at start-up -- one per CPU core "
                           "minus one, kept for the HTTP front end and the tokenizer, or one per core when that "
                           "runs the model's layer >10%% faster and a decode step's projections take >= 8 ms "
                           "without it, else steps of >= 512 new tokens still run on one per core; the start line "
                           "says which; docs/llm.md, P7)",
                        check=non_negative)
    packed_linears: bool = flag(True, "run the decoder's projections on oneDNN-prepacked weights on a CPU "
                                      "(1.4-2x faster GEMMs at serving batch sizes; same math up to the fp32 "
                                      "summation order; doubles the projection weights' memory)")
    decode_staging: bool = flag(True, "pure decode steps read K/V from a persistent head-major copy of the "
                                      "batch's cache instead of gathering it from the pool every layer and step "
                                      "(at most 1 GiB; attention/decode_staging.py)")
    decode_kernel: bool = flag(True, "staged decode steps attend with a C++ kernel built for this CPU at start-up "
                                     "(~1 s with the system's C++ compiler, cached in $GRSERVE_CACHE_DIR/kernels, "
                                     "checked against SDPA; on torch's threads); off, or without a compiler: SDPA "
                                     "(attention/decode_kernel.py)")
    batch_invariant: bool = flag(False, "a request's tokens and logprobs are the same bits whatever else shares its "
                                        "batch and however its prompt is chunked: each query token attends in "
                                        "its own SDPA row over keys padded to a multiple of 512 (attention/hybrid.py;"
                                        " costs prefill attention, up to ~2x on the tiny preset; docs/llm.md, "
                                        "issue 42)")
    decode_compile: str = flag("off", "pure decode steps run the layer stack torch.compile'd (Inductor) per row "
                                      "bucket, compiled at start-up (model/decode_compile.py; auto: on where a C++ "
                                      "compiler exists and the CPU fast paths are on)", choices=("auto", "on", "off"))


@dataclass(frozen=True)
class LLMServeConfig:
    """``grserve serve llm``."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(source="tiny-mha"))
    llm: LLMConfig = field(default_factory=LLMConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    edge: "EdgeConfig" = field(default_factory=lambda: EdgeConfig())
    api: LLMApiConfig = field(default_factory=lambda: LLMApiConfig())
    cluster: "ClusterConfig" = field(default_factory=lambda: ClusterConfig())  # --instances N (end of file)
    slo: "SLOConfig" = field(default_factory=lambda: SLOConfig())  # latency targets (end of file)
    pd: "PDConfig" = field(default_factory=lambda: PDConfig())  # --pd, role flips (end of file)
    colocation: "ColocationConfig" = field(default_factory=lambda: ColocationConfig())  # online/offline
    process: "ProcessConfig" = field(default_factory=lambda: ProcessConfig())  # engine process, --api-servers


# ---- the API edge (security and limits), shared by the three servers ------------------------------------------
API_KEY_ENV = "GRSERVE_API_KEY"
ADMIN_API_KEY_ENV = "GRSERVE_ADMIN_API_KEY"


def _key(v: str | None) -> str | None:
    if v is None:
        return None
    if not v.strip() or v != v.strip():
        return "must be a non-empty key without surrounding spaces"
    return None if v.isprintable() and v.isascii() else "must be printable ASCII"


@dataclass(frozen=True)
class EdgeConfig(Checked):
    """What every server checks before a request reaches its engine: authentication, admission (a bounded queue
    with a deadline), request-body size, and how SIGTERM ends the server. ``docs/security.md`` lists them all."""

    api_key: str | None = flag(None, f"require 'Authorization: Bearer KEY' on every route except /health and "
                                     f"/metrics (default: ${API_KEY_ENV}; unset: no authentication)",
                               check=_key, metavar="KEY")
    admin_api_key: str | None = flag(None, f"the key of the routes that change state (POST /v1/catalog, "
                                           f"/v1/users, /v1/items); default: ${ADMIN_API_KEY_ENV}; unset: those "
                                           f"routes are off (403)", check=_key, metavar="KEY")
    max_waiting: int = flag(1024, "queued (not yet running) requests at most; more are refused with 429 and "
                                  "Retry-After", check=positive_int, metavar="N")
    request_timeout: float = flag(60.0, "seconds a request may wait in the queue; past it, it is dropped without "
                                        "being computed and answered 503 (queue_timeout)", check=positive,
                                  metavar="S")
    max_body_bytes: int = flag(8 << 20, "largest request body in bytes (413 body_too_large)", check=positive_int)
    shutdown_timeout: float = flag(30.0, "on SIGTERM: seconds to finish queued and running requests; what is "
                                         "left then is ended with 503 (stopped)", check=non_negative, metavar="S")


@dataclass(frozen=True)
class CatalogReloadConfig(Checked):
    """``POST /v1/catalog`` (retrieval): reload a catalog by file name from one directory, bounded."""

    catalog_dir: str | None = flag(None, "directory POST /v1/catalog loads catalogs from, by file name only "
                                         "(unset: catalog reload is off)", metavar="DIR")
    max_catalog_bytes: int = flag(256 << 20, "largest catalog file a reload may load, in bytes",
                                  check=positive_int)
    catalog_timeout: float = flag(60.0, "seconds a catalog reload may take; past it, it is abandoned (never "
                                        "applied) and answered 504", check=positive, metavar="S")
    reload_wait: float = flag(2.0, "seconds a reload waits for the one before it to end (then 429)",
                              check=non_negative, cli=False)


def _not_empty(v: str | None) -> str | None:
    return "must not be empty (leave it out for memory only)" if v is not None and not v.strip() else None


@dataclass(frozen=True)
class StateConfig(Checked):
    """Where retrieval and ranking keep their admin writes across restarts (``state/store.py``, docs/security.md)."""

    state_dir: str | None = flag(None, "directory of the SQLite store that keeps POST /v1/users, /v1/items and "
                                       "/v1/catalog across restarts and kills, one server per directory (created "
                                       "if missing; unset: memory only, a restart loses them)", check=_not_empty,
                                 metavar="DIR")


# ---- LLM OpenAI surface (issue 14) ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LLMApiConfig(Checked):
    """The OpenAI-compatible API of ``serve llm``: tokenizer, per-request limits of the OpenAI parameters."""

    tokenizer: str | None = flag(None, "HF tokenizer directory (default: the model directory's own; for a preset "
                                       "its byte-level tokenizer, written under --tokenizer-cache)", metavar="DIR")
    tokenizer_cache: str | None = flag(None, "where a preset's tokenizer is written and, verified, reused (an HF "
                                             "directory: aiperf --tokenizer DIR); default: $GRSERVE_CACHE_DIR/"
                                             "tokenizers, else $XDG_CACHE_HOME/grserve/tokenizers, else "
                                             "~/.cache/grserve/tokenizers", metavar="DIR")
    max_logprobs: int = flag(20, "largest logprobs / top_logprobs a request may ask for", check=non_negative)
    max_n: int = flag(16, "largest n (choices per request)", check=positive_int)
    max_chat_messages: int = flag(2048, "most messages (and content parts) a chat request may have; at most the "
                                        "context window too (400 too_many_messages, before the chat template)",
                                  check=positive_int, metavar="N")
    tool_call_parser: str = flag("hermes", "how a chat answer is parsed into tool_calls (vLLM's --tool-call-parser): "
                                           "hermes (<tool_call>{...}</tool_call>: Qwen2.5/Qwen3, Hermes) or "
                                           "llama3_json (a JSON object {name, parameters}: LLaMA-3.x)",
                                 choices=("hermes", "llama3_json"))


# ---- accelerator fast path (issue 15) ------------------------------------------------------------------------
ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")
FAST_PATH_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class AccelConfig(Checked):
    """The device fast path of GR retrieval: fixed-shape beam steps (captured as CUDA graphs on a GPU).

    ``attention_backend`` picks the kernels of the decode step: ``torch`` (plain torch ops, the reference, CPU and
    CUDA), ``triton`` (grserve's Triton kernels: unshared-stage beam attention, masked top-k/expand; on CPU only
    under ``TRITON_INTERPRET=1``), ``flashinfer`` (FlashInfer's decode attention + merge_state, CUDA, when
    installed). The device itself is ``--device`` of the model. See docs/gpu.md.
    """

    fast_path: str = flag("auto", "retrieval through the fixed-shape device beam steps: auto (on a CUDA device), "
                                  "on, off (the host-driven reference path)", choices=FAST_PATH_MODES)
    attention_backend: str = flag("torch", "kernels of the fast path's decode step", choices=ATTENTION_BACKENDS)
    cuda_graphs: bool = flag(True, "capture each beam step as a CUDA graph (CUDA only; eager elsewhere)")
    batch_buckets: str = flag("1,2,4,8,16,32,64", "request-count buckets a batch is padded up to (graph keys)",
                              check=comma_list(int, each=positive_int))
    prompt_bucket: int = flag(256, "shared-KV length is padded up to a multiple of this (graph keys)",
                              check=positive_int)
    # ---- the prefill (both paths; issue 36, docs/gpu.md "The prefill") ----
    prefill_last_rows: bool = flag(True, "the prefill's last layer runs queries, o_proj and MLP on each prompt's "
                                         "last token only (its K/V for all): the LM head reads nothing else")
    prefill_attention: str = flag("auto", "the prefill's causal attention over packed prompts: auto (one "
                                          "FlashAttention varlen call on CUDA, else loop), loop (one SDPA call per "
                                          "prompt), flash", choices=("auto", "loop", "flash"))
    prefill_compile: bool = flag(False, "torch.compile the prefill's layers in two pieces around the attention, "
                                        "static shapes per --prompt-bucket tokens (model/prefill_compile.py; no gain "
                                        "measured on CPU, ~90 s compile; for GPUs to measure)")
    batch_invariant: bool = flag(True, "retrieval runs each projection and the SID LM head as one GEMM per request "
                                       "(RowGroups, model/packed_linear.py): a request's items and scores do not "
                                       "depend on what else shares its batch (costs a few %% at low load)")
    cpu_packed_linears: bool = flag(True, "retrieval on a CPU runs the decoder's projections on oneDNN-prepacked "
                                          "weights where this CPU has them (model/packed_linear.py)")

    def use_fast_path(self, device: str) -> bool:
        return self.fast_path == "on" or (self.fast_path == "auto" and str(device).startswith("cuda"))


# ==== cluster (xLLM service layer: many instances on Ray) — added by the cluster branch ==========================
ROUTING_POLICIES = ("kv", "least_loaded", "round_robin")


@dataclass(frozen=True)
class ClusterConfig(Checked):
    """Several engine instances behind one front end (``--instances N``): Ray actors, the router, the global KV
    index and fault recovery (docs/cluster.md)."""

    instances: int = flag(1, "engine instances; above 1 each runs in its own Ray actor behind this front end",
                          check=positive_int)
    ray_address: str | None = flag(None, "an existing Ray cluster to join (default: grserve starts a local Ray "
                                         "on 127.0.0.1 that requires a token)", metavar="ADDR")
    allow_open_ray: bool = flag(False, "join a --ray-address cluster off this machine that accepts clients "
                                       "without a token (refused by default: anyone reaching it runs code in it)")
    ray_dashboard: bool = flag(False, "start Ray's dashboard with the local Ray (on 127.0.0.1; needs ray[default])")
    routing: str = flag("kv", "routing policy: kv (cached prefix blocks + booked load), least_loaded, "
                              "round_robin", choices=ROUTING_POLICIES)
    kv_block_size: int = flag(16, "tokens per block of the global KV index's chained block hashes",
                              check=positive_int)
    decode_weight: float = flag(0.1, "router: cost of one booked decode token relative to one prefill token",
                                check=non_negative)
    cache_weight: float = flag(2.0, "router: weight of a cached prompt token (1 = the tokens an instance would "
                                    "compute; more keeps conversations where their KV is when loads differ)",
                               check=non_negative)
    heartbeat_timeout_s: float = flag(2.0, "an instance whose poll has not answered for this long is fenced "
                                           "(killed) and its requests move", check=positive)
    poll_wait_s: float = flag(0.25, "longest wait of one poll of an instance (the heartbeat period when idle)",
                              check=positive)
    migration_limit: int = flag(2, "moves per request after instance deaths; one more death fails it (503)",
                                check=non_negative)
    kv_snapshot: bool = flag(True, "instances hand the front end a copy of each prompt's KV at the end of its "
                                   "prefill, so a request can migrate with its KV instead of recomputing")
    instance_threads: int = flag(0, "torch threads per instance actor; 0 = a share of this machine's cores, "
                                    "max(1, cores // instances)", check=non_negative)
    restart_instances: bool = flag(True, "restart a dead (or fenced) instance as a new actor with a new "
                                         "incarnation; it rejoins the KV index (by snapshot) and the router")


# ---- issue 13: prefill/decode disaggregation, role flips, online/offline co-location (docs/cluster.md) ----------
class Priority(enum.StrEnum):
    """An LLM request's co-location class (``scheduler/colocation.py``): online work preempts offline work. A
    ``StrEnum``: equal to its value as a string (the API's ``"online"`` / ``"offline"``, metric labels)."""

    ONLINE = "online"
    OFFLINE = "offline"

    @classmethod
    def of(cls, value: str) -> Priority:
        """``value`` as a ``Priority``; ``ValueError`` naming the classes for anything else."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"priority must be one of {tuple(p.value for p in cls)}, not {value!r}") from None


@dataclass(frozen=True)
class SLOConfig(Checked):
    """The latency targets the PD router, the role flips and the co-location admission all judge against."""

    ttft_slo_s: float = flag(1.0, "time-to-first-token SLO of online requests, seconds", check=positive)
    tpot_slo_s: float = flag(0.1, "time-per-output-token SLO of online requests, seconds", check=positive)


@dataclass(frozen=True)
class PDConfig(Checked):
    """Prefill/decode disaggregation across instances and the dynamic role flips of xLLM §3.2 (digest §3.3)."""

    pd: bool = flag(False, "prefill/decode disaggregation across instances (needs --instances >= 2): long "
                           "uncached prompts prefill on one instance and decode on another")
    prefill_instances: int = flag(1, "instances that start in the prefill pool (the rest start in the decode pool)",
                                  check=positive_int)
    split_min_tokens: int = flag(0, "split a request only when its uncached prompt has at least this many tokens; "
                                    "0 = the break-even length from the measured cost model", check=non_negative)
    role_flips: bool = flag(True, "move instances between the prefill and decode pools when a pool's predicted "
                                  "TTFT or TPOT breaks its SLO")
    min_dwell_s: float = flag(2.0, "an instance stays at least this long in a pool before it may flip again",
                              check=non_negative)
    min_per_role: int = flag(1, "instances always kept in each role", check=positive_int)
    slo_headroom: float = flag(0.8, "the PD router and the flip rules plan against this fraction of the TTFT and "
                                    "TPOT SLOs (a margin for prediction error)", check=fraction)


@dataclass(frozen=True)
class ColocationConfig(Checked):
    """Online/offline co-location (xLLM §3.1, digest §3.2): online work preempts offline work; offline decodes
    join a latency-strict batch only while the latency model keeps it inside the online TPOT SLO."""

    max_offline_preemptions: int = flag(3, "times one offline request may be preempted by online work; after "
                                           "that it is no longer preempted", check=non_negative)
    offline_admission: bool = flag(True, "admit offline decodes into a batch with online work only when the "
                                         "latency model predicts the step stays inside --tpot-slo-s")


@dataclass(frozen=True)
class ProcessConfig(Checked):
    """Where a server's engine runs (docs/architecture.md, "Processes"): in an engine-core process of its own beside
    the HTTP front end(s), or on a thread of the one process."""

    engine_process: bool = flag(True, "run the engine (scheduler + model + step loop) in a process of its own; the "
                                      "HTTP front end(s) do HTTP, validation, tokenization and streaming (off: one "
                                      "process, the engine on a thread)")
    api_servers: int = flag(1, "HTTP front-end processes sharing the port, all feeding one engine process (needs "
                               "--engine-process)", check=positive_int)
    engine_restarts: int = flag(3, "times a dead engine process is restarted within 10 minutes; after that the "
                                   "server answers 503 and /health says why", check=non_negative)
    threads: int = flag(0, "torch intra-op threads of the retrieval or ranking engine (0: measured at start-up on "
                           "the model's layer, as serve llm's --threads; the start line names the CPU and the choice; "
                           "a restarted engine process keeps it; fp32 scores can differ in their last bits with "
                           "another count, so pin it when a new server must answer as the last one, to the bit)",
                        check=non_negative)
    onednn_cache_capacity: int = flag(128, "entries of oneDNN's primitive cache and of torch's ideep cache in the "
                                           "engine's process (one per GEMM shape, ~280 KiB each for the tiny model; "
                                           "their default, 1,024 each, grows the process by up to ~560 MiB as new "
                                           "batch sizes come; 0: their defaults; ONEDNN_PRIMITIVE_CACHE_CAPACITY / "
                                           "LRU_CACHE_CAPACITY in the environment win; grserve/memory.py)",
                                      check=non_negative)
    malloc_arena_max: int = flag(2, "glibc malloc arenas of the engine's process (mallopt M_ARENA_MAX; glibc's "
                                    "default, 8 per core, lets memory freed on one thread's arena pile up beside "
                                    "the others'; 0: glibc's default; a MALLOC_ARENA_MAX in the environment wins; "
                                    "grserve/memory.py)", check=non_negative)
    malloc_trim_s: float = flag(10.0, "seconds between two malloc_trim(0) calls in the engine's process, giving the "
                                      "heap memory glibc keeps after freeing tensors of varying shapes back to the OS "
                                      "(grserve/memory.py; 0: never)", check=non_negative)
