"""BAT GR ranking: Bipartite Attention prompt layouts (user-as-prefix / item-as-prefix), scoring, the registry."""

from grserve.ranking.layouts import ITEM_PREFIX, USER_PREFIX, BipartitePrompt, build_prompt
from grserve.ranking.registry import RankingRegistry
from grserve.ranking.scoring import RankedCandidates, score_candidates

__all__ = ["USER_PREFIX", "ITEM_PREFIX", "BipartitePrompt", "build_prompt", "RankingRegistry",
           "RankedCandidates", "score_candidates"]
