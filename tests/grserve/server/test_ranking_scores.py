"""Issue 26 item 4: ``/v1/rank`` answers each candidate's identifier-token log-probability over the whole vocabulary
beside the softmax over the candidates, and ``docs/ranking.md``'s error table is what the server answers."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from grserve.attention.bipartite import reference_forward
from grserve.config import EdgeConfig, RankingConfig, RankingLimits
from grserve.engine.ranking_engine import RankingEngine
from grserve.engine.ranking_runner import RankingRunner
from grserve.ranking.layouts import build_prompt
from grserve.ranking.registry import synthetic_registry
from grserve.server.ranking.app import create_ranking_app

DOC = Path(__file__).resolve().parents[3] / "docs" / "ranking.md"
LIMITS = RankingLimits(max_candidates=20, max_profile_tokens=100, max_item_tokens=16)


@pytest.fixture(scope="module")
def setup(tiny_model):
    model = tiny_model(seed=4)
    reg = synthetic_registry(model.spec.vocab_size, 60, (3, 6), [30, 50, 12, 80], seed=5)
    engine = RankingEngine(RankingRunner(model, reg, RankingConfig(policy="bat", user_cache_bytes=1 << 20))).start()
    app = create_ranking_app(engine, LIMITS, edge=EdgeConfig(api_key="k", max_body_bytes=4096))
    with TestClient(app, headers={"Authorization": "Bearer k"}) as client:
        yield model, reg, client
    engine.stop()


def _reference_logprobs(model, reg, layout: str, user: int, cands: list[int]) -> np.ndarray:
    """log_softmax over the whole vocabulary at the discriminant token, read at each identifier token (fp64)."""
    p = build_prompt(layout, reg.user_tokens(user), [reg.item_tokens(i) for i in cands], reg.instruction)
    h, _ = reference_forward(model, p)
    logp = torch.log_softmax(model.logits(h[-1:]).double(), dim=-1)[0]
    return logp[torch.from_numpy(p.identifier_tokens)].numpy()


def test_logprob_is_the_full_vocabulary_log_probability(setup):
    """``logprob`` = the reference forward's log-softmax over the vocabulary at the identifier token; ``score`` =
    the softmax of the candidates' logprobs (so the same order); logprobs are not normalised over the candidates
    (their probabilities sum to less than 1, unlike the scores)."""
    model, reg, client = setup
    for user, cands in ((1, [5, 9, 1, 33, 17]), (2, [40, 3]), (0, [7, 8, 9, 10, 11, 12])):
        r = client.post("/v1/rank", json={"user_id": user, "candidates": cands, "top_k": len(cands)})
        assert r.status_code == 200, r.text
        body = r.json()
        ref = _reference_logprobs(model, reg, body["layout"], user, cands)
        got = {it["index"]: it for it in body["items"]}
        np.testing.assert_allclose([got[k]["logprob"] for k in range(len(cands))], ref, rtol=0, atol=2e-4)
        lp = np.array([it["logprob"] for it in body["items"]])
        assert (lp <= 0).all() and list(lp) == sorted(lp, reverse=True)
        np.testing.assert_allclose([it["score"] for it in body["items"]], np.exp(lp) / np.exp(lp).sum(), atol=1e-5)
        assert np.exp(lp).sum() < 1.0 - 1e-6 and sum(it["score"] for it in body["items"]) == pytest.approx(1.0)


def test_logprob_keeps_its_scale_where_the_score_does_not(setup):
    """The best candidate of a 2-item list and of a 6-item list: its softmax score is relative to the list, its
    logprob is an absolute log-probability (each equals the reference for its own prompt)."""
    model, reg, client = setup
    small = client.post("/v1/rank", json={"user_id": 3, "candidates": [21, 22], "top_k": 1}).json()
    big = client.post("/v1/rank", json={"user_id": 3, "candidates": [21, 22, 23, 24, 25, 26], "top_k": 6}).json()
    for body, cands in ((small, [21, 22]), (big, [21, 22, 23, 24, 25, 26])):
        ref = _reference_logprobs(model, reg, body["layout"], 3, cands)
        top = body["items"][0]
        assert top["logprob"] == pytest.approx(float(ref[top["index"]]), abs=2e-4)
        assert top["score"] == pytest.approx(float(np.exp(ref[top["index"]]) / np.exp(ref).sum()), abs=1e-5)


def _doc_error_rows() -> list[tuple[int, str]]:
    text = DOC.read_text()
    section = text[text.index("### Errors of `POST /v1/rank`"):]
    section = section[: section.index("\n\n", section.index("| status |"))]
    return [(int(m[1]), m[2]) for m in re.finditer(r"^\| (\d{3}) \| `(\w+)` \|", section, re.M)]


# one request per documented (status, type): (body, raw body, headers)
ERROR_REQUESTS: dict[str, tuple] = {
    "invalid_json": (None, b"{nope", {}),
    "empty_profile": ({"user_tokens": [], "candidates": [1]}, None, {}),
    "empty_candidates": ({"user_id": 1, "candidates": []}, None, {}),
    "empty_item": ({"user_tokens": [5], "candidate_tokens": [[7, 900], []]}, None, {}),
    "duplicate_candidates": ({"user_id": 1, "candidates": [3, 3]}, None, {}),
    "identifier_collision": ({"user_tokens": [5], "candidate_tokens": [[7, 900], [8, 900]]}, None, {}),
    "out_of_range": ({"user_tokens": [1, 10 ** 9], "candidates": [1]}, None, {}),
    "greater_than_equal": ({"user_id": 1, "candidates": [1], "top_k": 0}, None, {}),
    "invalid_api_key": ({"user_id": 1, "candidates": [1]}, None, {"Authorization": "Bearer wrong"}),
    "unknown_user": ({"user_id": 12345, "candidates": [1]}, None, {}),
    "unknown_items": ({"user_id": 1, "candidates": [1, 777]}, None, {}),
    "too_many_candidates": ({"user_id": 1, "candidates": list(range(21))}, None, {}),
    "profile_too_long": ({"user_tokens": list(range(16, 117)), "candidates": [1]}, None, {}),
    "item_too_long": ({"user_tokens": [5], "candidate_tokens": [list(range(20, 37))]}, None, {}),
    "body_too_large": ({"user_tokens": [12345] * 1000, "candidates": [1]}, None, {}),
    "user_missing": ({"candidates": [1]}, None, {}),
    "user_ambiguous": ({"user_id": 1, "user_tokens": [5], "candidates": [1]}, None, {}),
    "candidates_missing": ({"user_id": 1}, None, {}),
    "candidates_ambiguous": ({"user_id": 1, "candidates": [1], "candidate_tokens": [[5, 900]]}, None, {}),
    "int_type": ({"user_id": "1", "candidates": [1]}, None, {}),
    "extra_forbidden": ({"user_id": 1, "candidates": [1], "top": 3}, None, {}),
}


def test_docs_error_table_is_what_the_server_answers(setup):
    """Every row of docs/ranking.md's /v1/rank error table is sent and answers its status and type; every error
    the requests above provoke is in the table."""
    _, _, client = setup
    rows = _doc_error_rows()
    assert len(rows) == len(set(t for _, t in rows)) >= 15
    assert {t for _, t in rows} == set(ERROR_REQUESTS)
    for status, etype in rows:
        body, raw, headers = ERROR_REQUESTS[etype]
        if raw is not None:
            r = client.post("/v1/rank", content=raw, headers={"content-type": "application/json", **headers})
        else:
            r = client.post("/v1/rank", json=body, headers=headers)
        assert (r.status_code, r.json()["error"]["type"]) == (status, etype), (etype, r.text)
