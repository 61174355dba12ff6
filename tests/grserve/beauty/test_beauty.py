"""The Amazon Beauty recipe on small slices: the bundled data and its split, the cached artifacts (trained once,
reused, retrained when the recipe changes, served with an HF tokenizer), and ``grserve bench quality --dataset
beauty`` end to end: metrics, the published rows, HF generate's top-20 = grserve's under hf scoring."""

import json
from dataclasses import replace

import numpy as np
import pytest

from grserve.beauty.artifacts import BeautyArtifactsConfig, ensure_beauty
from grserve.beauty.data import BEAUTY_DIR, DatasetError, load_sid_dataset
from grserve_bench.beauty import metrics, popularity
from grserve.recipe.train import TrainConfig

TINY_RECIPE = TrainConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, max_items=20, window_items=21, window_stride=10,
                          length_buckets=True, epochs=1, batch_size=64, warmup_steps=2, lr=3e-3, dropout=0.1,
                          loss="catalog", time_budget_s=300, threads=1)


def test_bundled_beauty_matches_the_published_description():
    ds = load_sid_dataset()
    assert len(ds.users) == 22_363 and len(ds.item_ids) == 12_101
    assert sum(len(s) for s in ds.sequences) == 198_502 and min(len(s) for s in ds.sequences) >= 5
    assert ds.codebook_sizes == (256, 256, 256, 256)
    assert len({tuple(s) for s in ds.sids.tolist()}) == 12_101  # all SIDs distinct
    split = ds.split()
    assert len(split.test) == 22_363
    i = 7
    assert split.test_history(i).tolist() + [int(split.test[i])] == ds.sequences[i].tolist()
    assert split.train[i].tolist() + [int(split.valid[i])] == ds.sequences[i][:-1].tolist()
    assert load_sid_dataset(index="rqkmeans").sids.shape == (12_101, 4)


@pytest.fixture(scope="module")
def slice_dir(tmp_path_factory):
    """The first 300 users of Beauty (all 12,101 items keep their SIDs): a folder in the same layout."""
    d = tmp_path_factory.mktemp("beauty-slice")
    inter = json.loads((BEAUTY_DIR / "inter.json").read_text())
    (d / "inter.json").write_text(json.dumps({u: inter[u] for u in list(inter)[:300]}))
    for name in ("index_rqvae.json", "index_rqkmeans.json"):
        (d / name).write_text((BEAUTY_DIR / name).read_text())
    return d


def test_a_changed_copy_of_the_bundled_data_is_refused(tmp_path, slice_dir):
    with pytest.raises(DatasetError, match="lacks"):
        (tmp_path / "inter.json").write_text(json.dumps({"0": [1, 2, 99999]}))
        (tmp_path / "index_rqkmeans.json").write_text(json.dumps({"1": [0, 0, 0, 0], "2": [0, 0, 0, 1]}))
        load_sid_dataset(tmp_path)
    assert len(load_sid_dataset(slice_dir).users) == 300  # another folder is read unchecked


@pytest.fixture(scope="module")
def artifacts(slice_dir, tmp_path_factory):
    cfg = BeautyArtifactsConfig(data_dir=str(slice_dir), cache_dir=str(tmp_path_factory.mktemp("cache")))
    logs: list[str] = []
    art = ensure_beauty(cfg, recipe=TINY_RECIPE, log=logs.append, progress=False)
    return cfg, art, logs


def test_artifacts_are_trained_once_and_reused(artifacts):
    cfg, art, logs = artifacts
    assert any("saved model" in m for m in logs)
    meta = json.loads(art.train_meta.read_text())
    assert meta["config"]["loss"] == "catalog" and meta["index"] == "rqkmeans" and len(meta["catalog_sha256"]) == 64
    assert (art.model / "tokenizer.json").is_file()
    again: list[str] = []
    ensure_beauty(cfg, recipe=TINY_RECIPE, log=again.append, progress=False)
    assert any("reusing model" in m for m in again) and any("reusing catalog" in m for m in again)
    from grserve.movielens.artifacts import model_is_current

    assert not model_is_current(art, replace(TINY_RECIPE, dropout=0.2).settings())  # another recipe: retrain


def test_metrics_and_popularity_on_hand_made_cases():
    m = metrics([[5, 6, 7], [1, 2], [9] * 3], np.array([6, 3, 9]))
    assert m["hr@5"] == pytest.approx(2 / 3) and m["ndcg@5"] == pytest.approx((1 / np.log2(3) + 1) / 3)
    assert popularity([[1, 2, 2], [3, 3, 2]], k=2) == [2, 3]


def test_bench_quality_beauty_end_to_end(artifacts, slice_dir, capsys):
    pytest.importorskip("transformers")
    from grserve.cli import main

    _, art, _ = artifacts
    rc = main(["bench", "quality", "--dataset", "beauty", "--model", str(art.model), "--catalog", str(art.catalog),
               "--data-dir", str(slice_dir), "--max-users", "40", "--hf-users", "3", "--beam-width", "30",
               "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "TIGER (published" in out and "SASRec (published)" in out
    line = json.loads(out.strip().splitlines()[-1])
    for key in ("hr@5", "hr@10", "hr@20", "ndcg@5", "ndcg@10", "ndcg@20", "hr@10_popularity", "users",
                "train_seconds", "params", "eval_users_per_s", "hf_users_per_s", "hf_top20_agreement",
                "max_batch_requests", "load_avg_1m", "hf_sample_prompt_tokens", "hf_sample_position_ratio"):
        assert key in line, key
    assert line["max_batch_requests"] == 16 and line["hf_sample_position_ratio"] > 1
    assert line["users"] == 40 and line["hf_top20_agreement"] == 1.0 and line["params"] > 0
    assert 0 <= line["ndcg@10"] <= line["hr@10"] <= line["hr@20"] <= 1


def test_a_model_trained_before_a_setting_existed_is_still_current(tmp_path):
    """train_meta.json of an older trainer lacks the newer settings; their defaults are the old behaviour."""
    from grserve.movielens.artifacts import Artifacts, model_is_current
    from grserve.recipe.files import file_sha256

    art = Artifacts(tmp_path)
    art.model.mkdir()
    (art.model / "config.json").write_text("{}")
    art.catalog.write_text('{"item_id": 1, "sid": [0, 0, 0]}\n')
    old = {k: v for k, v in TrainConfig().settings().items()
           if k not in ("dropout", "loss", "window_items", "ema_decay", "length_buckets")}
    art.train_meta.write_text(json.dumps({"config": old, "catalog_sha256": file_sha256(art.catalog)}))
    assert model_is_current(art, TrainConfig().settings())
    assert not model_is_current(art, replace(TrainConfig(), dropout=0.1).settings())
