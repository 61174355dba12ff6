"""The cluster's wire: every message between a front end and its instances, as small typed dataclasses.

Nothing else crosses a front end ↔ instance boundary (Ray pickles these; both sides import this module). The calls
of an instance actor and what they carry:

========================  =======================================  =============================================
call                      front end → instance                     instance → front end
========================  =======================================  =============================================
``info()``                                                         ``LLMInstanceInfo`` / ``GRInstanceInfo``
``poll(wait_s)``          the longest wait (the heartbeat)         ``LLMPoll`` / ``GRPoll``
``kv_snapshot()``                                                  ``KVSnapshot`` (the KV index's resync)
``submit`` (LLM)          ``Attempt``                              (tokens come back in ``LLMPoll.tokens``)
``cancel(request_id)``    the request id                           whether it was running there
``run`` (GR)              the ``RetrievalRequest`` / ``RankingRequest`` as the app built it; the answer is its
                          ``RetrievalResult`` / ``RankingResult`` (single step: nothing to stream)
``apply`` (GR)            a ``StateChange`` (``CatalogReplace`` /  how many entries it applied
                          ``RegistryUpdate``), to every instance
``reset(incarnation)``    an empty prefix cache under a new        (LLM benchmarks)
                          incarnation id
``compute_items`` (rank)  item ids and the ``ItemPlacement``:      how many it computed (into the KV-cache
                          compute their KV into their owners       workers, as ``ItemKV`` puts)
========================  =======================================  =============================================

A ranking cluster's KV-cache workers (``gr/kv_workers.py``) take ``put(ItemKV)``, ``get(item ids)`` → ``ItemKV``
(the ones they hold), ``drop(item ids)`` and ``poll(wait_s)`` → ``GRPoll`` (their stored bytes), from the front end
and the instances.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from grserve.config import Priority
from grserve.engine.types import LLMFit

if TYPE_CHECKING:
    import numpy as np
    import torch
    from ray.actor import ActorHandle

    from grserve.catalog import Catalog
    from grserve.cluster.gr.hrcs import Placement
    from grserve.engine.sampling import SamplingParams

Tier = Literal["hbm", "dram", "ssd"]
TIERS: tuple[Tier, ...] = ("hbm", "dram", "ssd")  # fastest first; a store on a CUDA device is "hbm", host "dram"


# ---- both wings: the global KV index (core/kv_index.py) -------------------------------------------------------
@dataclass(frozen=True)
class KVEvent:
    """One change of an instance's cached KV: blocks (LLM: chained block hashes; ranking: user keys) stored or
    evicted, numbered 0, 1, 2 … per incarnation so the front end can tell a lost event."""

    instance: int
    incarnation: str
    seq: int
    kind: Literal["store", "evict"]
    blocks: tuple[int, ...]
    tier: Tier = "dram"


@dataclass(frozen=True)
class KVSnapshot:
    """An instance's whole cached KV (block → tier): the index's resync after a gap or a restart."""

    instance: int
    incarnation: str
    next_seq: int  # the snapshot holds the effect of every event with seq < next_seq
    contents: dict[int, Tier] = field(default_factory=dict)


@dataclass(frozen=True)
class InstanceInfo:
    """What an instance is and where it runs (``info()``: the start-up lines, a restart's check)."""

    index: int
    incarnation: str
    pid: int = 0
    host: str = ""
    node_ip: str = "127.0.0.1"
    device: str = "cpu"
    torch_threads: int = 1


# ---- the LLM wing -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LLMInstanceInfo(InstanceInfo):
    max_model_len: int = 0
    vocab_size: int = 0
    num_blocks: int = 0
    block_size: int = 16
    kv_planes: int = 2
    prefix_cache_tokens: int = 0

    @property
    def fit(self) -> LLMFit:
        """What its engine can ever hold (the front end refuses what no instance can run)."""
        return LLMFit(self.max_model_len, self.num_blocks, self.block_size, self.kv_planes)


@dataclass(frozen=True)
class Attempt:
    """One attempt of a request on one instance (``submit``). A request moved off a dead instance, or handed from its
    prefill to its decode instance (PD), is a new attempt of the same request id: the same prompt and sampling, and
    the tokens the client already has, which the instance's engine continues after (``engine.types.Handover``)."""

    request_id: str
    attempt: int
    prompt_ids: list[int]
    params: SamplingParams
    delivered: list[int] = field(default_factory=list)  # output tokens delivered by earlier attempts
    snapshot: torch.Tensor | None = None  # K/V [L, 2, m, width] of (prompt_ids + delivered)[:m] computed elsewhere
    priority: Priority = Priority.ONLINE
    prefill_only: bool = False  # PD: one token, then a "pause"; its prompt's K/V comes back (``PromptKV``)

    @property
    def tokens(self) -> list[int]:
        """What the instance prefills: the prompt and the tokens delivered."""
        return self.prompt_ids + self.delivered if self.delivered else self.prompt_ids

    @property
    def max_new_tokens(self) -> int:
        """Tokens still to generate."""
        return self.params.max_tokens - len(self.delivered)


@dataclass(frozen=True)
class TokenReport:
    """Tokens of one attempt: ``token_ids`` are its tokens ``index, index + 1, …`` (counted within the attempt) and
    ``text`` the text they add, as the instance's engine decoded it (stop strings, held-back characters). The report
    that ends an attempt ("stop", "length", "pause") carries its ``phases`` as the instance's engine measured them
    (``LLMResult``'s ``queue_s``, ``prefill_s``, ``decode_s``; those it has)."""

    request_id: str
    attempt: int
    index: int
    token_ids: list[int]
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "pause" (PD: goes on) | "abort" (cancelled) | "error"
    phases: dict[str, float] | None = None  # the ended attempt's engine phases, in seconds (its instance's clock)
    cached_tokens: int = 0  # prompt tokens the attempt's admission took from the instance's prefix cache


@dataclass(frozen=True)
class PromptKV:
    """The K/V of an attempt's prompt at the end of its prefill, returned so the front end owns it (it outlives the
    instance): what a migration or a PD hand-off loads elsewhere."""

    request_id: str
    attempt: int
    kv: torch.Tensor  # [L, 2, m, width]


@dataclass(frozen=True)
class LLMPoll:
    """Everything new on an LLM instance since its last poll."""

    tokens: list[TokenReport] = field(default_factory=list)
    prompt_kv: list[PromptKV] = field(default_factory=list)
    kv_events: list[KVEvent] = field(default_factory=list)
    kv_next_seq: int = 0  # the next event number the instance will publish (a lost tail shows here)
    stats: dict[str, float] = field(default_factory=dict)  # its engine's stats and its recent token interval


# ---- the GR wing --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GRInstanceInfo(InstanceInfo):
    mode: Literal["retrieval", "ranking"] = "retrieval"
    vocab_size: int = 0
    catalog_items: int = 0  # retrieval: the catalog it serves …
    catalog_version: int = 0
    catalog: str = ""  # … and its fingerprint
    policy: str = ""  # ranking: the BAT prompt policy, the registry's size and fingerprint, the user cache
    users: int = 0
    items: int = 0
    registry: str = ""
    user_cache_bytes: int = 0
    item_pool_bytes: int = 0  # ranking: its own item pool (0 with KV-cache workers)
    kv_bytes_per_token: int = 0

    @property
    def state(self) -> tuple[str, int]:
        """What must agree between a restarted instance and a live one: the catalog or the registry."""
        return (self.catalog, self.catalog_version) if self.mode == "retrieval" else (self.registry, 0)


@dataclass(frozen=True)
class BatchRun:
    """One batch an instance's engine ran (the front end's batch histograms)."""

    requests: int
    tokens: int


@dataclass(frozen=True)
class GRPoll:
    """Everything new on a retrieval/ranking instance since its last poll."""

    stats: dict[str, float] = field(default_factory=dict)
    batches: list[BatchRun] = field(default_factory=list)
    kv_events: list[KVEvent] = field(default_factory=list)  # ranking: users its BAT user cache gained or lost
    kv_next_seq: int = 0
    users_cached: int = 0


@dataclass(frozen=True)
class CatalogReplace:
    """Retrieval: serve ``catalog`` (a reload) at the front end's ``version`` (None: the instance's next)."""

    catalog: Catalog
    version: int | None = None


@dataclass(frozen=True)
class RegistryUpdate:
    """Ranking: ``kind`` "user": replaced users (their cached KV is dropped); "item": new or replaced items
    (registered, their KV precomputed). ``entries``: (id, identifier tokens)."""

    kind: Literal["user", "item"]
    entries: tuple[tuple[int, np.ndarray], ...]


@dataclass(frozen=True)
class ItemPlacement:
    """Ranking under HRCS (BAT §5.2): the KV-cache workers and which of them hold each item's KV (``placement``: a
    home worker per item, the hot items replicated on all). ``version`` grows with every change; an instance reads
    item KV by the newest it was sent."""

    version: int
    workers: tuple[ActorHandle, ...]
    placement: Placement


@dataclass(frozen=True)
class ItemKV:
    """The KV of items, concatenated in ``item_ids`` order (``kv``: [L, 2, Σ lengths, Hkv, D]): what a KV-cache
    worker stores and answers."""

    item_ids: tuple[int, ...]
    lengths: tuple[int, ...]
    kv: torch.Tensor


StateChange = CatalogReplace | RegistryUpdate | ItemPlacement
