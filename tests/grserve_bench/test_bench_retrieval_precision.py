"""`grserve bench retrieval --dtype float32,bfloat16,auto` (issue 42): the precision is a dimension, one JSON line per
dtype, each naming the dtype used, why, the quantization and the machine."""

from __future__ import annotations

import json

from grserve.cli import main
from grserve.model.cpu_support import cpu_model_name
from grserve.model.dtype_choice import choose_dtype

SMALL = ["--prompt-len", "24", "--beam-widths", "4", "--requests", "2", "--batch", "2", "--num-items", "300",
         "--codebook-size", "16", "--skip-hf", "--skip-naive"]


def test_one_json_line_per_dtype_naming_dtype_reason_quantization_machine(capsys):
    from grserve_bench.cli import register

    rc = main(["bench", "retrieval", "--dtype", "float32,bfloat16,auto", "--no-batch-invariant", *SMALL],
              {"bench": register})
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["dtype_asked"] for x in lines] == ["float32", "bfloat16", "auto"]
    assert [x["dtype"] for x in lines[:2]] == ["float32", "bfloat16"]
    assert lines[2]["dtype"] == choose_dtype("auto", "cpu")[0]
    assert lines[2]["dtype_reason"].startswith("auto, ") and lines[0]["dtype_reason"] == "asked for"
    for x in lines:
        assert x["quantization"] == "none" and x["batch_invariant"] is False
        assert x["machine"]["cpu_model"] == cpu_model_name() and x["req_per_s"] > 0


def test_bench_default_is_auto_and_batch_invariant():
    from grserve_bench.retrieval import RetrievalBenchConfig

    cfg = RetrievalBenchConfig()
    assert cfg.dtype == "auto" and cfg.batch_invariant


def test_quantization_is_a_second_dimension_and_a_refusal_is_a_line(capsys):
    from grserve_bench.cli import register

    from grserve.model.quantized_linear import QuantizationRefused, choose

    try:
        choose("int8", "cpu", "float32")
        int8_here = True
    except QuantizationRefused:
        int8_here = False
    rc = main(["bench", "retrieval", "--dtype", "float32", "--quantization", "int8,fp8", *SMALL],
              {"bench": register})
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [(x["dtype"], x["quantization"]) for x in lines] == [("float32", "int8"), ("float32", "fp8")]
    fp8 = lines[1]
    assert "compute capability" in fp8["refused"] and "req_per_s" not in fp8 and fp8["machine"]["cpu_model"]
    if int8_here:
        assert "torch._int_mm" in lines[0]["quantization_op"] and lines[0]["req_per_s"] > 0
    else:
        assert lines[0]["refused"]
