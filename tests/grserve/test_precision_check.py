"""``grserve check precision`` (issue 42, the recall gate): the comparison's numbers on hand-made runs, and the
command end to end (bfloat16 against float32 on the tiny preset; targets give recall; the gate sets the exit code)."""

from __future__ import annotations

import json

import pytest
import torch

from grserve.cli import main
from grserve.precision_check import PrecisionCheck, compare, split_targets
from grserve.recommender import Recommendation, RecommendedItem


def _rec(*items: tuple[int, float]) -> Recommendation:
    return Recommendation("r", [RecommendedItem(i, (0, 0, 0), s) for i, s in items])


def test_the_comparison_counts_what_it_says():
    ref = [_rec((1, -1.0), (2, -2.0), (3, -3.0), (4, -4.0)), _rec((5, -1.0), (6, -2.0), (7, -3.0), (8, -4.0))]
    got = [_rec((1, -1.5), (2, -2.0), (3, -3.0), (9, -3.5)), _rec((6, -2.25), (5, -1.0), (99, -3.0), (8, -4.0))]
    out = compare(ref, got, catalog_ids={1, 2, 3, 4, 5, 6, 7, 8, 9}, top_n=4, targets=[[4], [], ], recall_k=4)
    assert out.requests == 2 and out.top1 == 0.5
    assert (out.overlap_mean, out.overlap_min) == (0.75, 0.75)
    assert out.max_score_delta == 0.5 and out.invalid == 1  # item 99 is not in the catalog
    assert (out.targets, out.recall_reference, out.recall_test) == (1, 1.0, 0.0)
    assert not out.passes(PrecisionCheck())  # an invalid item never passes
    ok = compare(ref, ref, {1, 2, 3, 4, 5, 6, 7, 8}, 4)
    assert ok.passes(PrecisionCheck(min_top1=1.0, min_overlap=1.0)) and ok.max_score_delta == 0.0


def test_targets_are_held_out_of_the_request():
    assert split_targets({"history_items": [1], "target": 5}) == ({"history_items": [1]}, [5])
    assert split_targets({"history_items": [1], "targets": [5, 6]}) == ({"history_items": [1]}, [5, 6])
    assert split_targets([1, 2]) == ([1, 2], [])


