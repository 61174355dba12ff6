"""The offline API (``from grserve import Recommender, LLM``) and ``grserve recommend``: the same answers as the
servers for the same requests, the same refusals, deterministic capacity batching, streaming JSONL with line-numbered
errors, and ``import grserve`` without torch."""

import json
import subprocess
import sys

import numpy as np
import pytest
from fastapi.testclient import TestClient

from grserve.catalog import generate_catalog, save_catalog
from grserve.config import SchedulerConfig
from grserve.offline_batching import OfflineBatches
from grserve.recommender import RecommendInputError, Recommender, serve_config

BW = 8


@pytest.fixture(scope="module")
def catalog_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cat") / "catalog.jsonl"
    save_catalog(generate_catalog(1500, 3, 64, seed=4), path)
    return path


@pytest.fixture(scope="module")
def cfg(catalog_file):
    # a small token capacity and request cap: the requests below make several batches of different sizes
    return serve_config(model="tiny", catalog=str(catalog_file), beam_width=BW, token_capacity=60,
                        max_batch_requests=5, max_prompt_tokens=120, max_top_n=BW)


@pytest.fixture(scope="module")
def rec(cfg):
    with Recommender(cfg) as r:
        yield r


def requests_of(catalog, n=17, seed=0):
    rng = np.random.default_rng(seed)
    ids, sids = catalog.item_ids, catalog.sids
    out = []
    for i in range(n):
        rows = rng.choice(len(ids), int(rng.integers(1, 9)), replace=False)
        kind = i % 4
        if kind == 0:
            out.append({"history_items": ids[rows].tolist(), "top_n": int(rng.integers(1, BW + 1))})
        elif kind == 1:
            out.append({"history_sids": sids[rows].tolist(), "exclude_items": ids[rows[:2]].tolist()})
        elif kind == 2:
            out.append({"history_tokens": catalog.layout.sids_to_tokens(sids[rows]).tolist(), "beam_width": 4,
                        "top_n": 3})
        else:
            out.append(ids[rows].tolist())  # a bare list of item ids
    return out


def as_server_body(r):
    return r if isinstance(r, dict) else {"history_items": r}


def test_api_results_equal_the_servers(cfg, rec):
    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.server.retrieval.app import create_app

    reqs = requests_of(rec.catalog)
    ours = rec.recommend(reqs, top_n=BW, progress=False)
    engine = RetrievalEngine.build(cfg)
    engine.start()
    try:
        client = TestClient(create_app(engine, cfg.server))
        for r, mine in zip(reqs, ours, strict=True):
            body = as_server_body(r)
            resp = client.post("/v1/recommend", json={"top_n": BW, **body})
            assert resp.status_code == 200, resp.text
            theirs = resp.json()["items"]
            assert [it["item_id"] for it in theirs] == mine.item_ids
            assert [it["sid"] for it in theirs] == [list(it.sid) for it in mine.items]
            assert np.allclose([it["score"] for it in theirs], [it.score for it in mine.items], atol=1e-4)
    finally:
        engine.stop()


def test_api_refuses_what_the_server_refuses_with_its_message(cfg, rec):
    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.server.retrieval.app import create_app

    bad = [{"history_items": [1, 2, 10**9]}, {"history_sids": [[1, 2]]}, {"history_item": [1]},
           {"history_items": [1], "history_tokens": [20]}, {"history_items": [1], "top_n": BW + 1},
           {"history_tokens": [1] * 121, "truncate": "none"},
           {"history_items": [1] * 16_385}, {"history_sids": [[0, 0, 0]] * 16_385, "truncate": "left"},
           {"history_items": [1], "exclude_items": list(range(4097))}]  # --max-history-entries, --max-exclude-items
    engine = RetrievalEngine.build(cfg)
    client = TestClient(create_app(engine, cfg.server))
    for i, body in enumerate(bad):
        err = client.post("/v1/recommend", json={"top_n": BW, **body}).json()["error"]
        with pytest.raises(RecommendInputError) as exc:
            rec.recommend([[int(rec.catalog.item_ids[0])], body], top_n=BW, progress=False)
        assert exc.value.index == 1 and exc.value.message == err["message"] and exc.value.field == err["field"], i


