"""``--quantization`` (``model/quantized_linear.py``, issue 42 item 4): the quantizers' error bounds, each fast op
against its dequantize reference, int8's batch-independent rows, a tiny retrieval model at int8 against fp32
(top-20 overlap, no invalid item), and the refusals (the reference and avx2 lanes, fp8 on a CPU, a trial that says
the op is not faster) -- at load, in the server's start-up check and on the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from grserve.config import ConfigError, ModelConfig
from grserve.model import load_model
from grserve.model import quantized_linear as ql
from grserve.model.quantized_linear import QuantizationRefused

BW, TOP_N = 24, 20


def _runs_here(scheme: str, dtype=torch.float32) -> bool:
    try:
        ql.choose(scheme, "cpu", dtype)
    except QuantizationRefused:
        return False
    return True


@pytest.fixture
def fresh_trials(monkeypatch):
    """The timed trials forgotten before and after (a test's fake trial times do not leak)."""
    monkeypatch.delenv(ql.TRIAL_ENV, raising=False)
    ql.timed_trial.cache_clear()
    yield monkeypatch
    ql.timed_trial.cache_clear()


@pytest.fixture(scope="module")
def int8_model():
    if not _runs_here("int8"):
        pytest.skip("int8 is refused on this CPU")
    return load_model("tiny", quantization="int8")


def test_int8_round_trip_is_within_half_a_step():
    t = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 64)[:, None]
    q, s = ql.quantize_int8_rows(t)
    assert q.dtype == torch.int8 and s.shape == (64, 1) and int(q.abs().max()) <= 127
    err = (ql.dequantize_rows(q, s) - t).abs()
    assert bool((err <= s / 2 * (1 + 1e-5) + 1e-12).all())
    assert bool((q.abs().amax(dim=1) == 127).all())  # each row's largest value uses the full range
    zeros, zs = ql.quantize_int8_rows(torch.zeros(2, 8))  # an all-zero row: zero codes, no NaN
    assert not zeros.any() and torch.isfinite(zs).all()


def test_fp8_round_trip_is_within_e4m3_precision():
    t = torch.randn(32, 256, generator=torch.Generator().manual_seed(1))
    q, s = ql.quantize_fp8_rows(t)
    assert q.dtype == torch.float8_e4m3fn
    err = (ql.dequantize_rows(q, s) - t).abs()
    # 3 mantissa bits: half a step is 2^-4 of the value; below e4m3's normal range, half a subnormal step (2^-10 * s)
    assert bool((err <= torch.maximum(t.abs() * 2 ** -4, s * 2 ** -10) * (1 + 1e-4)).all())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)])
def test_int8_op_equals_the_dequantize_reference(dtype, tol):
    if not _runs_here("int8", dtype):
        pytest.skip("int8 is refused on this CPU")
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(96, 128, generator=g) * 0.05).to(dtype)
    bias = (torch.randn(96, generator=g) * 0.1).to(dtype)
    qw = ql.quantize_weight("int8", w, bias)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 128, generator=g).to(dtype)
        got, want = ql._int8_op(x, qw), ql._int8_reference(x, qw)
        assert got.dtype == dtype and got.shape == (rows, 96)
        # int32 sums are exact; the two differ by the reference's fp32 accumulation (and the final cast)
        assert float((got.float() - want.float()).abs().max()) <= tol * float(want.float().abs().max())
    # and the quantized product is close to the unquantized one (W8A8 error, not a kernel bug)
    x = torch.randn(64, 128, generator=g)
    exact = torch.nn.functional.linear(x, w.float(), bias.float())
    assert float((ql._int8_op(x.to(dtype), qw).float() - exact).abs().max()) <= 0.03 * float(exact.abs().max())


def test_int8_rows_do_not_depend_on_the_batch():
    if not _runs_here("int8"):
        pytest.skip("int8 is refused on this CPU")
    g = torch.Generator().manual_seed(3)
    qw = ql.quantize_weight("int8", torch.randn(200, 256, generator=g) * 0.05)
    x = torch.randn(67, 256, generator=g)
    whole = ql._int8_op(x, qw)  # 67 rows: torch._int_mm
    assert qw.small is not None or not hasattr(torch.ops.onednn, "qlinear_prepack")
    # the same bits alone and among 67 rows, through oneDNN's qlinear (<= SMALL_ROWS rows) or torch._int_mm
    assert torch.equal(whole[5:6], ql._int8_op(x[5:6], qw))
    assert torch.equal(whole[10:10 + ql.SMALL_ROWS], ql._int8_op(x[10:10 + ql.SMALL_ROWS], qw))
    assert torch.equal(whole[10:43], ql._int8_op(x[10:43], qw))


