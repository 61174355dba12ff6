"""The offline side of the LCR experiments: policies that read the future or exist only as baselines (Belady / OPT,
FPB, HF), the next-access oracles and noisy prediction sources, the reference paging loop, the prefix-path replay of
``bench cache --trace-file`` and the set-associative embedding cache of the DLRM traces.

Importing the package registers Belady, FPB and HF in grserve's ``EVICTION_POLICIES`` beside the serving policies,
so ``make_policy("belady", k, oracle=...)`` works wherever the lab is loaded."""

from grserve_bench.eviction.belady import BeladyPolicy
from grserve_bench.eviction.fpb import FPBPolicy
from grserve_bench.eviction.hf import HFPolicy
from grserve_bench.eviction.oracle import AccessListOracle, ConstantPredictor, NoisyPredictor, RandomPredictor
from grserve_bench.eviction.simulate import SimResult, simulate

__all__ = [
    "AccessListOracle", "BeladyPolicy", "ConstantPredictor", "FPBPolicy", "HFPolicy", "NoisyPredictor",
    "RandomPredictor", "SimResult", "simulate",
]