def test_the_command_compares_bf16_with_fp32(tmp_path, capsys):
    from grserve.catalog import generate_catalog

    cat = generate_catalog(300, 3, 256, seed=3)
    ids = [int(i) for i in cat.item_ids]
    path = tmp_path / "users.jsonl"
    path.write_text("".join(json.dumps({"history_items": ids[k:k + 6], "target": ids[k + 6]}) + "\n"
                            for k in range(0, 60, 10)))
    common = ["check", "precision", "--num-items", "300", "--seed", "3", "--beam-width", "8", "--top-n", "8",
              "--recall-k", "8", "--input", str(path), "--json-only", "--no-warmup"]
    code = main([*common, "--dtype", "bfloat16", "--min-overlap", "0"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and record["passes"] and record["requests"] == 6 and record["targets"] == 6
    assert record["invalid"] == 0 and record["dtype"] == "bfloat16" and "cpu" in record["machine"]
    assert 0.0 <= record["overlap_min"] <= record["overlap_mean"] <= 1.0
    assert record["recall_reference"] is not None and record["recall_test"] is not None
    assert main([*common, "--dtype", "bfloat16", "--min-top1", "1.0", "--min-overlap", "1.0"]) == \
        (0 if record["top1"] == 1.0 and record["overlap_mean"] == 1.0 else 1)  # the gate is the exit code
    capsys.readouterr()
    assert main([*common, "--dtype", "float32"]) == 2
    assert "the reference is float32" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [(["--min-overlap", "1.5"], "a fraction"),
                                            (["--top-n", "50"], "more than --beam-width")])
def test_bad_flags_are_usage_errors(flags, message, capsys):
    assert main(["check", "precision", "--dtype", "bfloat16", "--beam-width", "8", *flags]) == 2
    assert message in capsys.readouterr().err


def test_ndcg_and_the_standard_error_verdicts():
    from grserve.precision_check import ndcg

    assert ndcg(_rec((1, 0.0), (2, 0.0), (3, 0.0)), {2}, 3) == pytest.approx(1 / 1.5849625007211563)
    assert ndcg(_rec((1, 0.0), (2, 0.0)), {1, 2}, 2) == 1.0 and ndcg(_rec((1, 0.0)), {9}, 1) == 0.0
    ref = [_rec((k, 0.0), (k + 100, 0.0)) for k in range(8)]
    got = [_rec((k + 100, 0.0), (k, 0.0)) for k in range(8)]  # every target one rank lower: recall equal, NDCG not
    out = compare(ref, got, set(range(200)), 2, [[k] for k in range(8)], recall_k=2)
    assert out.recall_reference == out.recall_test == 1.0 and out.recall_within_stderr  # SE 0, difference 0
    assert (out.ndcg_reference, out.ndcg_test) == (1.0, pytest.approx(1 / 1.5849625007211563))
    assert out.ndcg_within_stderr is False and out.to_dict()["ndcg_within_stderr"] is False
    assert compare(ref, ref, set(range(200)), 2).recall_within_stderr is None  # no targets, no verdict


def _serve(argv, monkeypatch):
    """``grserve serve`` in-thread on the tiny preset, uvicorn replaced by a no-op: (exit code, served dtype)."""
    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.server.launch import serving

    built = []
    build = RetrievalEngine.build.__func__

    def recording(cls, cfg, on_batch=None):
        engine = build(cls, cfg, on_batch=on_batch)
        built.append(engine.model.dtype_choice.name)
        return engine

    monkeypatch.setattr(RetrievalEngine, "build", classmethod(recording))
    monkeypatch.setattr(serving, "run_uvicorn", lambda app, host, port, log_level, stop, timeout: None)
    code = main(["serve", "--no-engine-process", "--num-items", "300", "--seed", "3", "--beam-width", "8",
                 "--no-warmup", "--port", "0", "--threads", "1", "--dtype", "bfloat16", "--precision-gate-users", "4",
                 "--precision-gate-top-n", "8", *argv])
    return code, built


def test_serve_falls_back_to_float32_below_the_precision_gate_and_says_so(monkeypatch, capsys):
    code, built = _serve(["--precision-gate-min-overlap", "1.01"], monkeypatch)  # never passes
    out = capsys.readouterr().out
    assert code == 0 and built == ["float32", "bfloat16", "float32"]  # the gate's two runs, then the served model
    gate = next(line for line in out.splitlines() if "precision gate:" in line)
    assert "bfloat16 vs float32 on 4 sampled histories" in gate and "-> serving float32" in gate
    start = next(line for line in out.splitlines() if line.startswith("grserve: model tiny ("))
    assert "(float32, cpu: FELL BACK from bfloat16, below the precision gate (overlap@8 " in start


def test_serve_refuses_below_the_gate_or_serves_the_dtype_that_passes(monkeypatch, capsys):
    code, built = _serve(["--precision-gate-min-overlap", "1.01", "--precision-gate-action", "refuse"], monkeypatch)
    assert code == 2 and built == ["float32", "bfloat16"]  # nothing served
    assert "below the gate" in capsys.readouterr().err
    code, built = _serve(["--precision-gate-min-overlap", "0"], monkeypatch)
    start = [line for line in capsys.readouterr().out.splitlines() if line.startswith("grserve: model tiny (")]
    assert code == 0 and built[-1] == "bfloat16" and "bfloat16: asked for, cpu; precision gate passed" in start[0]


def test_the_gate_is_off_by_default_and_skips_float32(capsys):
    from dataclasses import replace

    from grserve.config import PrecisionGateConfig, ServeConfig
    from grserve.precision_check import startup_gate

    cfg = ServeConfig()
    assert not cfg.precision_gate.enabled and startup_gate(cfg) is cfg
    fp32 = replace(cfg, model=replace(cfg.model, dtype="float32"),
                   precision_gate=PrecisionGateConfig(precision_gate_users=4))
    assert startup_gate(fp32) is fp32 and "skipped, the model serves float32" in capsys.readouterr().out


@pytest.fixture(scope="module")
def beauty_cache(tmp_path_factory, random_decoder):
    """A Beauty cache folder as ``grserve bench quality --dataset beauty`` leaves it, the model a 1-layer random
    decoder over the dataset's catalog (its train_meta.json says max_items 20)."""
    import dataclasses

    from grserve.beauty.data import load_sid_dataset
    from grserve.catalog import Catalog, save_catalog
    from grserve.model.loader import save_pretrained
    from grserve.model.spec import PRESETS

    d = tmp_path_factory.mktemp("beauty-cache")
    ds = load_sid_dataset()
    save_catalog(Catalog.from_arrays(ds.item_ids, ds.sids, codebook_sizes=ds.codebook_sizes, token_offset=16),
                 d / "catalog.jsonl")
    spec = dataclasses.replace(PRESETS["tiny"], vocab_size=1088, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    save_pretrained(random_decoder(spec, 0, 0.3), d / "model")
    (d / "model" / "train_meta.json").write_text(json.dumps({"config": {"max_items": 20}, "index": "rqkmeans"}))
    return d, ds.split()


def test_dataset_requests_are_the_held_out_split(beauty_cache, tmp_path):
    from grserve.flags import UsageError
    from grserve.precision_check import dataset_requests

    d, split = beauty_cache
    model, catalog, requests = dataset_requests("beauty", "test", max_users=5, cache_dir=str(d))
    assert (model, catalog) == (str(d / "model"), str(d / "catalog.jsonl")) and len(requests) == 5
    last = len(split.users) - 1
    assert [r["user_id"] for r in requests] == [int(split.users[i]) for i in (0, last // 4, last // 2,
                                                                               round(3 * last / 4), last)]
    first = requests[0]
    assert first["target"] == int(split.test[0]) and first["history_items"] == split.test_history(0)[-20:].tolist()
    valid = dataset_requests("beauty", "valid", max_users=1, cache_dir=str(d))[2][0]
    assert valid["target"] == int(split.valid[0]) and valid["history_items"] == split.train[0][-20:].tolist()
    with pytest.raises(UsageError, match="no trained model"):
        dataset_requests("movielens", cache_dir=str(tmp_path))


def test_the_command_checks_a_datasets_held_out_split(beauty_cache, tmp_path, capsys):
    d, _ = beauty_cache
    saved = tmp_path / "users.jsonl"
    code = main(["check", "precision", "--dataset", "beauty", "--cache-dir", str(d), "--max-users", "6",
                 "--beam-width", "20", "--dtype", "bfloat16", "--min-overlap", "0", "--json-only", "--no-warmup",
                 "--save-input", str(saved)])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and record["model"] == str(d / "model") and (record["dataset"], record["split"]) == \
        ("beauty", "test")
    assert record["requests"] == record["targets"] == 6 and record["invalid"] == 0
    assert record["ndcg_reference"] <= record["recall_reference"] and isinstance(record["recall_within_stderr"], bool)
    lines = [json.loads(x) for x in saved.read_text().splitlines()]
    assert len(lines) == 6 and all({"user_id", "history_items", "target"} <= set(x) for x in lines)
    assert main(["check", "precision", "--dataset", "beauty", "--input", str(saved), "--dtype", "bfloat16"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_the_gate_checks_a_quantized_float32_model_and_falls_back_unquantized(monkeypatch, capsys):
    from grserve.model import quantized_linear as ql

    try:
        ql.choose("int8", "cpu", torch.float32)
    except ql.QuantizationRefused:
        pytest.skip("int8 is refused on this CPU")
    code, built = _serve(["--dtype", "float32", "--quantization", "int8", "--precision-gate-min-overlap", "1.01"],
                         monkeypatch)
    out = capsys.readouterr().out
    assert code == 0 and built == ["float32", "float32", "float32"]  # reference, float32 + int8, then served
    gate = next(line for line in out.splitlines() if "precision gate:" in line)
    assert "float32 + int8 vs float32" in gate and "-> serving float32 instead of float32 + int8" in gate
    start = next(line for line in out.splitlines() if line.startswith("grserve: model tiny ("))
    assert "FELL BACK from float32 + int8" in start and "quantization int8" not in start
