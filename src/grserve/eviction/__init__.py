"""Cache eviction policies behind one interface (LCR paper): LRU, window-LFU, LARU with the online LightGBM
next-access-time predictor, and ``density`` / ``leader`` — the policies a serving flag can select
(``config.PREFIX_CACHE_POLICIES``). The offline ones (Belady, FPB, HF, oracles) and the trace simulators are in the
lab package (``grserve_bench.eviction``), which registers them in the same ``EVICTION_POLICIES``.

Importing the package registers its policies in ``EVICTION_POLICIES`` (``make_policy(name, capacity, ...)``)."""

from grserve.eviction.config import PredictorConfig
from grserve.eviction.laru import LARUPolicy
from grserve.eviction.leader import DensityPolicy, LeaderPolicy
from grserve.eviction.lfu import WindowLFUPolicy
from grserve.eviction.lru import LRUPolicy
from grserve.eviction.policy import (
    EVICTION_POLICIES,
    EvictionPolicy,
    NextAccessPredictor,
    NoEvictableKey,
    make_policy,
    policy_names,
)

__all__ = [
    "EVICTION_POLICIES", "DensityPolicy", "EvictionPolicy", "LARUPolicy", "LRUPolicy", "LeaderPolicy",
    "NextAccessPredictor", "NoEvictableKey", "PredictorConfig", "WindowLFUPolicy", "make_policy", "policy_names",
]
