"""The device fast path (fixed-shape beam steps, padded buckets) = the existing host-driven search, on CPU.

The same ``DeviceRetrievalRunner._step`` is what a GPU captures as a CUDA graph; here it runs eagerly. Same items
in the same order and the same scores to fp32 tolerance as ``RetrievalRunner``, under both scoring conventions,
with padded requests, buffers reused across batches, dead beams, and the Triton backend (interpreter)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from grserve.catalog import CatalogStore, generate_catalog
from grserve.config import AccelConfig, SchedulerConfig, SearchConfig
from grserve.engine.device_runner import DeviceRetrievalRunner
from grserve.engine.retrieval import RetrievalRunner
from grserve.engine.retrieval_engine import RetrievalEngine
from grserve.engine.types import RetrievalRequest

from gr_fixtures import grid_catalog


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def catalog():
    return generate_catalog(3000, 3, 64, 0)


@pytest.fixture(scope="module")
def small_catalog():
    return grid_catalog(40, seed=0, first_id=100)


def prompts(lens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2000, n).astype(np.int64) for n in lens]


def assert_same(ref, out, tol=1e-5):
    for a, b in zip(ref.hits, out.hits, strict=True):
        assert [h.item_id for h in a] == [h.item_id for h in b]
        assert [h.sid for h in a] == [h.sid for h in b]
        assert max((abs(x.score - y.score) for x, y in zip(a, b)), default=0.0) <= tol


def fast(model, scoring="renormalized", backend="torch", **kw):
    accel = AccelConfig(fast_path="on", attention_backend=backend, prompt_bucket=kw.pop("prompt_bucket", 16), **kw)
    return DeviceRetrievalRunner(model, SearchConfig(scoring=scoring), accel)


@pytest.mark.parametrize("scoring", ["renormalized", "hf"])
def test_fast_path_equals_search(model, catalog, scoring):
    ps = prompts([30, 17, 41])  # 3 requests → bucket 4 (one padded request), shared length padded to 48
    ref = RetrievalRunner(model, SearchConfig(scoring=scoring)).run(ps, 16, [16] * 3, catalog)
    out = fast(model, scoring).run(ps, 16, [16] * 3, catalog)
    assert all(len(h) == 16 for h in out.hits)
    assert_same(ref, out)


def test_bucket_buffers_reused_across_batches(model, catalog):
    """A second batch in the same bucket (other lengths, fewer requests) = a fresh search: no stale state."""
    runner = fast(model, batch_buckets="4")
    runner.run(prompts([40, 33, 12], seed=1), 8, [8] * 3, catalog)
    ps = prompts([5, 38], seed=2)
    out = runner.run(ps, 8, [8] * 2, catalog)
    assert len(runner._buckets) == 1 and runner.bucket_key([5, 38], 8) == (4, 48)
    assert_same(RetrievalRunner(model, SearchConfig()).run(ps, 8, [8] * 2, catalog), out)


def test_dead_beams_and_fewer_items(model, small_catalog):
    """BW above the codebook size: beams die, requests get fewer items, never an invalid one; same as the search."""
    ps = prompts([9, 14], seed=3)
    ref = RetrievalRunner(model, SearchConfig()).run(ps, 64, [64, 64], small_catalog)
    out = fast(model).run(ps, 64, [64, 64], small_catalog)
    assert_same(ref, out)
    assert all(len(h) == 40 for h in out.hits)  # every catalog item, each once
    assert all(len({x.item_id for x in h}) == 40 for h in out.hits)


def test_triton_backend_equals_search(model, small_catalog):
    pytest.importorskip("triton")
    from grserve.kernels import triton_available

    if not triton_available("cpu"):
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    ps = prompts([11, 6], seed=4)  # tiny grids: 2 requests × BW 4 under the interpreter
    ref = RetrievalRunner(model, SearchConfig()).run(ps, 4, [4, 4], small_catalog)
    out = fast(model, backend="triton", batch_buckets="2").run(ps, 4, [4, 4], small_catalog)
    assert_same(ref, out)


def test_engine_uses_the_fast_path_when_asked(model, catalog):
    engine = RetrievalEngine(model, CatalogStore(catalog), SearchConfig(),
                             SchedulerConfig(max_inflight_batches=1), accel=AccelConfig(fast_path="on")).start()
    try:
        assert isinstance(engine.runner, DeviceRetrievalRunner)
        p = prompts([21], seed=5)[0]
        got = engine.submit(RetrievalRequest(prompt_tokens=p, beam_width=16, top_n=5)).future.result(timeout=60)
    finally:
        engine.stop()
    ref = RetrievalRunner(model, SearchConfig()).run([p], 16, [5], catalog)
    assert [it.item_id for it in got.items] == [h.item_id for h in ref.hits[0]]
    # the default on a CPU is the host-driven path
    assert AccelConfig().use_fast_path("cpu") is False and AccelConfig().use_fast_path("cuda:0") is True


def test_exclude_items_on_the_fast_path_engine_are_masked(model, catalog):
    """A batch with exclude_items on an engine whose runner is the fast path takes the reference path's exclusion
    mask (the device step has none yet): the excluded items never come back, the rest equals the reference."""
    engine = RetrievalEngine(model, CatalogStore(catalog), SearchConfig(),
                             SchedulerConfig(max_inflight_batches=1), accel=AccelConfig(fast_path="on")).start()
    p = prompts([21], seed=5)[0]
    try:
        plain = engine.submit(RetrievalRequest(prompt_tokens=p, beam_width=16, top_n=8)).future.result(timeout=60)
        banned = np.array([it.item_id for it in plain.items[:3]])
        got = engine.submit(RetrievalRequest(prompt_tokens=p, beam_width=16, top_n=8,
                                             exclude_items=banned)).future.result(timeout=60)
    finally:
        engine.stop()
    assert not set(banned.tolist()) & {it.item_id for it in got.items}
    ref = RetrievalRunner(model, SearchConfig()).run([p], 16, [8], catalog, exclude=[banned])
    assert [it.item_id for it in got.items] == [h.item_id for h in ref.hits[0]]


def test_import_needs_neither_cuda_nor_triton():
    code = ("import sys, grserve, grserve.engine.retrieval_engine, grserve.engine.device_runner, "
            "grserve.attention.backends, grserve_bench.flex_bipartite, grserve.kernels; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": "src", "PATH": ""})


def test_bench_p2_suite_runs_on_cpu_with_small_shapes(capsys):
    import json

    from grserve.cli import main

    argv = ["bench", "retrieval", "--suite", "p2", "--p2-model", "tiny", "--p2-dtype", "float32",
            "--p2-prompt-len", "16", "--p2-batch", "2", "--p2-beam-width", "4", "--grid-ctx", "16",
            "--grid-batch", "1", "--grid-bw", "4", "--iters", "1", "--warmup", "0", "--hf-requests", "1",
            "--num-items", "500"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["device"] == "cpu" and out["ms_per_batch_p2"] > 0 and out["speedup_vs_hf_gpu"] > 0
    assert out["invalid_item_rate"] == 0.0 and out["hf_top1_agreement"] == 1.0
    assert [(c["ctx"], c["batch"], c["beam_width"]) for c in out["grid"]] == [(16, 2, 4), (16, 1, 4)]


def test_beam_step_is_capturable(model, catalog):
    """What a CUDA graph cannot hold never happens in the step: no host sync (``.item()``-style reads) and no
    data-dependent shapes (nonzero, boolean indexing), checked op by op on CPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    forbidden = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item", "equal"}
    seen: list[str] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name == "index" and any(t is not None and t.dtype == torch.bool for t in args[1]):
                name = "nonzero"  # boolean-mask indexing: its output shape depends on the data
            seen.append(name)
            return func(*args, **(kwargs or {}))

    runner = fast(model)
    step = runner._step

    def spied(b, level, cat):
        with Spy():
            step(b, level, cat)

    runner._step = spied
    ps = prompts([13, 22], seed=6)
    out = runner.run(ps, 8, [8, 8], catalog)
    assert_same(RetrievalRunner(model, SearchConfig()).run(ps, 8, [8, 8], catalog), out)
    assert len(seen) > 100 and not forbidden & set(seen), sorted(forbidden & set(seen))


def test_bf16_fast_path_close_to_fp32_search(model, small_catalog):
    """bf16 plumbing (weights, KV; fp32 softmax, merge and scores) stays within bf16 tolerance of the fp32
    host-driven search (the bf16 Triton kernels are checked one by one in test_triton_kernels.py)."""
    import copy

    bf16 = copy.deepcopy(model).to(torch.bfloat16)  # the shared fixture stays fp32
    ps = prompts([12, 7], seed=8)
    ref = RetrievalRunner(model, SearchConfig()).run(ps, 4, [4, 4], small_catalog)
    out = fast(bf16, batch_buckets="2").run(ps, 4, [4, 4], small_catalog)
    for a, b in zip(ref.hits, out.hits):
        assert a[0].item_id == b[0].item_id
        sa, sb = {h.item_id: h.score for h in a}, {h.item_id: h.score for h in b}
        common = sa.keys() & sb.keys()
        assert len(common) >= 3 and max(abs(sa[i] - sb[i]) for i in common) <= 0.05
