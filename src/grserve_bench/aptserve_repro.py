"""Apt-Serve at paper scale, reproduced (issue 17): the paper's setting rebuilt piece by piece, Tables 4 and 5,
and effective throughput at 90 % / 60 % attainment — all in the discrete-event simulator (OPT-13B, one A100).

The pieces (each a field of ``Setting``; docs/llm.md has the numbers and where they come from):
- ``lengths``: ``"vllm"`` = ShareGPT / HumanEval / LongBench with the authors' filter (``llm_workloads``);
  ``"pre17"`` = the ShareGPT model before issue 17 (outputs ≈ 1.5× too long);
- ``num_blocks``: KV memory of OPT-13B on one A100-40GB at vLLM's 0.9 utilisation (``kv_blocks_opt13b_a100``);
- ``watermark``: vLLM 0.5's block-manager watermark for FCFS admission (1 %);
- ``strict``: the authors' client counts a request iff TTFT < SLO and P99 < SLO (strictly);
- ``cost``: the iteration-time model (``simulator.CostModel.preset``: linear | roofline | physical);
- ``pending``: Apt-Serve's pending-time rule (last_token = the paper's words; last_scheduled = ours);
- ``eos_scale``: 1 = outputs run to their reference length (max_tokens, ignore EOS); < 1 models the authors'
  client, which does not ignore EOS: each output ends early with probability 1 − eos_scale, at a uniform point.

Deterministic: every trace is seeded (lengths by ``seed``, arrivals by ``seed``), results are cached per point.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from grserve_bench.llm_workloads import (
    LENGTH_DISTRIBUTIONS,
    SHAREGPT_PRE17,
    TraceItem,
    attainment,
    effective_throughput,
    make_trace,
)

TABLE3 = {"sharegpt": (1.0, 1.0), "humaneval": (0.5, 0.5), "longbench": (4.0, 1.0)}  # (TTFT, P99 TBT) seconds

# The paper's Table 4 (KV-only vs hybrid, adaptive) and Table 5 (FCFS vs adaptive, hybrid): (dataset, rate, CV)
PAPER_TABLE4 = {("sharegpt", 3, 1): (99.5, 99.5), ("sharegpt", 3, 5): (94.7, 95.9), ("sharegpt", 3, 10): (75.1, 78.2),
                ("sharegpt", 6, 1): (65.7, 67.3), ("sharegpt", 6, 5): (66.7, 67.7), ("sharegpt", 6, 10): (57.1, 58.4),
                ("longbench", 1.5, 1): (96.6, 98.2), ("longbench", 1.5, 5): (70.0, 76.0),
                ("longbench", 1.5, 10): (43.4, 50.8), ("longbench", 3, 1): (70.0, 77.6),
                ("longbench", 3, 5): (58.8, 64.8), ("longbench", 3, 10): (35.6, 42.5)}
PAPER_TABLE5_FCFS = {("sharegpt", 3, 1): 26.4, ("sharegpt", 3, 5): 59.7, ("sharegpt", 3, 10): 11.9,
                     ("sharegpt", 6, 1): 20.0, ("sharegpt", 6, 5): 18.1, ("sharegpt", 6, 10): 9.9,
                     ("longbench", 1.5, 1): 11.8, ("longbench", 1.5, 5): 10.8, ("longbench", 1.5, 10): 5.4,
                     ("longbench", 3, 1): 4.8, ("longbench", 3, 5): 4.6, ("longbench", 3, 10): 4.2}
# §6.3: Apt-Serve's sustainable rate ÷ vLLM's / Sarathi-Serve's, averaged over the three OPT models
PAPER_GAIN = {"sharegpt": {0.9: (2.3, 2.0), 0.6: (7.4, 6.8)}, "humaneval": {0.9: (1.7, 1.4), 0.6: (3.0, 2.6)},
              "longbench": {0.9: (2.8, 2.5), 0.6: (4.2, 3.9)}}

# rate grids (req/s) for the effective-throughput search; each system's crossings are then bisected
GRIDS = {"sharegpt": (1, 2, 3, 4, 5, 6, 8, 12), "humaneval": (2, 4, 6, 8, 10, 12, 16, 24),
         "longbench": (0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4)}


def kv_blocks_opt13b_a100(*, gpu_bytes: float = 42_505_273_344, utilization: float = 0.9,
                          weight_bytes: float = 26e9, other_bytes: float = 0.75e9, block_size: int = 16) -> int:
    """Blocks of one plane (K or V) for ``block_size`` tokens that fit the KV memory vLLM leaves on an A100-40GB:
    utilisation × the device's 39.59 GiB − the 26 GB of OPT-13B weights (Table 2) − the profiling peak of
    activations and the CUDA context (≈ 0.75 GB, our estimate), at 819,200 bytes of K+V per token
    (2 · 40 layers · 5120 · fp16). 11.5 GB → 14,038 tokens → 1,754 planes of 16 tokens."""
    kv = utilization * gpu_bytes - weight_bytes - other_bytes
    tokens = int(kv // (2 * 40 * 5120 * 2))
    return 2 * (tokens // block_size)


@dataclass(frozen=True)
class Setting:
    lengths: str = "vllm"
    num_blocks: int = kv_blocks_opt13b_a100()
    watermark: float = 0.01
    strict: bool = True
    cost: str = "physical"
    pending: str = "last_scheduled"
    eos_scale: float = 1.0
    num_requests: int = 500
    seed: int = 0

    def replace(self, **kw) -> "Setting":
        return dataclasses.replace(self, **kw)


# Before issue 17 (session 3 of docs/llm.md): its lengths, 1,625 blocks, no watermark, ≤ rule, linear costs,
# Apt-Serve's pending time as the paper words it
BEFORE = Setting(lengths="pre17", num_blocks=1625, watermark=0.0, strict=False, cost="linear",
                 pending="last_token")


def policy(system: str, s: Setting) -> tuple[str, dict]:
    """A system name of the tables → (registered policy, its keyword arguments)."""
    return {"fcfs": ("fcfs", {"watermark": s.watermark}),
            "fcfs-hybrid": ("fcfs", {"watermark": s.watermark, "cache": "hybrid"}),
            "chunked": ("chunked", {"token_budget": 512}),
            "aptserve": ("aptserve", {"pending": s.pending}),
            "aptserve-kv": ("aptserve-kv", {"pending": s.pending})}[system]


def trace_for(s: Setting, dataset: str, rate: float, cv: float) -> list[TraceItem]:
    lengths = SHAREGPT_PRE17 if (s.lengths == "pre17" and dataset == "sharegpt") else None
    trace = make_trace(dataset, s.num_requests, rate, cv=cv, seed=s.seed, lengths=lengths)
    if s.eos_scale < 1.0:  # early EOS: a seeded, rate-independent cut of each output
        rng = np.random.default_rng(s.seed + 104729)
        cut = rng.random(len(trace)) > s.eos_scale
        frac = rng.random(len(trace))
        trace = [TraceItem(t.arrival, t.prompt_len, max(1, int(t.output_len * f)) if c else t.output_len)
                 for t, c, f in zip(trace, cut, frac)]
    return trace


_SOURCES = ("grserve_bench/aptserve_repro.py", "grserve_bench/simulator.py", "grserve_bench/llm_workloads.py",
            "grserve/engine/llm.py", "grserve/kvcache/blocks.py", "grserve/scheduler/aptserve.py",
            "grserve/scheduler/fcfs.py", "grserve/scheduler/chunked.py", "grserve/scheduler/knapsack.py",
            "grserve/scheduler/llm_types.py")


def code_version() -> str:
    """Hash of the sources a simulation point depends on (a disk-cached point is reused only by the same code)."""
    import grserve

    roots = {"grserve": Path(grserve.__file__).resolve().parent, "grserve_bench": Path(__file__).resolve().parent}
    h = hashlib.sha1()
    for rel in _SOURCES:
        package, _, path = rel.partition("/")
        h.update((roots[package] / path).read_bytes())
    return h.hexdigest()[:16]


class Runner:
    """Runs and caches simulation points: (setting, dataset, system, rate, CV) → attainment dict. With
    ``cache_dir`` the points are also kept on disk (one small JSON file per point, keyed by the point and
    ``code_version()``), so ``bench serve``'s real run reuses what ``--paper-tables`` computed."""

    def __init__(self, progress=None, cache_dir: str | Path | None = None):
        self.cache: dict = {}
        self.progress = progress
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._version = code_version() if cache_dir is not None else ""

    def _disk(self, key) -> Path | None:
        if self.cache_dir is None:
            return None
        s, *rest = key
        text = json.dumps([dataclasses.asdict(s), *rest, self._version])
        return self.cache_dir / f"{hashlib.sha1(text.encode()).hexdigest()[:20]}.json"

    def point(self, s: Setting, dataset: str, system: str, rate: float, cv: float = 1.0) -> dict:
        key = (s, dataset, system, round(rate, 6), cv)
        path = self._disk(key)
        if key not in self.cache and path is not None and path.exists():
            self.cache[key] = json.loads(path.read_text())
        if key not in self.cache:
            from grserve_bench.simulator import CostModel, simulate

            cost = CostModel.preset(s.cost)
            name, kw = policy(system, s)
            ttft, tbt = TABLE3[dataset]
            res = simulate(trace_for(s, dataset, rate, cv), name, cost, num_blocks=s.num_blocks, ttft_slo=ttft,
                           tbt_slo=tbt, **kw)
            a = attainment(res.requests, ttft, tbt, strict=s.strict)
            a.update(preemptions=res.stats["preemptions"], hidden_scheduled=res.stats["hidden_scheduled"])
            self.cache[key] = a
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(a))
                tmp.replace(path)
            if self.progress is not None:
                self.progress()
        return self.cache[key]

    def crossings(self, s: Setting, dataset: str, system: str, levels=(0.9, 0.6), steps: int = 3,
                  cv: float = 1.0) -> dict[float, float]:
        """Effective throughput at each level: the rate grid (stopping once attainment is below every level),
        then ``steps`` bisections of each level's first crossing; linear interpolation in the final bracket."""
        pts: dict[float, float] = {}
        for r in GRIDS[dataset]:
            pts[r] = self.point(s, dataset, system, r, cv)["attainment"]
            if pts[r] < min(levels) - 0.05:
                break
        out = {}
        for level in levels:
            rates = sorted(pts)
            lo = hi = None
            for a, b in zip(rates, rates[1:]):
                if pts[a] >= level > pts[b]:
                    lo, hi = a, b
                    break
            for _ in range(steps if lo is not None else 0):
                mid = round((lo + hi) / 2, 4)
                pts[mid] = self.point(s, dataset, system, mid, cv)["attainment"]
                lo, hi = (mid, hi) if pts[mid] >= level else (lo, mid)
            rates = sorted(pts)
            out[level] = effective_throughput(rates, [pts[r] for r in rates], level)
        return out


