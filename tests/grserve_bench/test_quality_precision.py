"""`grserve bench quality --dtype float32,bfloat16` (issue 42): the precision is a dimension of the quality bench, one
JSON line per dtype naming dtype, quantization and machine, the later lines compared with the first dtype's lists."""

from __future__ import annotations

import dataclasses
import json

import pytest

from grserve_bench.precision import hits_at_k, precision_comparison
from grserve_bench.quality import QualityBenchConfig


def test_the_comparison_with_the_reference_dtype_by_hand():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    got = [[1, 2, 3, 4], [6, 5, 7, 99], [9, 10, 11, 12], [13, 14, 15, 16]]
    targets = [4, 5, 42, 43]
    out = precision_comparison(ref, got, hits_at_k(ref, targets, 4), hits_at_k(got, targets, 4), n=4)
    assert out["top1_vs_reference"] == 0.75
    assert (out["overlap@4_vs_reference"], out["overlap@4_min_vs_reference"]) == (0.9375, 0.75)
    assert out["recall_stderr_reference"] == pytest.approx(0.25) and out["recall_within_stderr"]  # 0.5 both
    worse = precision_comparison(ref, got, [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], n=4)
    assert not worse["recall_within_stderr"]  # 0.0 against 0.5 +- 0.25


def test_the_dtype_flag_takes_a_list_of_known_dtypes():
    assert QualityBenchConfig().dtype == "float32"
    assert QualityBenchConfig(dtype="float32,bfloat16,auto").dtype == "float32,bfloat16,auto"
    with pytest.raises(ValueError, match="int4"):
        QualityBenchConfig(dtype="float32,int4")


@pytest.fixture(scope="module")
def beauty_slice(tmp_path_factory, random_decoder):
    """The first 60 Beauty users (every item keeps its SID), its catalog and a 1-layer random decoder over it."""
    from grserve.beauty.data import BEAUTY_DIR, load_sid_dataset
    from grserve.catalog import Catalog, save_catalog
    from grserve.model.loader import save_pretrained
    from grserve.model.spec import PRESETS

    d = tmp_path_factory.mktemp("beauty-slice")
    inter = json.loads((BEAUTY_DIR / "inter.json").read_text())
    (d / "inter.json").write_text(json.dumps({u: inter[u] for u in list(inter)[:60]}))
    (d / "index_rqkmeans.json").write_text((BEAUTY_DIR / "index_rqkmeans.json").read_text())
    ds = load_sid_dataset(d)
    catalog = d / "catalog.jsonl"
    save_catalog(Catalog.from_arrays(ds.item_ids, ds.sids, codebook_sizes=ds.codebook_sizes, token_offset=16), catalog)
    spec = dataclasses.replace(PRESETS["tiny"], vocab_size=1088, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model = d / "model"
    save_pretrained(random_decoder(spec, 0, 0.3), model)
    return d, model, catalog


def test_bench_quality_beauty_runs_once_per_dtype(beauty_slice, capsys):
    from grserve.cli import main
    from grserve_bench.machine import machine_info

    d, model, catalog = beauty_slice
    rc = main(["bench", "quality", "--dataset", "beauty", "--model", str(model), "--catalog", str(catalog),
               "--data-dir", str(d), "--max-users", "12", "--hf-users", "0", "--beam-width", "20", "--no-progress",
               "--dtype", "float32,bfloat16"])
    out = capsys.readouterr().out
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert rc == 0 and [x["dtype"] for x in lines] == ["float32", "bfloat16"]
    for x in lines:
        assert x["quantization"] == "none" and x["machine"] == machine_info()["cpu"] and x["users"] == 12
    low = lines[1]
    assert low["precision_reference"] == "float32" and low["invalid_items"] == 0
    assert 0 <= low["overlap@20_min_vs_reference"] <= low["overlap@20_vs_reference"] <= 1
    assert 0 <= low["top1_vs_reference"] <= 1 and isinstance(low["recall_within_stderr"], bool)
    assert "precision_reference" not in lines[0]