def test_cold_start_and_truncation_equal_the_servers(cfg, rec, tmp_path):
    """An empty history (the popularity order, ``source``) and a history cut by ``truncate`` left
    (``history_dropped``) come back from the API as the server answers them, in input order among model answers."""
    from grserve.catalog.popularity import Popularity
    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.server.retrieval.app import create_app

    ids = rec.catalog.item_ids
    counts = {str(int(i)): int(n) for i, n in zip(ids[:40], range(40, 0, -1))}
    (tmp_path / "pop.json").write_text(json.dumps(counts))
    long = ids[:45].tolist()  # 45 items × depth 3 = 135 tokens > --max-prompt-tokens 120: the oldest 5 are cut
    reqs = [{"history_items": []}, {"history_items": long}, ids[5:8].tolist(),
            {"history_items": [], "exclude_items": ids[:2].tolist()}, {"history_sids": []}]
    from dataclasses import replace

    pcfg = replace(cfg, catalog=replace(cfg.catalog, popularity=str(tmp_path / "pop.json")))
    with Recommender(pcfg) as api:
        ours = api.recommend(reqs, top_n=BW, progress=False)
    assert [r.source for r in ours] == ["popularity", "model", "model", "popularity", "popularity"]
    assert ours[1].history_dropped == 5 and ours[0].history_dropped == 0
    assert ours[0].item_ids == [int(i) for i in ids[:BW]] and ours[3].item_ids == [int(i) for i in ids[2:BW + 2]]
    engine = RetrievalEngine.build(cfg)
    engine.start()
    try:
        client = TestClient(create_app(engine, cfg.server, popularity=Popularity.load(tmp_path / "pop.json")))
        for r, mine in zip(reqs, ours, strict=True):
            resp = client.post("/v1/recommend", json={"top_n": BW, **as_server_body(r)})
            assert resp.status_code == 200, resp.text
            theirs = resp.json()
            assert [it["item_id"] for it in theirs["items"]] == mine.item_ids
            assert (theirs["source"], theirs["history_dropped"]) == (mine.source, mine.history_dropped)
            assert np.allclose([it["score"] for it in theirs["items"]], [it.score for it in mine.items], atol=1e-4)
    finally:
        engine.stop()


def test_recommend_is_deterministic_and_independent_of_the_read_ahead(rec):
    reqs = requests_of(rec.catalog, n=23, seed=1)
    a = rec.recommend(reqs, top_n=BW, progress=False)
    b = list(rec.stream(iter(reqs), top_n=BW, progress=False, window=3))  # an iterator, a tiny window
    c = rec.recommend(reqs, top_n=BW, progress=False)
    assert [x.items for x in a] == [x.items for x in c]
    assert [x.item_ids for x in a] == [x.item_ids for x in b]


def test_skipping_bad_inputs_reports_their_index(rec):
    ids = rec.catalog.item_ids[:3].tolist()
    seen = []
    out = list(rec.stream([ids, {"history_items": [10**12]}, "not a list", ids[:1]], top_n=2, progress=False,
                          on_error=lambda i, e: seen.append((i, e.field))))
    assert len(out) == 2 and [i for i, _ in seen] == [1, 2]


class Req:
    def __init__(self, n, bw=4):
        import time

        self.num_tokens, self.beam_width, self.arrival = n, bw, time.perf_counter()


@pytest.mark.parametrize("window", [1, 4, 50])
def test_offline_batches_fill_by_capacity_keep_order_and_bound_memory(window):
    rng = np.random.default_rng(window)
    reqs = [Req(int(rng.integers(1, 40)), int(rng.choice([4, 8]))) for _ in range(60)]
    batches, held = [], []
    cfg = SchedulerConfig(token_capacity=64, max_batch_requests=5)

    def run(batch):
        batches.append(batch)
        assert len({r.beam_width for r in batch}) == 1
        assert len(batch) <= 5 and (len(batch) == 1 or sum(r.num_tokens for r in batch) <= 64)
        return [id(r) for r in batch]

    ob = OfflineBatches(cfg, run, window)
    out = []
    for r in reqs:
        out += ob.add(r)
        held.append(ob._added - ob._next)
    out += ob.flush()
    assert [req for req, _ in out] == reqs and [res for _, res in out] == [id(r) for r in reqs]  # once, in order
    assert max(held) <= window
    again = []
    ob2 = OfflineBatches(cfg, lambda b: (again.append([id(r) for r in b]), [0] * len(b))[1], window)
    for r in reqs:
        ob2.add(r)
    ob2.flush()
    assert again == [[id(r) for r in b] for b in batches]  # the same batches: a function of the inputs only
    answered = OfflineBatches(cfg, run, window)  # answers given without the engine keep their input place
    got = answered.add(reqs[0]) + answered.add_result("cold", "popular") + answered.add(reqs[1]) + answered.flush()
    assert [res for _, res in got] == [id(reqs[0]), "popular", id(reqs[1])]


