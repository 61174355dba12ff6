"""What the running CPU and torch build can do, checked once: the switch every CPU fast path asks.

grserve's CPU fast paths need things not every machine has: oneDNN's prepacked matmuls (every x86 and most ARM
wheels of torch; not every build), and bf16 oneDNN matmuls (x86 with AVX-512 BW/VL/DQ or AVX-NE-CONVERT, some ARM
CPUs). On a CPU without fast bf16, oneDNN refuses a bf16 weight reorder outright (``mkldnn_reorder_linear_weight:
bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq``), so nothing may assume the
development machine's instruction set. ``cpu_support()`` answers from what torch reports *and* from one small
trial call of each oneDNN op (caught), so a build or CPU that lies or lacks an op falls back instead of crashing.

``GRSERVE_CPU_ISA`` forces a lower level on any machine (tests run a lane under it, ``make test``):

* ``native`` (default): what this CPU and build support;
* ``avx2``: as an x86 CPU with AVX2/FMA and no AVX-512 or AVX-NE-CONVERT: no bf16 oneDNN matmuls (fp32 packing
  stays, as it does there);
* ``reference``: every fast path off -- ``F.linear`` projections, the plain fp32 LM head, no decode staging.

``ONEDNN_MAX_CPU_ISA=AVX2`` (with ``ATEN_CPU_CAPABILITY=avx2``) makes torch itself behave as on such a CPU; the
trial calls see it, so both ways of forcing reach the same paths.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

ENV = "GRSERVE_CPU_ISA"
LEVELS = ("native", "avx2", "reference")


@dataclass(frozen=True)
class CpuSupport:
    cpu_model: str      # e.g. "AMD EPYC 9B14" (/proc/cpuinfo, else platform.processor())
    machine: str        # x86_64, aarch64, ...
    isa: str            # torch's vectorisation level (get_cpu_capability: AVX512, AVX2, DEFAULT, SVE256, ...)
    forced: str         # GRSERVE_CPU_ISA as honoured ("native" when unset)
    onednn: bool        # oneDNN prepacked fp32 matmuls work here (a trial reorder + matmul succeeded)
    onednn_bf16: bool   # bf16 oneDNN matmuls are fast and work here (torch says so and a trial call succeeded)
    reason: str = ""    # why a path is off, for the start line

    @property
    def fast_paths(self) -> bool:
        """False under ``GRSERVE_CPU_ISA=reference``: every optimisation that has a reference path is off."""
        return self.forced != "reference"

    def label(self) -> str:
        """One line naming the machine a number was measured on: ``AMD EPYC 9B14; x86_64, AVX512, bf16``."""
        bf = "bf16" if self.onednn_bf16 else "no fast bf16"
        forced = f", forced {self.forced}" if self.forced != "native" else ""
        return f"{self.cpu_model}; {self.machine}, {self.isa}, {bf}{forced}"

    def to_dict(self) -> dict:
        """The benchmarks' ``"machine"`` field: every number names the CPU it was measured on."""
        return {"cpu": self.label(), "cpu_model": self.cpu_model, "arch": self.machine, "isa": self.isa,
                "forced": self.forced, "onednn": self.onednn, "onednn_bf16": self.onednn_bf16,
                "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def cpu_model_name() -> str:
    """The model name from /proc/cpuinfo, with x86 family/model numbers (a VM often says just "AMD EPYC")."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or fields.get("Model") or fields.get("cpu model")
    if not name:
        return platform.processor() or platform.machine() or "unknown CPU"
    if fields.get("cpu family") and fields.get("model"):
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def forced_level() -> str:
    raw = os.environ.get(ENV, "").strip().lower() or "native"
    if raw == "baseline":
        raw = "reference"
    if raw not in LEVELS:
        raise ValueError(f"{ENV}={raw!r}: expected one of {', '.join(LEVELS)}")
    return raw


def _onednn_ops() -> bool:
    mk = getattr(torch.ops, "mkldnn", None)
    if not (torch.backends.mkldnn.is_available() and mk is not None):
        return False
    try:
        return hasattr(mk, "_reorder_linear_weight") and hasattr(mk, "_linear_pointwise")
    except RuntimeError:  # an op namespace that fails to resolve
        return False


def trial_call(compute, tol: float, disagreement: str) -> str | None:
    """One trial of a fast op: ``compute() -> (got, want)`` runs it and its reference (under inference mode); None
    when it runs and agrees within ``tol`` (relative, and absolute to ``want``'s largest value), else why not: the
    exception it raised, or ``disagreement``."""
    try:
        with torch.inference_mode():
            got, want = compute()
    except Exception as exc:  # noqa: BLE001 -- any failure means: not on this CPU/build
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
        return disagreement
    return None


def _trial(dtype: torch.dtype) -> str | None:
    """One packed matmul in ``dtype`` against F.linear; None when it works and agrees, else why not."""
    def compute():
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=g).to(dtype)
        x = torch.randn(3, 32, generator=g).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").float()
        return got, torch.nn.functional.linear(x.float(), w.float())

    return trial_call(compute, 1e-4 if dtype == torch.float32 else 5e-2, "a trial matmul disagreed with F.linear")


def _bf16_supported() -> bool:
    fn = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(fn()) if fn is not None else False
    except RuntimeError:
        return False


@functools.lru_cache(maxsize=1)
def cpu_support() -> CpuSupport:
    """Detected once per process (``refresh()`` re-reads ``GRSERVE_CPU_ISA``: tests)."""
    forced = forced_level()
    isa = torch.backends.cpu.get_cpu_capability()
    reasons = []
    onednn = bf16 = False
    if forced == "reference":
        reasons.append(f"{ENV}=reference")
    elif not _onednn_ops():
        reasons.append("this torch build has no oneDNN matmul")
    else:
        why = _trial(torch.float32)
        onednn = why is None
        if why:
            reasons.append(f"oneDNN fp32 trial failed ({why})")
        if onednn and forced == "avx2":
            reasons.append(f"{ENV}=avx2")
        elif onednn and not _bf16_supported():
            reasons.append("no fast bf16 on this CPU")
        elif onednn:
            why = _trial(torch.bfloat16)
            bf16 = why is None
            if why:
                reasons.append(f"oneDNN bf16 trial failed ({why})")
    if forced == "avx2" and isa.startswith("AVX512"):
        isa = "AVX2"
    return CpuSupport(cpu_model_name(), platform.machine() or "unknown", isa, forced, onednn, bf16,
                      "; ".join(reasons))


def refresh() -> CpuSupport:
    cpu_support.cache_clear()
    return cpu_support()