# ---------------------------------------------------------------------------------------------- the ladder
LADDER = (
    ("before issue 17 (session 3)", {}),
    ("+ ShareGPT lengths of vLLM's filter (outputs mean 197, was ≈ 300)", {"lengths": "vllm"}),
    ("+ KV memory of OPT-13B / A100-40GB at 0.9 (1,754 planes, was 1,625)", {"num_blocks": kv_blocks_opt13b_a100()}),
    ("+ vLLM 0.5 FCFS watermark (1 %)", {"watermark": 0.01}),
    ("+ the client's rule (TTFT < SLO and P99 < SLO)", {"strict": True}),
    ("+ cost shape: roofline slopes, same 120 ms anchor", {"cost": "roofline"}),
    ("+ cost: A100 roofline, no anchor (≈ 41 ms @ 50)", {"cost": "physical"}),
    ("+ Apt-Serve pending time since last scheduling", {"pending": "last_scheduled"}),
)
ALTERNATIVES = (
    ("alt: linear 120 ms anchor, with the final rest", {"cost": "linear"}),
    ("alt: 120 ms anchor + early EOS (half the outputs end early)", {"cost": "roofline", "eos_scale": 0.5}),
)


def ladder(runner: Runner, systems=("fcfs", "chunked", "aptserve"), dataset: str = "sharegpt",
           steps: int = 3) -> list[dict]:
    """Each piece applied on top of the previous ones (then two alternatives to the final setting): effective
    throughput at 90 % (and 60 %) on ``dataset``, Poisson."""
    rows, s = [], BEFORE
    for label, change in LADDER:
        s = s.replace(**change)
        rows.append({"piece": label, "setting": dataclasses.asdict(s),
                     "eff": {x: runner.crossings(s, dataset, x, steps=steps) for x in systems}})
    final = s
    for label, change in ALTERNATIVES:
        a = final.replace(**change)
        rows.append({"piece": label, "setting": dataclasses.asdict(a),
                     "eff": {x: runner.crossings(a, dataset, x, steps=steps) for x in systems}})
    return rows


