"""The ranking users and items a server starts with (``RankingDataConfig``): loaded from JSON-lines files, or a
generated workload. Shared by the single-process ranking server and the cluster's ranking instances."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grserve.flags import split_commas

if TYPE_CHECKING:
    from grserve.ranking.registry import RankingRegistry


def build_registry(data: Any, vocab_size: int) -> "RankingRegistry":
    """``data``: a ``RankingDataConfig`` (items_file, users_file, instruction, num_items, num_users, scale, seed)."""
    import numpy as np

    from grserve.ranking.registry import RankingRegistry
    from grserve.ranking.workload import WorkloadSpec, synthetic_population

    if data.items_file or data.users_file:
        if data.instruction:
            instr = split_commas(data.instruction, int)
        else:
            instr = np.random.default_rng(data.seed).integers(16, vocab_size, size=4).tolist()
        reg = RankingRegistry(vocab_size, instr)
        if data.items_file:
            reg.load_jsonl(data.items_file, "item")
        if data.users_file:
            reg.load_jsonl(data.users_file, "user")
        return reg
    return synthetic_population(WorkloadSpec(num_items=data.num_items, num_users=data.num_users, scale=data.scale,
                                             seed=data.seed), vocab_size).registry
