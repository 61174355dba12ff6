"""Issue 25 (hardening II), the small ones (item 6) and the metrics a vLLM operator can drop in (item 7): each test
fails on the code before its fix."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from grserve.config import EdgeConfig, LLMApiConfig, RankingLimits, SchedulerConfig, SearchConfig, ServerConfig
from test_security_limits import llm, ranking_engine  # noqa: F401 - shared fixtures

DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana" / "grserve.json"


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _sse(lines) -> list[dict | str]:
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ----------------------------------------------------------------------------------------------------------
# item 6
# ----------------------------------------------------------------------------------------------------------
def test_a_logit_bias_key_of_thousands_of_digits_is_a_400_naming_logit_bias(llm):  # noqa: F811
    """Before: a key past Python's 4,300-digit int() limit was a 500."""
    _, client = llm(EdgeConfig())
    for key in ("1" * 5000, "9" * 20):
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1,
                                                 "logit_bias": {key: 1.0}})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "logit_bias" and len(err["message"]) < 200, err


def test_a_stream_cut_by_a_planned_drain_ends_stopped_like_an_unstreamed_request(llm):  # noqa: F811
    """Before: a stream whose engine was stopped (SIGTERM's drain, then stop) ended with code ``internal`` and was
    logged as an engine failure; a request not yet streaming got 503 ``stopped``. Now both say ``stopped``."""
    eng, client = llm(EdgeConfig())
    real = eng.core.step

    def slow_step():
        time.sleep(0.02)
        return real()

    eng.core.step = slow_step
    eng.start()
    events: list = []
    try:
        with client.stream("POST", "/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 200,
                                                            "stream": True, "ignore_eos": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                    break
            threading.Thread(target=lambda: (eng.drain(0.0), eng.stop())).start()
            events += list(lines)
    finally:
        eng.core.step = real
        eng.stop()
    last = _sse(events)[-1]
    assert last != "[DONE]" and last["error"]["code"] == "stopped", last
    assert last["error"]["type"] == "server_error"


def test_the_preset_tokenizer_cache_is_a_user_cache_dir_and_what_is_reused_is_verified(tmp_path, monkeypatch):
    """Before: written under the working directory (.grserve-cache/tokenizers) and reused if two files existed,
    whatever they held. Now: $XDG_CACHE_HOME/grserve/tokenizers (or ~/.cache/grserve/tokenizers), reused only when
    every file is exactly what this version writes."""
    from grserve.engine.tokenizer import CHAT_TEMPLATE, load_tokenizer

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("GRSERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    tok = load_tokenizer("preset", 300, 64)
    d = (tmp_path / "xdg" / "grserve" / "tokenizers" / "grserve-bytes-v2-300").resolve()
    assert Path(tok.name_or_path) == d and not any(work.iterdir())
    ids = tok.encode("hello there")
    (d / "chat_template.jinja").write_text("{{ 'not the server template' }}")  # a foreign or stale file
    (d / "tokenizer.json").write_text('{"truncated": ')  # a torn write
    again = load_tokenizer("preset", 300, 64)
    assert (d / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert again.encode("hello there") == ids
    assert "not the server template" not in again.apply_chat_template([{"role": "user", "content": "x"}])
    assert LLMApiConfig().tokenizer_cache is None  # the flag's default is the user cache dir
    from grserve.engine.tokenizer import user_cache_dir

    assert user_cache_dir({}) == Path("~").expanduser() / ".cache" / "grserve" / "tokenizers"
    assert user_cache_dir({"GRSERVE_CACHE_DIR": "/c", "XDG_CACHE_HOME": "/x"}) == Path("/c/tokenizers")
    assert user_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/grserve/tokenizers")


def test_vllm_stream_options_are_accepted_and_continuous_usage_is_in_every_chunk(llm):  # noqa: F811
    """guidellm streams with ``stream_options: {include_usage, continuous_usage_stats}``: before, a 400 for the
    unknown field. Now every chunk carries the usage so far (vLLM's behaviour), then the final usage chunk."""
    eng, client = llm(EdgeConfig())
    eng.start()
    try:
        for path, extra in (("/v1/completions", {"prompt": [1, 2, 3]}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            body = {"model": "m", "max_tokens": 5, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **extra}
            r = client.post(path, json=body)
            assert r.status_code == 200, r.text
            chunks = _sse(r.text.splitlines())
            assert chunks[-1] == "[DONE]"
            data = chunks[:-1]
            assert all("usage" in c and c["usage"] for c in data), data
            done = [c["usage"]["completion_tokens"] for c in data]
            assert done == sorted(done) and done[-1] == 5
            assert data[-1]["choices"] == [] and data[-1]["usage"]["total_tokens"] == data[-1]["usage"][
                "prompt_tokens"] + 5
            r = client.post(path, json={**body, "stream_options": {"include_usage": False,
                                                                   "continuous_usage_stats": True}})
            assert r.status_code == 200 and all("usage" not in c for c in _sse(r.text.splitlines())[:-1])
    finally:
        eng.stop()


# ----------------------------------------------------------------------------------------------------------
# item 7
# ----------------------------------------------------------------------------------------------------------
def test_llm_metrics_are_counters_usage_fractions_and_phase_histograms(llm):  # noqa: F811
    """Before: running totals (preemptions, prefix-hit and prefill tokens) were gauges, no KV-cache usage fraction,
    no queue / prefill / decode histograms."""
    eng, client = llm(EdgeConfig())
    eng.start()
    try:
        assert client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4,
                                                     "ignore_eos": True}).status_code == 200
        fam = _families(client.get("/metrics").text)
    finally:
        eng.stop()
    for name in ("grserve_llm_preemptions", "grserve_llm_prefix_hit_tokens", "grserve_llm_prefill_tokens",
                 "grserve_llm_requests_expired", "grserve_llm_step_errors"):
        assert fam[name].type == "counter", (name, fam[name].type)
    assert fam["grserve_llm_prefill_tokens"].samples[0].value >= 3
    usage = fam["grserve_llm_kv_cache_usage_perc"]
    assert usage.type == "gauge" and 0.0 <= usage.samples[0].value <= 1.0
    for phase in ("queue", "prefill", "decode"):
        h = fam[f"grserve_llm_request_{phase}_time_seconds"]
        count = next(s.value for s in h.samples if s.name.endswith("_count"))
        assert h.type == "histogram" and count == 1, phase
    assert fam["grserve_llm_running"].type == "gauge"


def _gr_apps(tiny_model, ranking_engine):  # noqa: F811
    from grserve.catalog import CatalogStore, generate_catalog
    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.server.http.metrics import Metrics
    from grserve.server.ranking.app import create_ranking_app
    from grserve.server.retrieval.app import create_app

    model = tiny_model(seed=0)
    metrics = Metrics()
    eng = RetrievalEngine(model, CatalogStore(generate_catalog(300, 3, 8, 1), vocab_size=model.spec.vocab_size),
                          SearchConfig(beam_width=4), SchedulerConfig(max_batch_requests=4),
                          on_batch=metrics.on_batch, edge=EdgeConfig()).start()
    retrieval = TestClient(create_app(eng, ServerConfig(), metrics, edge=EdgeConfig()))
    ranking = TestClient(create_ranking_app(ranking_engine, RankingLimits(), edge=EdgeConfig()))
    assert retrieval.post("/v1/recommend", json={"history_tokens": [20, 30], "top_n": 2}).status_code == 200
    for _ in range(2):
        assert ranking.post("/v1/rank", json={"user_id": 0, "candidates": [0, 1, 2]}).status_code == 200
    return eng, retrieval, ranking


def test_retrieval_and_ranking_latency_buckets_pass_5_s_and_ranking_exports_its_cache_hit_rates(
        tiny_model, ranking_engine):  # noqa: F811
    eng, retrieval, ranking = _gr_apps(tiny_model, ranking_engine)
    try:
        for client in (retrieval, ranking):
            text = client.get("/metrics").text
            assert 'grserve_request_latency_seconds_bucket{le="60.0",' in text
            assert 'grserve_request_latency_seconds_bucket{le="120.0",' in text
            assert _families(text)["grserve_batches_run"].type == "counter"
        fam = _families(ranking.get("/metrics").text)
    finally:
        eng.stop()
    summary = ranking_engine.runner.stats.summary()
    for key, name in (("user_lookups", "user_cache_lookups"), ("user_hits", "user_cache_hits"),
                      ("ip_item_tokens", "item_kv_tokens"), ("cached_item_tokens", "item_kv_hit_tokens"),
                      ("total_tokens", "prompt_tokens")):
        family = fam[f"grserve_ranking_{name}"]
        assert family.type == "counter" and family.samples[0].value == summary[key], name
    assert summary["total_tokens"] > 0
    assert fam["grserve_ranking_user_cache_hit_rate"].samples[0].value == pytest.approx(summary["user_hit_rate"])
    assert fam["grserve_ranking_item_kv_hit_rate"].samples[0].value == pytest.approx(summary["item_hit_rate"])


def _dashboard_metrics() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", ())]
    assert exprs and all(t.get("datasource") for p in board["panels"] for t in p.get("targets", ()))
    return {m for e in exprs for m in re.findall(r"\bgrserve_[a-z0-9_]+", e)}


def test_the_grafana_dashboard_names_only_metrics_the_servers_export(llm, tiny_model, ranking_engine):  # noqa: F811
    """docs/grafana/grserve.json parses, and every metric its queries name is exported by one of the three
    servers (scraped after a request each), with the item-7 metrics among them."""
    names = _dashboard_metrics()
    eng, retrieval, ranking = _gr_apps(tiny_model, ranking_engine)
    llm_eng, llm_client = llm(EdgeConfig())
    llm_eng.start()
    try:
        assert llm_client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2,
                                                         "ignore_eos": True}).status_code == 200
        assert llm_client.post("/v1/completions", json={"model": "m", "prompt": []}).status_code == 400  # errors
        scraped = "\n".join(c.get("/metrics").text for c in (retrieval, ranking, llm_client))
    finally:
        eng.stop()
        llm_eng.stop()
    exported = {line.split("{")[0].split(" ")[0] for line in scraped.splitlines() if line and line[0] != "#"}
    assert names - exported == set(), sorted(names - exported)
    assert {"grserve_llm_request_queue_time_seconds_bucket", "grserve_llm_request_prefill_time_seconds_bucket",
            "grserve_llm_request_decode_time_seconds_bucket", "grserve_llm_kv_cache_usage_perc",
            "grserve_llm_preemptions_total", "grserve_llm_prefix_hit_tokens_total",
            "grserve_ranking_user_cache_hit_rate", "grserve_ranking_item_kv_hit_rate",
            "grserve_request_latency_seconds_bucket"} <= names


# the families a vLLM dashboard (vLLM's examples/online_serving grafana.json) and its usual alerts query
VLLM_FAMILIES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
    "vllm:request_inference_time_seconds_bucket", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_params_n_bucket",
    "vllm:request_params_max_tokens_bucket", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
}


