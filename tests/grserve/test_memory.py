"""``grserve.memory``: the engine process gives the heap memory glibc keeps after frees back to the OS (issue 41)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from grserve.config import LLMServeConfig, RankingServeConfig, ServeConfig
from grserve.memory import MallocTrimmer, _libc_malloc_trim, limit_arenas, start_trimmer

RSS_MIB = ("def rss():\n"
           "    return next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith('VmRSS')) // 1024\n")


def _child(code: str, *args: str, drop: tuple[str, ...] = (), inherit: bool = True) -> list[str]:
    """The words ``code`` prints, run by a fresh interpreter (mallopt, oneDNN's caches: process-wide settings stay
    there) on this test's ``sys.path``, with this environment less ``drop`` (``inherit`` False: none of it)."""
    env = {k: v for k, v in os.environ.items() if k not in drop} if inherit else {}
    env["PYTHONPATH"] = ":".join(sys.path)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                          env=env).stdout.split()


def test_trimmer_calls_trim_every_interval_and_stops():
    calls = []
    done = threading.Event()

    def fake(pad: int) -> int:
        calls.append(pad)
        if len(calls) >= 3:
            done.set()
        return len(calls) % 2

    t = MallocTrimmer(0.02, trim=fake).start()
    assert t.running
    assert done.wait(5)
    t.stop()
    assert not t.running
    n = len(calls)
    time.sleep(0.1)
    assert len(calls) == n and set(calls) == {0}
    assert t.stats.calls == n and t.stats.released == sum(1 for k in range(1, n + 1) if k % 2)
    assert t.stats.max_s >= 0 and t.stats.to_dict()["calls"] == n


def test_interval_zero_or_no_malloc_trim_starts_nothing():
    assert not MallocTrimmer(0, trim=lambda pad: 1).start().running
    t = MallocTrimmer(1.0, trim=None)
    t._trim = None
    assert not t.start().running and not t.available and t.trim_once() is False


def test_every_server_trims_every_ten_seconds_on_two_arenas_by_default():
    for cfg in (ServeConfig(), RankingServeConfig(), LLMServeConfig()):
        assert cfg.process.malloc_trim_s == 10.0 and cfg.process.malloc_arena_max == 2


def test_the_users_malloc_arena_max_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_arenas(2) is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert limit_arenas(0) is False


@pytest.mark.skipif(not sys.platform.startswith("linux") or _libc_malloc_trim() is None,
                    reason="glibc's mallopt")
def test_settle_allocator_limits_arenas_and_starts_the_trimmer():
    # in a fresh interpreter (mallopt is process-wide): 2 arenas, then 8 threads allocating at once share them
    code = (
        "import os, threading\n"
        "os.environ.pop('MALLOC_ARENA_MAX', None)\n"
        "from grserve.config import ProcessConfig\n"
        "from grserve.memory import limit_arenas, settle_allocator\n"
        "t = settle_allocator(ProcessConfig(malloc_trim_s=0.05))\n"
        "def work():\n"
        "    for _ in range(200): [bytes(5000) for _ in range(200)]\n"
        "th = [threading.Thread(target=work) for _ in range(8)]\n"
        "[x.start() for x in th]; [x.join() for x in th]\n"
        "import time; time.sleep(0.3)\n"
        "maps = open('/proc/self/maps').read().splitlines()\n"
        "heaps = {l.split()[0] for l in maps if l.split()[1].startswith('rw') and len(l.split()) == 5\n"
        "         and int(l.split('-')[0], 16) % (64 << 20) == 0}\n"
        "print(t.running, t.stats.calls, len(heaps))\n")
    out = _child(code, drop=("MALLOC_ARENA_MAX",))
    running, calls, heaps = out[0] == "True", int(out[1]), int(out[2])
    assert running and calls >= 2
    assert heaps <= 2  # one arena besides the main heap (a 64 MiB-aligned mapping per arena heap)


@pytest.mark.skipif(not sys.platform.startswith("linux") or _libc_malloc_trim() is None,
                    reason="glibc's malloc_trim")
def test_malloc_trim_gives_a_fragmented_heap_back():
    # 300 MB of 2 kB blocks (glibc's heap, not Python's small-object allocator), one in 64 kept: the heap cannot
    # shrink from its top, its free pages stay resident until malloc_trim(0) returns them
    code = (
        "from grserve.memory import MallocTrimmer\n"
        + RSS_MIB +
        "objs = [bytes(2000) for _ in range(150_000)]\n"
        "keep = objs[::64]\n"
        "del objs\n"
        "freed = rss()\n"
        "gave = MallocTrimmer(0).trim_once()\n"
        "print(freed, rss(), int(gave))\n")
    freed, trimmed, gave = map(int, _child(code, inherit=False))
    assert gave == 1 and freed - trimmed > 150, (freed, trimmed)


def test_start_trimmer_returns_a_started_trimmer():
    t = start_trimmer(3600.0)
    try:
        assert t.running == t.available
    finally:
        t.stop()


def test_onednn_caches_bounded_unless_the_user_chose(monkeypatch):
    from grserve.memory import bound_onednn_caches

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    assert bound_onednn_caches(0) == {}
    assert bound_onednn_caches(128) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "128"}
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "128" and os.environ["LRU_CACHE_CAPACITY"] == "512"


GEMM_SHAPES = (
    "import sys, torch\n"
    "from grserve.config import ProcessConfig\n"
    "from grserve.memory import MallocTrimmer, settle_allocator\n"
    "from grserve.model import load_model\n"
    "from grserve.model.packed_linear import linear, maybe_pack, projections\n"
    "settle_allocator(ProcessConfig(onednn_cache_capacity=int(sys.argv[1]), malloc_trim_s=0))\n"
    "torch.set_num_threads(1)\n"
    + RSS_MIB +
    "m = load_model('tiny', seed=0)\n"
    "p = maybe_pack(m)\n"
    "lins = projections(m)[:7]\n"
    "before = rss()\n"
    "for M in range(1, 161):\n"
    "    for lin in lins:\n"
    "        linear(torch.randn(M, lin.in_features), lin, p)\n"
    "MallocTrimmer(0).trim_once()\n"
    "print(int(p is not None), rss() - before)\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_bounded_onednn_caches_keep_a_process_flat_across_gemm_shapes():
    """160 token counts through the tiny model's 7 packed projections of a layer (1,120 GEMM shapes): with oneDNN's
    and ideep's default caches the process keeps ~300 MiB of kernels, with 128 entries each under 100 MiB."""
    grown = {}
    for cap in (0, 128):
        out = _child(GEMM_SHAPES, str(cap), drop=("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"))
        if out[0] == "0":
            pytest.skip("no oneDNN packed projections on this CPU / torch build")
        grown[cap] = int(out[1])
    assert grown[128] < 100 and grown[0] > 2 * grown[128] + 100, grown
