"""A C++ decode attention kernel for the staging buffer, built for the running CPU at start-up.

A pure decode step attends one query token per request to that request's keys. On the staging buffer
(``decode_staging.py``) this was one SDPA call per layer: torch's CPU flash-attention kernel, whose GEMM blocking
is made for long query blocks and runs a decode step's 1–16 query rows per KV head at a fraction of the CPU's speed
(tiny preset, 32 requests × ~200 keys, one thread, AMD EPYC AVX2: ~0.8 ms a layer; this kernel ~0.35 ms; medium
shape 4.7 → 2.6 ms, and on two threads 2.8 → 1.5 ms). ``decode_kernel.cpp`` computes each (request, KV head) on its own: the group's query heads
against eight keys at a time, an exact-order fp32 softmax (a polynomial ``exp`` of ~1 ulp), the weighted sum of
values in fp32, bf16 outputs rounded once. A request's output therefore depends only on its own keys, never on
what shares the step.

``decode_kernel(group, head_dim, machine, openmp)`` returns the loaded kernel, or None, with what the start line
says of it. The caller (the executor, ``engine/llm.py``) says which machine it is (``machine``: the CPU
model, part of the cache key) and which OpenMP runtime torch loaded (``openmp``: its file, or None), and builds it
only where the CPU fast paths are on (not under ``GRSERVE_CPU_ISA=reference``):

* built with ``$CXX``, else the first of ``c++``/``g++``/``clang++`` on the PATH: ``-O3 -march=native`` on x86
  (``-mno-avx512f`` where torch runs at AVX2: the test lane that holds an AVX-512 machine to AVX2 gets AVX2 code),
  ``-mcpu=native`` on ARM; its loop over (request, KV head) is an OpenMP loop linked against the runtime torch
  loaded (``model/thread_choice.py``), so it runs on torch's pool of threads, never a second one (compiled and
  linked apart: ``-fopenmp`` at the link would add the system's runtime). About a second; cached across restarts
  in ``$GRSERVE_CACHE_DIR/kernels/`` under a hash of the source, flags, compiler, runtime and CPU model;
* checked once against SDPA (fp32 and bf16, key counts 1–70, one- and multi-block rows) before first use;
* None — and SDPA stays — when there is no compiler, the build or the check fails,
  or the shape is outside what it was written for (head dim a multiple of 8, at most 256; at most 16 query heads
  per KV head).

Each (request, KV head) is one iteration of the loop, whole on one thread, so the output has the same bits on any
number of threads. Where torch's OpenMP runtime is not found (not Linux) the kernel is built serial and takes only
steps on one torch thread; SDPA splits the others over torch's threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


SOURCE = Path(__file__).with_name("decode_kernel.cpp")
MAX_HEAD_DIM = 256
MAX_GROUP = 16


def compiler() -> str | None:
    """The C++ compiler: ``$CXX`` (else ``c++``) if on the PATH, else ``g++``, else ``clang++`` (the same search as
    ``--decode-compile``'s, ``model/decode_compile.py``)."""
    return next((p for p in map(shutil.which, (os.environ.get("CXX") or "c++", "g++", "clang++")) if p), None)


def isa_flags() -> list[str]:
    """Code for this CPU, held to AVX2 where torch is (``ATEN_CPU_CAPABILITY=avx2``: the AVX2 test lane)."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686"):
        flags = ["-march=native"]
        if not torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512"):
            flags.append("-mno-avx512f")
        return flags
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    return []


def cache_root() -> Path:
    return Path(os.environ.get("GRSERVE_CACHE_DIR") or ".grserve-cache") / "kernels"


def _build(cxx: str, group: int, head_dim: int, openmp: str | None, machine: str = "") -> tuple[Path, bool]:
    """Compile (or find in the cache) the kernel for one shape, its parallel loop linked against ``openmp`` (the
    runtime torch loaded: one pool of threads with torch's) or, without one, serial. Returns the shared library's
    path and whether it was found in the cache."""
    flags = ["-O3", "-std=c++17", "-fPIC", "-Wno-unknown-pragmas", *isa_flags(), f"-DGROUP={group}",
             f"-DHEAD_DIM={head_dim}", *(["-fopenmp"] if openmp else [])]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cxx, version, *flags, openmp or "serial",
                                    machine]).encode()).hexdigest()[:20]
    out = cache_root() / f"decode_attend_g{group}_d{head_dim}_{key}.so"
    if out.exists():
        return out, True
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, part = Path(tmp) / "kernel.o", Path(tmp) / out.name
        # compiled and linked apart: linking with -fopenmp would add the system's libgomp, a second runtime
        for cmd in ([cxx, *flags, "-c", str(SOURCE), "-o", str(obj)],
                    [cxx, "-shared", str(obj), *([openmp] if openmp else []), "-o", str(part)]):
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if run.returncode != 0:
                raise RuntimeError(f"{Path(cxx).name} failed: {run.stderr.strip()[-300:]}")
        os.replace(part, out)  # atomic: a concurrent start sees no file or the whole new one
    return out, False


class KeyLengths:
    """Keys per request for ``DecodeKernel.attend``, checked once (each ≥ 1) and held in a private int64 copy, so
    the bound the C++ side relies on cannot change under it; a step builds one for all its layers."""

    def __init__(self, lens: torch.Tensor):
        self._t = lens.detach().to(torch.int64, copy=True).contiguous().reshape(-1)
        self.count = self._t.numel()
        self.longest = int(self._t.max()) if self.count else 0
        if self.count and int(self._t.min()) < 1:
            raise ValueError("lens must lie in [1, T]: got a request with no keys")
        self.data_ptr = self._t.data_ptr()


class DecodeKernel:
    """The loaded kernel for one (group, head_dim); ``parallel``: its loop runs on torch's OpenMP threads."""

    def __init__(self, path: Path, group: int, head_dim: int, seconds: float, cached: bool, parallel: bool):
        lib = ctypes.CDLL(str(path))
        self.group, self.head_dim, self.seconds, self.cached = group, head_dim, seconds, cached
        self.parallel, self.scale = parallel, head_dim ** -0.5
        p, i = ctypes.c_void_p, ctypes.c_int64
        self._fns = {}
        for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            fn = getattr(lib, f"grserve_decode_attend_{name}")
            fn.argtypes = [p] * 5 + [i] * 8 + [ctypes.c_float, i]
            fn.restype = None
            self._fns[dtype] = fn
        for name, want in (("group", group), ("head_dim", head_dim)):
            fn = getattr(lib, f"grserve_decode_attend_{name}")
            fn.restype = ctypes.c_int64
            if fn() != want:
                raise RuntimeError(f"library built for another {name}")
        self._lib = lib

    def accepts(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether a call on these tensors runs here: fp32 or bf16 on a CPU, one dtype, and a serial build only on
        a step of one torch thread (SDPA splits over more)."""
        return (q.dtype in self._fns and k.dtype == q.dtype and q.device.type == "cpu"
                and (self.parallel or torch.get_num_threads() == 1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               lens: torch.Tensor | KeyLengths) -> torch.Tensor:
        """q [S, Hkv, G, d]; k, v [S, Hkv, T, d] (any strides with a unit last one); lens [S], each in [1, T]:
        request s attends to its first lens[s] keys (a ``KeyLengths`` checks them once for a step's layers).
        Returns [S, Hkv, G, d] in q's dtype, computed on torch's current number of threads (the same bits on any
        number)."""
        s, h, g, d = q.shape
        if not isinstance(lens, KeyLengths):
            lens = KeyLengths(lens)
        if (g != self.group or d != self.head_dim or k.shape[:2] != (s, h) or v.shape[:2] != (s, h)
                or k.shape[3] != d or v.shape[3] != d or k.stride(-1) != 1 or v.stride(-1) != 1
                or lens.count != s):
            raise ValueError(f"kernel for group {self.group}, head dim {self.head_dim}: q {tuple(q.shape)}, k "
                             f"{tuple(k.shape)}, v {tuple(v.shape)} (unit last strides), {lens.count} lens")
        if lens.longest > min(k.shape[2], v.shape[2]):  # the C++ side reads lens[s] keys: never past the tensors
            raise ValueError(f"lens must lie in [1, {min(k.shape[2], v.shape[2])}]: got {lens.longest}")
        if not q.is_contiguous():
            q = q.contiguous()
        o = torch.empty_like(q)
        ks, vs = k.stride(), v.stride()
        self._fns[q.dtype](q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lens.data_ptr, s, h,
                           ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], self.scale,
                           torch.get_num_threads() if self.parallel else 1)
        return o

    def describe(self) -> str:
        how = "from the cache" if self.cached else f"built in {self.seconds:.1f} s"
        where = "on torch's OpenMP threads" if self.parallel else "serial: SDPA on steps of more than one thread"
        return f"C++ decode kernel (group {self.group}, head dim {self.head_dim}, {where}, {how})"


def reference_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, by SDPA with a key mask (the staged path without the kernel)."""
    t = k.shape[2]
    mask = (torch.arange(t)[None, :] < lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def check(kernel: DecodeKernel, seed: int = 0) -> str | None:
    """The kernel against ``reference_attend`` on random rows (fp32 and bf16); None when it agrees, else why."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([1, 7, 8, 9, 16, 33, 70])
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(len(lens), 2, kernel.group, kernel.head_dim, generator=g).to(dtype)
        k = torch.randn(len(lens), 2, 72, kernel.head_dim, generator=g).to(dtype)
        v = torch.randn(len(lens), 2, 72, kernel.head_dim, generator=g).to(dtype)
        got = kernel.attend(q, k, v, lens).float()  # lens: int64 (torch.tensor of ints)
        want = reference_attend(q.float(), k.float(), v.float(), lens)
        err = float((got - want).abs().max())
        if not err <= tol:
            return f"disagrees with SDPA ({dtype}: max |diff| {err:.2e} > {tol})"
    return None


@functools.cache
def decode_kernel(group: int, head_dim: int, machine: str, openmp: str | None) -> tuple[DecodeKernel | None, str]:
    """The checked kernel for this shape on this machine (``machine``: the CPU model; ``openmp``: the file of the
    OpenMP runtime torch loaded, None: a serial build), or None; and what the start line says of it (why not)."""
    if head_dim % 8 or head_dim > MAX_HEAD_DIM or not 1 <= group <= MAX_GROUP:
        return None, f"no kernel for group {group}, head dim {head_dim}"
    cxx = compiler()
    if cxx is None:
        return None, "no C++ compiler"
    start = time.perf_counter()
    try:
        path, cached = _build(cxx, group, head_dim, openmp, machine)
        kernel = DecodeKernel(path, group, head_dim, time.perf_counter() - start, cached, openmp is not None)
        why = check(kernel)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        why = str(e)
    if why is not None:
        return None, f"SDPA (the C++ kernel: {why})"
    return kernel, kernel.describe()
