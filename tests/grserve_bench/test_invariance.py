"""``grserve bench invariance``: the comparison (bitwise, so one score's last bit is a difference), what the server's
start line says it runs in, the seeded bodies, and (slow) a small run against a real retrieval server."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys

import pytest

from grserve_bench import invariance


def _answers(n: int = 6) -> list[dict]:
    return [{"ids": [10 * k + j for j in range(5)], "scores": [[-1.0 - 0.37 * j - 0.011 * k] for j in range(5)],
             "batch_size": 1} for k in range(n)]


def _next_up(x: float) -> float:
    """``x`` with its last mantissa bit flipped (one ulp away)."""
    return struct.unpack("<d", struct.pack("<q", struct.unpack("<q", struct.pack("<d", x))[0] ^ 1))[0]


def test_compare_detects_one_scores_last_bit():
    a = _answers()
    assert invariance.compare(a, json.loads(json.dumps(a))) == {
        "requests": 6, "identical_lists": 6, "identical_scores": 6, "max_abs_delta": 0.0, "failed": 0, "differ": []}
    b = json.loads(json.dumps(a))
    x = b[3]["scores"][4][0]
    b[3]["scores"][4][0] = _next_up(x)
    assert b[3]["scores"][4][0] != x and abs(b[3]["scores"][4][0] - x) == math.ulp(x)
    # through JSON as the server writes it: the shortest repr round-trips, so the flipped bit survives
    b = [invariance.answer_of("retrieval", 200, json.dumps(
        {"items": [{"item_id": i, "score": s[0]} for i, s in zip(r["ids"], r["scores"])],
         "batch_size": 4}).encode()) for r in b]
    c = invariance.compare(a, b)
    assert (c["identical_lists"], c["identical_scores"], c["differ"]) == (6, 5, [3])
    assert c["max_abs_delta"] == math.ulp(x) > 0


def test_compare_lists_failures_and_ranking_logprobs():
    a = _answers()
    b = json.loads(json.dumps(a))
    b[1]["ids"][2], b[1]["ids"][3] = b[1]["ids"][3], b[1]["ids"][2]  # two items swapped: the list differs
    b[2] = {"error": "HTTP 503"}
    c = invariance.compare(a, b)
    assert (c["identical_lists"], c["identical_scores"], c["failed"], c["differ"]) == (4, 4, 1, [1, 2])
    assert c["max_abs_delta"] == pytest.approx(0.37)  # the swapped items' scores, matched by id

    body = {"items": [{"index": 0, "item_id": 7, "score": 0.75, "logprob": -3.5},
                      {"index": 1, "item_id": 9, "score": 0.25, "logprob": -4.5}], "batch_size": 2}
    r = invariance.answer_of("ranking", 200, json.dumps(body).encode())
    assert r == {"ids": [7, 9], "scores": [[0.75, -3.5], [0.25, -4.5]], "batch_size": 2}
    body["items"][1]["logprob"] = _next_up(-4.5)  # only a logprob moved: still a difference
    s = invariance.answer_of("ranking", 200, json.dumps(body).encode())
    assert invariance.compare([r], [s])["identical_scores"] == 0
    assert invariance.answer_of("retrieval", 503, b"busy") == {"error": "HTTP 503: b'busy'"}


def test_server_precision_from_the_start_line():
    log = ("grserve: warmed up in 0.2 s\n"
           "grserve: model tiny (bfloat16: auto, CPU computes bf16 2.0x faster than fp32, cpu), catalog 20,000 "
           "items (depth 3, codebooks [256, 256, 256]), default beam width 128 -> http://127.0.0.1:1\n")
    p = invariance.server_precision(log, "", "retrieval")
    assert p["dtype"] == "bfloat16" and p["dtype_asked"] == "auto" and p["quantization"] == "none"
    assert p["batch_invariant"] is True
    assert p["dtype_label"] == "bfloat16: auto, CPU computes bf16 2.0x faster than fp32, cpu"
    log = ("grserve: model /m (float32, cpu; quantization int8 (W8A8 via torch._int_mm, 3.1x the float32 "
           "projection in a trial)), catalog 9 items\n")
    p = invariance.server_precision(log, "--dtype float32 --quantization=int8 --no-batch-invariant", "retrieval")
    assert (p["dtype"], p["dtype_asked"], p["quantization"], p["batch_invariant"]) == ("float32", "float32", "int8",
                                                                                       False)
    assert p["dtype_label"].endswith("in a trial)")
    p = invariance.server_precision("grserve: model tiny (float32: auto, AVX2 only, cpu)\n", "", "ranking")
    assert p["dtype"] == "float32" and p["batch_invariant"].startswith("by construction")
    assert invariance.server_precision("", "", "retrieval")["dtype"] is None


def test_bodies_are_seeded_different_and_capped():
    facts = {"vocab_size": 32000, "catalog": {"codebook_sizes": [256, 256, 256]}}
    a = invariance.make_bodies("retrieval", facts, 64, seed=0, top_n=20)
    assert a == invariance.make_bodies("retrieval", facts, 64, seed=0, top_n=20)
    assert len({json.dumps(b["history_tokens"]) for b in a}) == 64
    assert {b["beam_width"] for b in a} == {8, 32, 64}
    assert all(b["top_n"] == min(20, b["beam_width"]) for b in a)


@pytest.mark.slow
def test_invariance_command_against_a_retrieval_server(tmp_path):
    """8 different requests at concurrency 1 then 4 through a real ``grserve serve retrieval`` at its defaults:
    the report names the dtype the server chose and the machine, and the answers agree bit for bit."""
    out = tmp_path / "inv.json"
    p = subprocess.run([sys.executable, "-m", "grserve", "bench", "invariance", "--requests", "8",
                        "--concurrency", "1,4", "--out", str(out), "--log", str(tmp_path / "server.log"),
                        "--no-progress", "--startup-timeout", "300"],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    r = json.loads(out.read_text())
    line = json.loads(p.stdout.strip().splitlines()[-1])
    assert line["dtype"] in ("float32", "bfloat16") and line["dtype_asked"] == "auto"
    assert line["quantization"] == "none" and line["batch_invariant"] is True and line["machine"]["cpu"]
    assert [x["concurrency"] for x in r["runs"]] == [1, 4] and all(x["failed"] == 0 for x in r["runs"])
    (pair,) = r["pairs"]
    assert pair["requests"] == 8 and len(r["answers"]) == 2
    assert pair["identical_scores"] == 8 and p.returncode == 0, (p.stdout[-2000:], pair)