def test_a_vllm_dashboard_reads_the_llm_server(llm):  # noqa: F811
    """Issue 44 item 3: vLLM's metric names beside grserve's, every series labelled with the model's name, the
    counts agreeing with grserve's own families."""
    eng, client = llm(EdgeConfig())
    eng.start()
    try:
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 3, "n": 2,
                                                 "ignore_eos": True})
        assert r.status_code == 200, r.text
        text = client.get("/metrics").text
    finally:
        eng.stop()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    vllm = {s.name for s in samples if s.name.startswith("vllm:")}
    assert VLLM_FAMILIES - vllm == set(), sorted(VLLM_FAMILIES - vllm)
    assert all(s.labels.get("model_name") == "m" for s in samples
               if s.name.startswith(("vllm:", "grserve_llm_"))), "a series without model_name"
    value = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
             for s in samples}
    assert value[("vllm:generation_tokens_total", ())] == value[("grserve_llm_generation_tokens_total", ())] == 6
    assert value[("vllm:request_params_n_count", ())] == 1 and value[("vllm:request_params_n_sum", ())] == 2
    assert value[("vllm:request_generation_tokens_count", ())] == 2  # one per generated sequence
    assert value[("vllm:request_prompt_tokens_sum", ())] == 3  # the prompt once per request
