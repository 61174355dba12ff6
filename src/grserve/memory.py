"""What keeps a long-running engine process's memory flat (issue 41; the soaks are in ``docs/reliability.md``).

Two things grew the engine process of a server whose batches vary in shape (retrieval: histories of 4-300 tokens at
beam widths 8-64; the LLM: prompts and batches of every length):

- **oneDNN's kernel caches.** The packed projections (``model/packed_linear.py``) run oneDNN matmuls, and a oneDNN
  kernel is made, and kept, per GEMM shape, i.e. per token count M of a call: in oneDNN's primitive cache
  (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and in ideep's computation cache inside torch (``LRU_CACHE_CAPACITY``),
  1,024 entries each by default, ~280 KiB an entry for the ``tiny`` model. Both fill as new batch sizes come, over
  many minutes: up to ~560 MiB (the issue's soak: 1,446 -> 2,000 MiB). ``bound_onednn_caches`` sets both to
  ``--onednn-cache-capacity`` (128): the shapes that repeat (decode steps) stay cached, a miss costs less than the
  memory traffic of the big caches (``docs/reliability.md``, the micro-benchmark).
- **glibc's malloc.** PyTorch's CPU allocator does not cache: every tensor is a ``posix_memalign`` / ``free``. glibc
  keeps what it frees, in up to 8 arenas per core (one per thread that met a locked arena), and raises its ``mmap``
  threshold to the size of every large block freed (up to 32 MiB), so large tensors come from the arenas too. One
  ``malloc_trim(0)`` of a loaded retrieval engine process gave back 420 MiB of 1,589. ``limit_arenas``
  (``--malloc-arena-max`` 2) and ``MallocTrimmer`` (``malloc_trim(0)``, which also returns the free pages inside
  every arena, every ``--malloc-trim-s`` 10 s on a daemon thread) keep the freed memory from piling up.

Nothing to install (ctypes into the C library); on a C library without ``malloc_trim`` / ``mallopt`` (musl, macOS)
those two do nothing. ``settle_allocator`` applies all three from a ``ProcessConfig``: first thing in the engine-core
process (``engine_core/core_process.py``), and on the in-process paths before the engine is built.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time
from dataclasses import dataclass, field


M_ARENA_MAX = -8  # glibc's mallopt parameter
DEFAULT_ARENA_MAX = 2  # ProcessConfig's defaults, for a caller without one
DEFAULT_TRIM_S = 10.0
DEFAULT_ONEDNN_CACHE = 128


def _libc_function(name: str, argtypes: list):
    """A glibc function (``malloc_trim``, ``mallopt``), or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def _libc_malloc_trim():
    return _libc_function("malloc_trim", [ctypes.c_size_t])


def limit_arenas(n: int) -> bool:
    """At most ``n`` malloc arenas from now on (glibc's ``mallopt(M_ARENA_MAX, n)``; its default is 8 per core,
    each arena holding its own freed memory). Not applied when ``n`` is 0 or the environment sets
    ``MALLOC_ARENA_MAX`` (the user's choice wins). True when applied."""
    if n <= 0 or "MALLOC_ARENA_MAX" in os.environ:
        return False
    fn = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    return bool(fn is not None and fn(M_ARENA_MAX, n))


@dataclass
class TrimStats:
    calls: int = 0
    released: int = 0  # calls that gave memory back (malloc_trim returned 1)
    total_s: float = 0.0
    max_s: float = 0.0
    last: float = field(default=0.0)  # monotonic time of the last call

    def to_dict(self) -> dict:
        return {"calls": self.calls, "released": self.released, "total_ms": round(1e3 * self.total_s, 1),
                "max_ms": round(1e3 * self.max_s, 2)}


class MallocTrimmer:
    """``malloc_trim(0)`` every ``interval_s`` seconds on a daemon thread; ``stop()`` ends it."""

    def __init__(self, interval_s: float, trim=None):
        self.interval_s = interval_s
        self._trim = trim if trim is not None else _libc_malloc_trim()
        self.stats = TrimStats()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self._trim is not None

    def trim_once(self) -> bool:
        """One ``malloc_trim(0)``; True when memory went back to the OS."""
        if self._trim is None:
            return False
        t = time.perf_counter()
        gave = bool(self._trim(0))
        dt = time.perf_counter() - t
        s = self.stats
        s.calls += 1
        s.released += gave
        s.total_s += dt
        s.max_s = max(s.max_s, dt)
        s.last = time.monotonic()
        return gave

    def start(self) -> MallocTrimmer:
        if self.available and self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="grserve-malloc-trim", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.trim_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def start_trimmer(interval_s: float) -> MallocTrimmer:
    """A started trimmer (a no-op one when ``interval_s`` is 0 or the C library has no ``malloc_trim``)."""
    return MallocTrimmer(interval_s).start()


def bound_onednn_caches(n: int) -> dict[str, str]:
    """At most ``n`` entries in each of the two caches of oneDNN kernels a CPU engine fills, one per GEMM shape:
    oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's computation cache in torch
    (``LRU_CACHE_CAPACITY``). Both default to 1,024 entries; the packed projections (``model/packed_linear.py``)
    make one per token count M of a call, and an entry of the ``tiny`` model's takes about 280 KiB: a server
    whose batches have ever more distinct token counts grows by up to ~560 MiB over many minutes (issue 41).
    Set through the environment, which both read when their cache is first used: call this before the process's
    first oneDNN call. A variable the user set wins; ``n`` = 0 changes nothing. Returns what was set."""
    if n <= 0:
        return {}
    out = {}
    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        if var not in os.environ:
            os.environ[var] = out[var] = str(n)
    return out


def settle_allocator(process: object | None) -> MallocTrimmer:
    """An engine process's memory settings, from its ``ProcessConfig`` (``--onednn-cache-capacity``,
    ``--malloc-arena-max``, ``--malloc-trim-s``; their defaults when ``process`` is None): call it first thing,
    before the engine's threads and its first oneDNN call. Returns the started trimmer."""
    bound_onednn_caches(getattr(process, "onednn_cache_capacity", DEFAULT_ONEDNN_CACHE))
    limit_arenas(getattr(process, "malloc_arena_max", DEFAULT_ARENA_MAX))
    return start_trimmer(getattr(process, "malloc_trim_s", DEFAULT_TRIM_S))