def test_weight_only_and_fp8_references_follow_their_quantizers():
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(40, 64, generator=g) * 0.05, torch.randn(9, 64, generator=g)
    exact = torch.nn.functional.linear(x, w)
    wo = ql._weight_only_reference(x, ql.quantize_weight("int8-weight-only", w))
    f8 = ql._fp8_reference(x, ql.quantize_weight("fp8", w))
    scale = float(exact.abs().max())
    assert float((wo - exact).abs().max()) <= 0.02 * scale
    assert float((f8 - exact).abs().max()) <= 0.1 * scale
    try:  # the weight-only op itself, where this torch build has it (it may be refused as slow: it still computes)
        op = ql._weight_only_op(x, ql.quantize_weight("int8-weight-only", w))
    except (RuntimeError, NotImplementedError):
        return
    assert float((op - wo).abs().max()) <= 1e-5 * scale


def test_a_quantized_decoder_runs_its_quantized_projections(int8_model):
    from grserve.attention.context import AttentionContext  # noqa: F401 (the decoder's context type)

    q = int8_model.quantized
    assert len(q) == 7 * len(int8_model.model.layers) and q.exact_rows and "torch._int_mm" in q.describe()
    from grserve.model.packed_linear import maybe_pack, shared_pack

    assert maybe_pack(int8_model, False) is q and shared_pack(int8_model, True) is q
    ref = q.reference()
    assert ref.weights is q.weights and not ref.exact_rows
    lin = int8_model.model.layers[0].mlp.down_proj
    x = torch.randn(5, lin.in_features, generator=torch.Generator().manual_seed(5))
    got, want = q.linear(x, lin), ref.linear(x, lin)
    assert float((got - want).abs().max()) <= 2e-5 * float(want.abs().max())
    unq = torch.nn.functional.linear(x, lin.weight)  # the model's own weights stay unquantized beside
    assert not torch.equal(got, unq) and float((got - unq).abs().max()) <= 0.05 * float(unq.abs().max())


@pytest.fixture(scope="module")
def catalog_file(tmp_path_factory):
    from grserve.catalog import generate_catalog, save_catalog

    path = tmp_path_factory.mktemp("qcat") / "catalog.jsonl"
    save_catalog(generate_catalog(1200, 3, 64, seed=7), path)
    return path


def test_tiny_retrieval_at_int8_keeps_the_fp32_top_20(catalog_file, int8_model):
    from grserve.precision_check import compare
    from grserve.recommender import Recommender

    rng = np.random.default_rng(0)
    settings = dict(model="tiny", catalog=str(catalog_file), beam_width=BW, max_top_n=BW, warmup=False)
    with Recommender(**settings) as fp32:
        ids = fp32.catalog.item_ids
        bodies = [{"history_items": [int(i) for i in rng.choice(ids, int(rng.integers(4, 12)), replace=False)]}
                  for _ in range(16)]
        want = fp32.recommend(bodies, top_n=TOP_N)
        catalog_ids = {int(i) for i in ids}
    with Recommender(**settings, quantization="int8") as int8:
        assert int8.engine.model.quantized is not None
        got = int8.recommend(bodies, top_n=TOP_N)
        alone = int8.recommend(bodies[3:4], top_n=TOP_N)  # one request alone: the same list and scores
    out = compare(want, got, catalog_ids, TOP_N)
    assert out.invalid == 0
    # random weights make near ties; measured with this test's shape on 3 request seeds: mean 0.978-0.984, min
    # 0.85-0.95 (bf16: 0.988-0.997, 0.90-0.95)
    assert out.overlap_mean >= 0.9 and out.overlap_min >= 0.7, out
    assert [(i.item_id, i.score) for i in alone[0].items] == [(i.item_id, i.score) for i in got[3].items]


def test_the_offline_llm_runs_int8(int8_model):
    from grserve import LLM
    from grserve.llm_api import SamplingParams

    greedy = SamplingParams(max_tokens=4, temperature=0)
    with LLM("tiny", quantization="int8", num_blocks=64) as llm:
        assert llm.engine.model.quantized is not None
        out = llm.generate([[5, 6, 7, 8, 9]], greedy)
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_reference_lane_refuses_int8(forced_cpu_isa, fresh_trials):
    forced_cpu_isa("reference")
    with pytest.raises(QuantizationRefused, match="GRSERVE_CPU_ISA=reference"):
        ql.choose("int8", "cpu", torch.float32)
    with pytest.raises(QuantizationRefused, match="--quantization: int8-weight-only refused"):
        load_model("tiny", quantization="int8-weight-only")