def ablation_tables(runner: Runner, s: Setting) -> list[dict]:
    """Tables 4 and 5 in shape: each (dataset, rate, CV) row with ours and the paper's attainment (%)."""
    rows = []
    for (ds, rate, cv), (p_kv, p_hybrid) in PAPER_TABLE4.items():
        ours = {x: 100 * runner.point(s, ds, x, rate, cv)["attainment"]
                for x in ("fcfs-hybrid", "aptserve", "aptserve-kv", "fcfs")}
        rows.append({"dataset": ds, "rate": rate, "cv": cv, "ours": ours,
                     "paper": {"fcfs-hybrid": PAPER_TABLE5_FCFS[(ds, rate, cv)], "aptserve": p_hybrid,
                               "aptserve-kv": p_kv}})
    return rows


def effective_table(runner: Runner, s: Setting, systems=("fcfs", "chunked", "aptserve"),
                    datasets=("sharegpt", "humaneval", "longbench"), steps: int = 3, levels=(0.9, 0.6)) -> dict:
    """{dataset: {system: {level: rate}}}."""
    return {ds: {x: runner.crossings(s, ds, x, levels=levels, steps=steps) for x in systems} for ds in datasets}


def datasets() -> list[str]:
    return LENGTH_DISTRIBUTIONS.names()
