"""Fault recovery (xLLM §3.5 "fast request migration"): every request a dead instance held finishes elsewhere.

The front end journals each request (``RequestRecord``): prompt, sampling parameters, the tokens delivered so far
(``stream.TokenStream``), the instance and attempt it runs on, and — when the instance handed one over — a KV
snapshot of its prompt (returned by the instance's poll, so the front end owns it and it survives the instance:
an object an actor ``ray.put``s itself would die with it). When the instance dies, ``plan`` picks per request:

- **migrate**: a snapshot of ``m`` tokens exists and copying it is cheaper than recomputing them — the new
  instance loads the snapshot into its prefix cache and computes only prompt + generated beyond ``m``;
- **recompute**: otherwise — the new instance prefills prompt + generated tokens from scratch.

Either way the new attempt's prompt is prompt + tokens already delivered and its budget is ``max_tokens`` minus
them, so the client's stream continues at the next position (greedy decoding gives the same tokens; seeded
sampling does once draws depend on (seed, position) only). A request moved more than ``migration_limit`` times
fails with ``RequestLost`` (HTTP 503). Cost model: seconds = tokens / ``prefill_tokens_per_s`` + bytes /
``kv_bytes_per_s`` (constants, not profiled).

Still lost: the front end itself — the journal, the snapshots and the open client connections live in its process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from grserve.engine.protocol import EngineError

if TYPE_CHECKING:
    import torch


class RequestLost(EngineError):
    """The request could not be finished: its instance died more often than the migration limit allows, or no
    instance is left (HTTP 503)."""

    http_status = 503
    error_type = "request_lost"


@dataclass(frozen=True)
class RecoveryCost:
    prefill_tokens_per_s: float = 20_000.0
    kv_bytes_per_s: float = 2e9

    def recompute(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def migrate(self, tokens: int, snapshot_tokens: int, snapshot_bytes: int) -> float:
        return snapshot_bytes / self.kv_bytes_per_s + (tokens - snapshot_tokens) / self.prefill_tokens_per_s


class Movable(Protocol):
    """What a plan reads of a request's journal entry (``llm/journal.py``'s ``RequestRecord``)."""

    migrations: int
    snapshot: torch.Tensor | None

    @property
    def resume_tokens(self) -> int: ...


@dataclass(frozen=True)
class RecoveryPlan:
    action: Literal["migrate", "recompute", "fail"]
    snapshot_tokens: int = 0  # migrate: the K/V of the first this many tokens goes with it
    reason: str = ""


def limit_reached(moves: int, migration_limit: int) -> str | None:
    """Why a request whose instance died once more is lost (``moves`` so far), or None while it may move again: the
    one migration limit of both wings."""
    if moves >= migration_limit:
        return f"its instance died {moves + 1} times (migration limit {migration_limit})"
    return None


def plan(record: Movable, migration_limit: int, cost: RecoveryCost = RecoveryCost()) -> RecoveryPlan:
    """What to do with a request whose instance died (the caller then routes it and resubmits)."""
    lost = limit_reached(record.migrations, migration_limit)
    if lost is not None:
        return RecoveryPlan("fail", reason=lost)
    n = record.resume_tokens
    snap = record.snapshot
    if snap is not None and snap.shape[2] > 0:
        m = min(int(snap.shape[2]), n - 1)
        nbytes = snap[:, :, :m].numel() * snap.element_size()
        if cost.migrate(n, m, nbytes) < cost.recompute(n):
            return RecoveryPlan("migrate", m)
    return RecoveryPlan("recompute")
