"""Every knob, one dataclass per concern. The CLI and the server build these; nothing else reads flags or env."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Scoring = Literal["renormalized", "hf"]
TopBWImpl = Literal["vectorized", "heap"]


@dataclass(frozen=True)
class ModelConfig:
    source: str = "tiny"  # a preset name (tiny, qwen3-0.6b, qwen3-1.7b, qwen2-1.5b) or an HF-format directory
    dtype: str = "float32"  # float32 | bfloat16 | float16 | float64
    device: str = "cpu"  # cpu | cuda | cuda:N
    seed: int = 0  # seeded random init for presets


@dataclass(frozen=True)
class CatalogConfig:
    path: str | None = None  # .jsonl / .csv / .grcat; None → a generated catalog
    num_items: int = 20_000  # generated catalog only
    depth: int = 3  # SID tokens per item
    codebook_size: int = 256  # codes per level, generated catalog only
    token_offset: int = 16  # first SID token id in the model vocabulary
    seed: int = 0


@dataclass(frozen=True)
class SearchConfig:
    """SID beam search. K (per-beam top-k) defaults to the beam width, as in the paper's square examples."""

    beam_width: int = 128  # default when a request does not say
    max_beam_width: int = 512
    top_k: int | None = None  # None → min(beam_width, codebook size)
    # "renormalized" (xGR): the item mask is added before the softmax, so log-probs renormalise over valid
    # tokens. "hf": log_softmax over the full vocabulary, then mask (HF transformers' prefix_allowed_tokens_fn).
    scoring: Scoring = "renormalized"
    topbw: TopBWImpl = "vectorized"  # "heap": the early-terminated min-heap scan (reference, slower in Python)
    overlap_masks: bool = True  # build the next step's mask on a host thread while the forward runs


@dataclass(frozen=True)
class SchedulerConfig:
    """Dynamic batching by token capacity and an SLO-derived waiting quota (xGR §7)."""

    token_capacity: int = 8192  # prompt tokens per batch; a larger single request runs alone
    max_batch_requests: int = 64
    slo_ms: float = 200.0  # P99 latency budget
    wait_quota_fraction: float = 0.1  # waiting quota = fraction × SLO (20 ms by default)
    max_inflight_batches: int = 2  # batches executing concurrently
    max_queue: int = 4096  # requests waiting beyond this are refused (503)

    @property
    def wait_quota_ms(self) -> float:
        return self.slo_ms * self.wait_quota_fraction


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_prompt_tokens: int = 8192
    max_top_n: int = 512
    log_level: str = "info"


@dataclass(frozen=True)
class ServeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    catalog: CatalogConfig = field(default_factory=CatalogConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