def test_import_grserve_imports_no_torch():
    code = ("import sys, grserve\n"
            "from grserve import Recommender, serve_config\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert callable(Recommender) and grserve.__version__\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_recommend_command_streams_jsonl_and_names_bad_lines(tmp_path, catalog_file, rec, capsys):
    from grserve.cli import main

    reqs = requests_of(rec.catalog, n=9, seed=2)
    lines = [json.dumps({"user_id": f"u{i}", **as_server_body(r)}) for i, r in enumerate(reqs)]
    inp = tmp_path / "users.jsonl"
    inp.write_text("\n".join(lines[:4] + ["", "{not json", json.dumps({"history_items": [10**12]})] + lines[4:])
                   + "\n")
    out = tmp_path / "recs.jsonl"
    args = ["recommend", "--model", "tiny", "--catalog", str(catalog_file), "--input", str(inp), "--output",
            str(out), "--beam-width", str(BW), "--top-n", str(BW), "--token-capacity", "60",
            "--max-batch-requests", "5", "--no-progress"]
    assert main(args) == 1
    assert "line 6: not valid JSON" in capsys.readouterr().err
    assert main(args + ["--skip-bad-lines"]) == 0
    err = capsys.readouterr().err
    assert "skipped line 6" in err and "skipped line 7: history_items" in err and "2 bad lines skipped" in err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["user_id"] for r in rows] == [f"u{i}" for i in range(9)]
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 8, 9, 10, 11, 12]
    expected = rec.recommend(reqs, top_n=BW, progress=False)
    assert [[it["item_id"] for it in r["items"]] for r in rows] == [e.item_ids for e in expected]


