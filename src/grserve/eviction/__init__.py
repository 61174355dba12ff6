"""Cache eviction policies behind one interface (LCR paper): LRU, window-LFU, Belady, FPB, HF, LARU; the online
LightGBM next-access-time predictor; oracle / noisy prediction sources; the reference paging simulator.

Importing the package registers every policy in ``EVICTION_POLICIES`` (``make_policy(name, capacity, ...)``)."""

from grserve.eviction.belady import BeladyPolicy
from grserve.eviction.config import EvictionConfig, LARUConfig, PredictorConfig
from grserve.eviction.fpb import FPBPolicy
from grserve.eviction.hf import HFPolicy
from grserve.eviction.laru import LARUPolicy
from grserve.eviction.leader import DensityPolicy, LeaderPolicy
from grserve.eviction.lfu import WindowLFUPolicy
from grserve.eviction.lru import LRUPolicy
from grserve.eviction.oracle import AccessListOracle, ConstantPredictor, NoisyPredictor, RandomPredictor
from grserve.eviction.policy import (
    EVICTION_POLICIES,
    EvictionPolicy,
    NextAccessPredictor,
    NoEvictableKey,
    make_policy,
    make_policy_from_config,
    policy_names,
)
from grserve.eviction.simulate import SimResult, simulate

__all__ = [
    "EVICTION_POLICIES", "AccessListOracle", "BeladyPolicy", "DensityPolicy", "ConstantPredictor", "EvictionConfig", "EvictionPolicy", "FPBPolicy",
    "HFPolicy", "LARUConfig", "LARUPolicy", "LRUPolicy", "LeaderPolicy", "NextAccessPredictor", "NoEvictableKey", "NoisyPredictor",
    "PredictorConfig", "RandomPredictor", "SimResult", "WindowLFUPolicy", "make_policy", "make_policy_from_config",
    "policy_names", "simulate",
]
