"""The BAT ranking engine: the batching core (``engine/batching.py``) around one ``RankingRunner``.

Batches are formed FIFO by ``GRBatcher`` (one queue: up to ``max_batch_requests`` requests and
``token_capacity`` prompt tokens, a single larger request alone, dispatched at once when the executor is idle)
and run one at a time on one executor thread, so cache decisions and writes stay sequential. Implements
``engine.protocol.Engine``.
"""

from __future__ import annotations

from collections.abc import Callable

from grserve.config import EdgeConfig, RankingConfig, SchedulerConfig
from grserve.engine.batching import BatchedEngine, BatchingCore, admission
from grserve.engine.ranking_runner import RankingRunner
from grserve.ranking.registry import RankingRegistry


def batching_config(cfg: RankingConfig) -> SchedulerConfig:
    """The ranking engine's batch formation: one executor, no waiting quota (a batch leaves when the executor
    is idle or the batch is full)."""
    return SchedulerConfig(token_capacity=cfg.token_capacity, max_batch_requests=cfg.max_batch_requests,
                           wait_quota_fraction=0.0, max_inflight_batches=1)


class RankingEngine(BatchedEngine):
    def __init__(self, runner: RankingRunner, on_batch: Callable[[int, int], None] | None = None,
                 edge: EdgeConfig | None = None):
        self.runner = runner
        self.cfg = runner.cfg
        self._core = BatchingCore(runner.run, batching_config(runner.cfg), "grserve-ranking", on_batch,
                                  **admission(edge))

    @property
    def registry(self) -> RankingRegistry:
        return self.runner.registry

    # ---- the mode's part of the Engine contract ------------------------------------------------------------
    def health_detail(self) -> dict:
        r = self.runner
        return {"policy": r.policy.name, "users": r.registry.num_users, "items": r.registry.num_items}

    def stats(self) -> dict[str, float]:
        return {**self._core.stats(), **{k: v for k, v in self.runner.stats.summary().items()
                                         if isinstance(v, (int, float))}}