def test_llm_generate_equals_the_servers_completions():
    from grserve import LLM, SamplingParams
    from grserve.server.llm.app import create_llm_app

    prompts = ["Hello there", "a b c", "The quick brown fox", "x"]
    with LLM("tiny-mha", scheduler="fcfs", num_blocks=256) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
        seeded = llm.generate(prompts, [SamplingParams(max_tokens=5, temperature=0.8, seed=s) for s in range(4)],
                              use_tqdm=False)
        eng = llm.engine
        spec = eng.model.spec
        client = TestClient(create_llm_app(eng, eng.tokenizer, "m", spec.max_position_embeddings, spec.vocab_size))
        for p, o in zip(prompts, outs, strict=True):
            r = client.post("/v1/completions", json={"model": "m", "prompt": p, "max_tokens": 6,
                                                      "temperature": 0}).json()
            assert r["choices"][0]["text"] == o.outputs[0].text and len(o.outputs[0].token_ids) == 6
            assert o.prompt_token_ids == eng.tokenizer.encode(p)
        for s, (p, o) in enumerate(zip(prompts, seeded)):
            r = client.post("/v1/completions", json={"model": "m", "prompt": p, "max_tokens": 5,
                                                      "temperature": 0.8, "seed": s}).json()
            assert r["choices"][0]["text"] == o.outputs[0].text
        by_ids = llm.generate([{"prompt_token_ids": outs[0].prompt_token_ids}],
                              SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
        assert by_ids[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_llm_chat_equals_the_servers_chat_completions():
    """``LLM.chat`` renders each conversation with the chat template as ``/v1/chat/completions`` does: the same
    greedy text, one conversation or several."""
    from grserve import LLM, SamplingParams
    from grserve.server.llm.app import create_llm_app

    convs = [[{"role": "user", "content": "Hello there"}],
             [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c"}]]
    with LLM("tiny-mha", scheduler="fcfs", num_blocks=256) as llm:
        outs = llm.chat(convs, SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
        one = llm.chat(convs[0], SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
        eng = llm.engine
        spec = eng.model.spec
        client = TestClient(create_llm_app(eng, eng.tokenizer, "m", spec.max_position_embeddings, spec.vocab_size))
        for conv, o in zip(convs, outs, strict=True):
            r = client.post("/v1/chat/completions", json={"model": "m", "messages": conv, "max_tokens": 5,
                                                           "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == o.outputs[0].text
            assert len(o.outputs[0].token_ids) == 5 and o.prompt == eng.tokenizer.apply_chat_template(conv)
        assert len(one) == 1 and one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
        from types import SimpleNamespace

        from grserve.server.llm import app as openai_routes

        later = openai_routes.time.time() + 1000  # created is the answer's time, not the server's start
        real, openai_routes.time = openai_routes.time, SimpleNamespace(time=lambda: later)
        try:
            r = client.post("/v1/chat/completions", json={"model": "m", "messages": convs[0], "max_tokens": 2})
        finally:
            openai_routes.time = real
        assert r.json()["created"] == int(later)


def test_progress_bars_are_off_when_stderr_is_not_a_terminal(monkeypatch):
    import io

    from grserve import llm_api, recommender

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe or a log file
    assert recommender._progress(True, 10).disable and llm_api._bar(True, 10).disable
    monkeypatch.setattr(sys, "stderr", Tty())
    assert not recommender._progress(True, 10).disable and not llm_api._bar(True, 10).disable
    assert recommender._progress(False, 10).disable


def test_the_offline_path_takes_what_the_command_takes_and_says_where_answers_come_from(cfg, rec, tmp_path,
                                                                                        catalog_file, capsys):
    """``user_id`` is echoed by the API as by the command; a raw JSONL line given as a ``str`` is refused, not
    taken as a text prompt; ``grserve recommend`` writes ``source`` (a cold start says so) and applies
    ``--max-history-entries`` as the server does."""
    from grserve.cli import main

    ids = rec.catalog.item_ids[:3].tolist()
    out = rec.recommend([{"user_id": "u1", "history_items": ids}, ids], top_n=2, progress=False)
    assert out[0].user_id == "u1" and out[0].to_dict()["user_id"] == "u1" and out[1].user_id is None
    assert out[0].item_ids == out[1].item_ids
    for raw in (json.dumps({"history_items": ids}), json.dumps(ids), " [1, 2]\n"):
        with pytest.raises(RecommendInputError) as exc:
            rec.recommend([raw], progress=False)
        assert "JSON object or array" in exc.value.message and exc.value.index == 0
    inp = tmp_path / "u.jsonl"
    inp.write_text(json.dumps({"user_id": 1, "history_items": []}) + "\n" + json.dumps(ids) + "\n"
                   + json.dumps({"history_items": ids * 3}) + "\n")
    res = tmp_path / "r.jsonl"
    args = ["recommend", "--model", "tiny", "--catalog", str(catalog_file), "--input", str(inp), "--output",
            str(res), "--beam-width", str(BW), "--top-n", "4", "--no-progress"]
    assert main(args) == 0
    rows = [json.loads(x) for x in res.read_text().splitlines()]
    assert [r["source"] for r in rows] == ["popularity", "model", "model"] and rows[0]["user_id"] == 1
    assert [r["history_dropped"] for r in rows] == [0, 0, 0]
    capsys.readouterr()
    assert main(args + ["--max-history-entries", "5"]) == 1  # line 3 has 9 entries: the server's 413
    assert "line 3: history_items: 9 entries, more than the limit of 5" in capsys.readouterr().err


@pytest.mark.parametrize("window", [1, 7, 50])
def test_batches_in_flight_are_the_batches_run_one_at_a_time(window):
    """Up to ``inflight`` batches on executor threads (the server's concurrency) form exactly the batches of the
    one-at-a-time path, whatever the threads' timing, and give every result once, in input order."""
    import random
    import time as time_mod

    rng = np.random.default_rng(window)
    reqs = [Req(int(rng.integers(1, 40)), int(rng.choice([4, 8]))) for _ in range(80)]
    cfg = SchedulerConfig(token_capacity=64, max_batch_requests=5)
    formed: dict[int, list] = {1: [], 3: []}
    jitter = random.Random(window)

    def runner(inflight):
        def run(batch):
            formed[inflight].append([id(r) for r in batch])
            if inflight > 1:
                time_mod.sleep(jitter.random() * 0.003)  # batches finish out of order
            return [id(r) for r in batch]
        return run

    outs = {}
    for inflight in (1, 3):
        ob = OfflineBatches(cfg, runner(inflight), window, inflight=inflight)
        got = []
        for k, r in enumerate(reqs):
            got += ob.add_result(r, id(r)) if k % 9 == 4 else ob.add(r)  # cold starts keep their place
        got += ob.flush()
        ob.close()
        outs[inflight] = got
        assert [req for req, _ in got] == reqs and [res for _, res in got] == [id(r) for r in reqs]
    assert sorted(map(tuple, formed[3])) == sorted(map(tuple, formed[1]))  # the same batches


def test_recommendations_do_not_depend_on_batches_in_flight(cfg):
    from dataclasses import replace

    with Recommender(replace(cfg, scheduler=replace(cfg.scheduler, max_inflight_batches=1))) as one:
        reqs = requests_of(one.catalog, n=21, seed=5)
        a = one.recommend(reqs, top_n=BW, progress=False)
    with Recommender(replace(cfg, scheduler=replace(cfg.scheduler, max_inflight_batches=3))) as three:
        b = three.recommend(reqs, top_n=BW, progress=False)
    assert [x.item_ids for x in a] == [x.item_ids for x in b]
    assert np.allclose([s.score for x in a for s in x.items], [s.score for x in b for s in x.items], atol=1e-5)