def test_the_avx2_lane_refuses_int8_without_vnni(forced_cpu_isa, fresh_trials):
    forced_cpu_isa("avx2")
    with pytest.raises(QuantizationRefused, match="VNNI"):
        ql.choose("int8", "cpu", torch.float32)
    forced_cpu_isa(None)
    fresh_trials.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the make-test lane that holds torch itself to AVX2
    if ql.cpu_support().fast_paths:
        with pytest.raises(QuantizationRefused, match="ONEDNN_MAX_CPU_ISA=AVX2"):
            ql.choose("int8", "cpu", torch.float32)


def test_fp8_is_refused_on_a_cpu():
    with pytest.raises(QuantizationRefused, match="compute capability >= 8.9"):
        ql.choose("fp8", "cpu", torch.bfloat16)
    with pytest.raises(QuantizationRefused, match="fp8 refused"):
        ql.check_config(ModelConfig(quantization="fp8"))


def test_int8_on_cuda_is_refused_with_a_pointer_to_fp8():
    with pytest.raises(QuantizationRefused, match="use fp8"):
        ql.choose("int8", "cuda", torch.bfloat16)


def test_a_trial_that_is_not_faster_refuses_and_a_faster_one_runs(fresh_trials):
    if not ql.cpu_support().fast_paths or ql._trial_call("int8-weight-only", torch.float32):
        pytest.skip("the weight-only op does not run here")
    fresh_trials.setenv(ql.TRIAL_ENV, "int8-weight-only:float32=0.001,0.004")  # a trial: 4x slower
    with pytest.raises(QuantizationRefused, match=r"not faster than the float32 projection.*0\.25x"):
        ql.choose("int8-weight-only", "cpu", torch.float32)
    ql.timed_trial.cache_clear()
    fresh_trials.setenv(ql.TRIAL_ENV, "int8-weight-only:float32=0.004,0.001")  # a trial: 4x faster
    choice = ql.choose("int8-weight-only", "cpu", torch.float32)
    assert choice.scheme == "int8-weight-only" and "4.0x" in choice.label()


def test_the_trial_is_handed_to_child_processes(fresh_trials):
    if not _runs_here("int8"):
        pytest.skip("int8 is refused on this CPU")
    base, quant, speedup = ql.timed_trial("int8", "float32")
    assert f"int8:float32={base:.9f},{quant:.9f}" in __import__("os").environ[ql.TRIAL_ENV]
    assert speedup == pytest.approx(base / quant)


def test_the_flag_is_checked_and_reaches_the_start_line(int8_model):
    with pytest.raises(ConfigError, match="--quantization"):
        ModelConfig(quantization="int4")
    from grserve.model.precision_label import model_label

    label = model_label(int8_model, ModelConfig(quantization="int8"))
    assert label.startswith("float32: asked for, cpu; quantization int8 (W8A8 via torch._int_mm")


def test_servers_refuse_at_start_up_and_the_cli_says_why(capsys):
    from grserve.cli import main
    from grserve.server.launch.startup import check_model

    with pytest.raises(QuantizationRefused, match="fp8 refused"):
        check_model(ModelConfig(quantization="fp8"))
    assert main(["check", "precision", "--quantization", "fp8", "--beam-width", "8", "--top-n", "8"]) == 2
    err = capsys.readouterr().err
    assert "grserve: error: --quantization: fp8 refused: fp8 runs on CUDA devices" in err


def test_the_precision_check_takes_int8(tmp_path, capsys):
    if not _runs_here("int8"):
        pytest.skip("int8 is refused on this CPU")
    from grserve.cli import main

    code = main(["check", "precision", "--num-items", "300", "--seed", "3", "--beam-width", "8", "--top-n", "8",
                 "--users", "6", "--json-only", "--no-warmup", "--dtype", "float32", "--quantization", "int8", "--min-overlap", "0"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and record["quantization"] == "int8" and record["dtype"] == "float32"
    assert "torch._int_mm" in record["quantization_op"] and record["invalid"] == 0


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8 needs a CUDA device of compute capability >= 8.9")
def test_fp8_op_equals_its_reference_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(6)
    w = torch.randn(96, 128, generator=g, device="cuda", dtype=torch.bfloat16) * 0.05
    qw = ql.quantize_weight("fp8", w)
    for rows in (1, 16, 33):
        x = torch.randn(rows, 128, generator=g, device="cuda", dtype=torch.bfloat16)
        got, want = ql._fp8_op(x, qw).float(), ql._fp8_reference(x, qw).float()
        assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())
    model = load_model("tiny", dtype="bfloat16", device="cuda", quantization="fp8")
    assert model.quantized is not None and "_scaled_mm" in model.quantized.describe()
