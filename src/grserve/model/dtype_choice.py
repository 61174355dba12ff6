"""``--dtype auto``: the arithmetic this machine computes fastest without changing what users get (issue 42).

``choose_dtype("auto", device)`` → ``(dtype name, reason)``:

- a CUDA device: ``bfloat16`` (every GPU grserve targets has bf16 tensor cores);
- a CPU: ``bfloat16`` when ``model/cpu_support.py`` says oneDNN's bf16 matmul works here (AMX or AVX512-BF16, a
  trial call succeeded) *and* a timed trial shows it faster: one thread, the same ``F.linear``-shaped product
  (64 × 1024 by 1024 × 1024, the width of a serving projection at a decode step's row count) through oneDNN-packed
  weights in fp32 and in bf16, best of 7 each; bf16 must be at least ``MIN_SPEEDUP`` × faster. Else ``float32``:
  an AVX2-only CPU (no fast bf16: oneDNN refuses the bf16 reorder, ``F.linear`` in bf16 is several times slower than
  fp32 there), the reference lane (``GRSERVE_CPU_ISA=reference``: every fast path off), a CPU whose trial says bf16
  is not faster. The reason names which, and is printed on every mode's start line.

The timed trial runs once per process (≈ 0.15–0.4 s on a 2-core EPYC) and is cached; processes started after it
(an engine-core process, local Ray actors) inherit its times through ``GRSERVE_BF16_TRIAL`` and so choose the same;
``refresh()`` forgets it (tests). A name other than ``auto`` is returned as given, with the reason ``"asked for"``.

Scores stay fp32 whatever this picks: the beam search's logits, masked log-softmax and beam scores are fp32 buffers
(``search/beam_search.py``), the staged attention's log-sum-exp merge runs in fp32 (``attention/staged.py``).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

from grserve.model.cpu_support import cpu_support
from grserve.model.thread_choice import torch_threads

AUTO = "auto"
MIN_SPEEDUP = 1.2  # bf16 must beat fp32 by this much in the timed trial to be chosen
TRIAL_SHAPE = (64, 1024, 1024)  # rows, in features, out features
TRIAL_REPEATS = 7
# The trial's two times, handed to the processes this one starts (an engine-core process, local Ray actors), so
# every process of one server makes the same choice: "<fp32 seconds> <bf16 seconds>".
TRIAL_ENV = "GRSERVE_BF16_TRIAL"


@dataclass(frozen=True)
class DtypeChoice:
    name: str     # the dtype actually used: "float32", "bfloat16", ...
    reason: str   # why: "asked for", "auto, CPU computes bf16 4.1x faster than fp32", ...
    asked: str    # what the configuration said ("auto" or a dtype name)

    def label(self, device: str = "") -> str:
        """For start lines: ``bfloat16: auto, CPU computes bf16 4.1x faster than fp32, cpu``."""
        head = f"{self.name}: {self.reason}"
        return f"{head}, {device}" if device else head

    def to_dict(self) -> dict:
        return {"dtype": self.name, "dtype_reason": self.reason, "dtype_asked": self.asked}


def _time_linear(x: torch.Tensor, w: torch.Tensor, packed: bool) -> float:
    if packed:
        from grserve.model.packed_linear import pack_weight, packed_matmul

        pw = pack_weight(w, x.shape[0])

        def call():
            return packed_matmul(x, pw)
    else:
        def call():
            return torch.nn.functional.linear(x, w)
    return best_time(call)


def best_time(call, repeats: int = TRIAL_REPEATS, before=None) -> float:
    """The best wall time of ``repeats`` calls of ``call()``, after one call for kernel selection and caches;
    ``before()``, where given, runs untimed before each timed call."""
    call()
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best


@functools.lru_cache(maxsize=1)
def bf16_speedup() -> tuple[float, float, float]:
    """(fp32 seconds, bf16 seconds, fp32 / bf16) of the timed trial: one thread, best of ``TRIAL_REPEATS``.
    Both through oneDNN-packed weights (the serving path where oneDNN bf16 works), fp32 through ``F.linear`` when
    oneDNN fp32 packing does not work here."""
    inherited = os.environ.get(TRIAL_ENV, "").split()
    if len(inherited) == 2:
        try:
            fp32, bf16 = float(inherited[0]), float(inherited[1])
            if fp32 > 0 and bf16 > 0:
                return fp32, bf16, fp32 / bf16
        except ValueError:
            pass
    m, k, n = TRIAL_SHAPE
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.03
    with torch_threads(1), torch.inference_mode():
        fp32 = _time_linear(x, w, packed=cpu_support().onednn)
        bf16 = _time_linear(x.to(torch.bfloat16), w.to(torch.bfloat16), packed=True)
    os.environ[TRIAL_ENV] = f"{fp32:.9f} {bf16:.9f}"
    return fp32, bf16, fp32 / bf16


def choose_dtype(asked: str, device: str | torch.device = "cpu") -> tuple[str, str]:
    """(dtype name, reason): ``asked`` itself unless it is ``"auto"`` (the module docstring)."""
    c = choice(asked, str(device))
    return c.name, c.reason


def choice(asked: str, device: str = "cpu") -> DtypeChoice:
    """``choose_dtype`` as a ``DtypeChoice`` (the timed trial is run once per process; the rest is cheap)."""
    if asked != AUTO:
        return DtypeChoice(asked, "asked for", asked)
    if str(device).startswith("cuda"):
        return DtypeChoice("bfloat16", "auto, CUDA computes bf16 natively", AUTO)
    s = cpu_support()
    if not s.fast_paths:
        return DtypeChoice("float32", "auto, the reference lane (GRSERVE_CPU_ISA=reference) runs fp32", AUTO)
    if not s.onednn_bf16:
        why = s.reason if s.reason and s.reason != "no fast bf16 on this CPU" else s.isa
        return DtypeChoice("float32", f"auto, no fast bf16 on this CPU ({why})", AUTO)
    try:
        _, _, speedup = bf16_speedup()
    except Exception as exc:  # noqa: BLE001 -- a trial that fails means: not here
        return DtypeChoice("float32", f"auto, the bf16 timed trial failed ({type(exc).__name__})", AUTO)
    if speedup < MIN_SPEEDUP:
        return DtypeChoice("float32", f"auto, bf16 is not faster than fp32 on this CPU (trial: {speedup:.2f}x, "
                                      f"needs {MIN_SPEEDUP}x)", AUTO)
    return DtypeChoice("bfloat16", f"auto, CPU computes bf16 {speedup:.1f}x faster than fp32", AUTO)


def resolve(asked: str, device: str | torch.device = "cpu") -> str:
    """The dtype name to build the model in (``auto`` resolved)."""
    return choice(asked, str(device)).name


def refresh() -> None:
    """Forget the cached timed trial (tests)."""
    os.environ.pop(TRIAL_ENV, None)
    bf16_speedup.cache_clear()
