"""HTTP API of BAT ranking: /v1/rank with ids or raw tokens, registration, 4xx in the house format, metrics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from grserve.attention.bipartite import reference_forward
from grserve.cli import build_parser
from grserve.cli import main as cli_main
from grserve.config import EdgeConfig, RankingLimits
from grserve.config import RankingConfig
from grserve.engine.ranking_engine import RankingEngine
from grserve.engine.ranking_runner import RankingRunner
from grserve.ranking.layouts import build_prompt
from grserve.ranking.registry import synthetic_registry
from grserve.ranking.scoring import score_candidates
from grserve.server.ranking.app import create_ranking_app
from grserve.server.ranking.command import config_from_args


@pytest.fixture(scope="module")
def setup(tiny_model):
    model = tiny_model(seed=4)
    reg = synthetic_registry(model.spec.vocab_size, 60, (3, 6), [30, 50, 12, 80], seed=5)
    runner = RankingRunner(model, reg, RankingConfig(policy="bat", user_cache_bytes=1 << 20))
    engine = RankingEngine(runner).start()
    app = create_ranking_app(engine, RankingLimits(max_candidates=20, max_profile_tokens=100, max_item_tokens=16),
                             edge=EdgeConfig(admin_api_key="adm"))
    with TestClient(app, headers={"Authorization": "Bearer adm"}) as client:
        yield model, reg, client
    engine.stop()


def _err(r, status, etype, field=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert e["type"] == etype and e["message"]
    if field is not None:
        assert e["field"] == field
    return e


def test_rank_by_ids_matches_reference(setup):
    model, reg, client = setup
    cands = [5, 9, 1, 33, 17]
    r = client.post("/v1/rank", json={"user_id": 1, "candidates": cands, "top_k": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["items"]) == 3 and body["layout"] in ("user_prefix", "item_prefix")
    p = build_prompt(body["layout"], reg.user_tokens(1), [reg.item_tokens(i) for i in cands], reg.instruction)
    h, _ = reference_forward(model, p)
    ref = score_candidates(h[-1], model.lm_head.weight, torch.from_numpy(p.identifier_tokens), 3)
    assert [it["index"] for it in body["items"]] == ref.order
    assert [it["item_id"] for it in body["items"]] == [cands[k] for k in ref.order]
    np.testing.assert_allclose([it["score"] for it in body["items"]], ref.scores, atol=1e-5)
    assert body["computed_tokens"] + body["cached_tokens"] == body["total_tokens"]


def test_rank_raw_tokens_and_registration(setup):
    model, reg, client = setup
    r = client.post("/v1/rank", json={"user_tokens": [100, 200, 300], "candidate_tokens": [[7, 8, 31000], [9, 31001]]})
    assert r.status_code == 200, r.text
    assert r.json()["layout"] == "item_prefix" and r.json()["cached_tokens"] == 0  # raw: nothing cacheable
    r = client.post("/v1/users", json={"users": [{"user_id": 99, "tokens": list(range(50, 90))}]})
    assert r.status_code == 200 and r.json()["registered"] == 1
    r = client.post("/v1/items", json={"items": [{"item_id": 1000, "tokens": [11, 12, 13, 31500]}]})
    assert r.status_code == 200 and r.json()["total"] == 61
    r = client.post("/v1/rank", json={"user_id": 99, "candidates": [1000, 2]})
    assert r.status_code == 200, r.text
    if r.json()["layout"] == "item_prefix":
        assert r.json()["cached_tokens"] == 4 + len(reg.item_tokens(2))  # the new item's KV was precomputed


def test_rank_errors_name_the_field(setup):
    _, _, client = setup
    _err(client.post("/v1/rank", json={"user_id": 12345, "candidates": [1]}), 404, "unknown_user", "user_id")
    e = _err(client.post("/v1/rank", json={"user_id": 1, "candidates": [1, 777, 2, 888]}), 404, "unknown_items",
             "candidates[1]")
    assert "777" in e["message"] and "888" in e["message"]
    _err(client.post("/v1/rank", json={"user_id": 1, "candidates": []}), 400, "empty_candidates", "candidates")
    _err(client.post("/v1/rank", json={"user_id": 1, "candidates": list(range(21))}), 413, "too_many_candidates",
         "candidates")
    _err(client.post("/v1/rank", json={"user_tokens": list(range(16, 117)), "candidates": [1]}), 413,
         "profile_too_long", "user_tokens")
    _err(client.post("/v1/rank", json={"user_id": 1, "candidates": [3, 3]}), 400, "duplicate_candidates",
         "candidates[1]")
    _err(client.post("/v1/rank", json={"user_tokens": [1, 10**9], "candidates": [1]}), 400, "out_of_range",
         "user_tokens[1]")
    _err(client.post("/v1/rank", json={"candidates": [1]}), 422, "user_missing", "user")
    _err(client.post("/v1/rank", json={"user_id": 1, "user_tokens": [5], "candidates": [1]}), 422,
         "user_ambiguous", "user")
    _err(client.post("/v1/rank", json={"user_id": "1", "candidates": [1]}), 422, "int_type", "user_id")
    _err(client.post("/v1/rank", content=b"{nope", headers={"content-type": "application/json"}), 400,
         "invalid_json")
    _err(client.post("/v1/users", json={"users": [{"user_id": 5, "tokens": [-1]}]}), 400, "out_of_range",
         "users[0].tokens[0]")
    _err(client.post("/v1/items", json={"items": [{"item_id": 5, "tokens": list(range(17))}]}), 413,
         "item_too_long", "items[0].tokens")
    r = client.post("/v1/rank", json={"user_id": 0, "candidates": [1, 2]})  # still serving
    assert r.status_code == 200
    m = client.get("/metrics").text
    assert 'grserve_requests_total{route="/v1/rank",status="404"}' in m
    assert 'grserve_requests_total{route="/v1/rank",status="422"}' in m
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/v1/ranking/stats").json()["requests"] >= 1


def test_main_help_and_files(tmp_path, capsys):
    assert cli_main(["serve", "ranking", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--policy" in out and "(default: 8001)" in out  # the port default was missing from this --help
    items = tmp_path / "items.jsonl"
    items.write_text(json.dumps({"item_id": 1, "tokens": [5, 6]}) + "\n" + '{"item_id": 2}\n')
    assert cli_main(["serve", "ranking", "--items-file", str(items), "--port", "0"]) == 2
    assert "items.jsonl:2" in capsys.readouterr().err


def test_flags_build_the_ranking_config():
    """The user-facing names --user-cache-mb (MiB) and --window-s map onto user_cache_bytes and user_window_s."""
    cfg = config_from_args(build_parser().parse_args(["serve", "ranking", "--policy", "recompute"]))
    assert cfg.ranking.policy == "recompute"
    assert cfg.ranking.user_cache_bytes == 64 << 20 and cfg.ranking.user_window_s == 1800 and cfg.server.port == 8001
    cfg = config_from_args(build_parser().parse_args(["serve", "ranking", "--user-cache-mb", "1.5", "--window-s", "60",
                                                      "--max-candidates", "7", "--num-users", "3", "--seed", "2"]))
    assert cfg.ranking.user_cache_bytes == int(1.5 * 2**20) and cfg.ranking.user_window_s == 60
    assert cfg.limits.max_candidates == 7 and cfg.data.num_users == 3 and cfg.data.seed == cfg.model.seed == 2
