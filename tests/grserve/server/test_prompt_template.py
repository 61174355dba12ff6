"""``--prompt-template``: item-id histories written as the model's own prompt — a MiniOneRec / LC-Rec instruction
(text) or a chat turn in the model's chat template — so ``/v1/recommend``'s ``history_items`` / ``history_sids``,
the offline API and ``grserve recommend`` answer exactly as the OpenAI routes answer the prompt a client would write
by hand (= HF beams on that prompt, ``test_openai_beams.py``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
from fastapi.testclient import TestClient  # noqa: E402

from gr_fixtures import INSTRUCTION  # noqa: E402
from grserve.config import BeamApiConfig, CatalogConfig, ModelConfig, SearchConfig, ServeConfig, ServerConfig  # noqa: E402
from grserve.engine.retrieval_engine import RetrievalEngine  # noqa: E402
from grserve.inputs.prompt_template import PromptTemplateError  # noqa: E402
from grserve.server.retrieval.app import create_app  # noqa: E402

HIST = [5, 77, 130, 12]


def _served(d, template, fmt="text", max_prompt_tokens=4096):
    cfg = ServeConfig(model=ModelConfig(source=str(d.path)), catalog=CatalogConfig(path=str(d.catalog)),
                      search=SearchConfig(beam_width=8), server=ServerConfig(max_prompt_tokens=max_prompt_tokens),
                      beams=BeamApiConfig(prompt_template=str(template), prompt_format=fmt))
    engine = RetrievalEngine.build(cfg).start()
    return cfg, engine, TestClient(create_app(engine, cfg.server, beams=cfg.beams, model_name="gr"))


def _items(r):
    assert r.status_code == 200, r.text
    body = r.json()
    return [(it["item_id"], round(it.get("score", it.get("cumulative_logprob")), 4))
            for it in body.get("items", body.get("choices"))]


@pytest.fixture(scope="module")
def mini(minionerec_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("t") / "minionerec.jinja"
    template.write_text(INSTRUCTION.replace("{history}", "{{ history }}"))
    cfg, engine, client = _served(minionerec_dir, template)
    yield minionerec_dir, cfg, engine, client, template
    engine.stop()


def test_history_items_become_the_instruction_prompt(mini):
    d, _, _, client, _ = mini
    by_hand = INSTRUCTION.format(history=", ".join("".join(d.strings[i]) for i in HIST))
    want = _items(client.post("/v1/completions", json={"model": "gr", "prompt": by_hand, "n": 8}))
    assert _items(client.post("/v1/recommend", json={"history_items": HIST, "top_n": 8})) == want
    sids = [[int(c) for c in d.sids[i]] for i in HIST]
    assert _items(client.post("/v1/recommend", json={"history_sids": sids, "top_n": 8})) == want
    bare = _items(client.post("/v1/recommend", json={"history_tokens": [1, 2, 3], "top_n": 8}))
    assert bare != want  # raw tokens are the prompt as given, never templated
    cold = client.post("/v1/recommend", json={"history_items": [], "top_n": 3}).json()
    assert cold["source"] == "popularity"  # an empty history stays a cold start


def test_the_offline_api_and_the_command_write_the_same_prompt(mini, tmp_path, capsys):
    from grserve.cli import main
    from grserve.recommender import Recommender

    d, cfg, _, client, template = mini
    want = _items(client.post("/v1/recommend", json={"history_items": HIST, "top_n": 8}))
    with Recommender(cfg) as rec:
        got = rec.recommend([{"history_items": HIST, "top_n": 8}], progress=False)[0]
    assert [(i.item_id, round(i.score, 4)) for i in got.items] == want
    (tmp_path / "in.jsonl").write_text(json.dumps({"history_items": HIST}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["recommend", "--model", str(d.path), "--catalog", str(d.catalog), "--input",
                 str(tmp_path / "in.jsonl"), "--output", str(out), "--beam-width", "8", "--top-n", "8",
                 "--prompt-template", str(template), "--no-progress"]) == 0
    row = json.loads(out.read_text())
    assert [(it["item_id"], round(it["score"], 4)) for it in row["items"]] == want


def test_a_long_history_loses_its_oldest_items_until_the_rendered_prompt_fits(minionerec_dir, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(INSTRUCTION.replace("{history}", "{{ history }}"))
    _, engine, client = _served(minionerec_dir, template, max_prompt_tokens=400)
    try:
        hist = list(range(150))
        r = client.post("/v1/recommend", json={"history_items": hist, "top_n": 4})
        assert r.status_code == 200, r.text
        dropped = r.json()["history_dropped"]
        assert 0 < dropped < 150
        kept = client.post("/v1/recommend", json={"history_items": hist[dropped:], "top_n": 4})
        assert kept.json()["history_dropped"] == 0 and _items(kept) == _items(r)
        fewer = client.post("/v1/recommend", json={"history_items": hist[dropped - 1:], "top_n": 4})
        assert fewer.json()["history_dropped"] == 1  # one more item would not fit
        r = client.post("/v1/recommend", json={"history_items": hist, "top_n": 4, "truncate": "none"})
        assert r.status_code == 413 and r.json()["error"]["field"] == "history_items"
    finally:
        engine.stop()


def test_a_chat_template_prompt(onerec_dir, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("I bought {{ items | join(' and ') }}. What next?")
    _, engine, client = _served(onerec_dir, template, fmt="chat")
    try:
        text = " and ".join("<|sid_begin|>" + "".join(onerec_dir.strings[i]) + "<|sid_end|>" for i in HIST)
        messages = [{"role": "user", "content": f"I bought {text}. What next?"}]
        want = _items(client.post("/v1/chat/completions", json={"model": "gr", "messages": messages, "n": 8}))
        assert _items(client.post("/v1/recommend", json={"history_items": HIST, "top_n": 8})) == want
    finally:
        engine.stop()


def test_a_bad_template_fails_at_start_up(minionerec_dir, tmp_path):
    bad = tmp_path / "bad.jinja"
    for text, fragment in (("{{ history ", "line 1"), ("{{ no_such_variable }}", "no_such_variable")):
        bad.write_text(text)
        with pytest.raises(PromptTemplateError, match=fragment):
            _served(minionerec_dir, bad)


def test_a_template_raising_any_error_fails_at_start_up_named(minionerec_dir, tmp_path):
    """Hostile pass 2: a template whose code raises a plain Python error (not a Jinja one) is refused at start-up as
    a ``PromptTemplateError`` naming the file (``grserve: error: FILE: ...``), never a traceback; the sandbox's
    refusals (``__class__``, ``range(10**9)``) likewise."""
    bad = tmp_path / "bad.jinja"
    for text, fragment in (("{{ 10 // 0 }}", "division"), ("{{ item_ids[0] + 'a' }}", "unsupported operand"),
                           ("{{ history.__class__ }}", "unsafe"),
                           ("{% for i in range(10**9) %}x{% endfor %}", "range")):
        bad.write_text(text)
        with pytest.raises(PromptTemplateError, match=fragment) as err:
            _served(minionerec_dir, bad)
        assert str(bad) in str(err.value)


def test_a_template_error_at_request_time_is_a_json_error_and_the_server_lives(minionerec_dir, tmp_path):
    """A template that fails only for some histories (here: item_ids is None for history_sids) answers that
    request with a JSON 5xx, and the next request is served."""
    t = tmp_path / "sum.jinja"
    t.write_text("{{ history }} {{ item_ids | sum }}")
    _, engine, client = _served(minionerec_dir, t)
    try:
        with TestClient(client.app, raise_server_exceptions=False) as c:
            sids = [[int(x) for x in minionerec_dir.sids[i]] for i in HIST]
            r = c.post("/v1/recommend", json={"history_sids": sids, "top_n": 4})
            assert 500 <= r.status_code < 600 and "error" in r.json()
            assert c.post("/v1/recommend", json={"history_items": HIST, "top_n": 4}).status_code == 200
    finally:
        engine.stop()


def test_a_templated_history_is_rendered_off_the_event_loop(mini, monkeypatch):
    """Hostile pass 2: with --prompt-template, history_items / history_sids are rendered (Jinja), chat-templated and
    tokenized (for a long history several times, while truncating) as a text prompt is: on a heavy-work thread, so
    one long history never stalls the other requests (a 16,000-item history took 0.05-0.5 s on the loop)."""
    import asyncio

    from grserve.inputs.prompt_template import PromptTemplate

    d, _, _, client, _ = mini
    on_loop: list[bool] = []
    render = PromptTemplate.render

    def spy(self, *args, **kw):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return render(self, *args, **kw)

    monkeypatch.setattr(PromptTemplate, "render", spy)
    sids = [[int(c) for c in d.sids[i]] for i in HIST]
    for body in ({"history_items": HIST}, {"history_sids": sids}):
        assert client.post("/v1/recommend", json={**body, "top_n": 4}).status_code == 200
    assert on_loop and not any(on_loop)


def test_an_input_the_template_cannot_render_is_a_bad_input_offline(minionerec_dir, tmp_path):
    """Hostile pass 2: the server answers such a request with a JSON 5xx and serves the next; the offline API
    raised the bare PromptTemplateError out of stream(), past on_error, ending the whole run (and grserve recommend
    with a traceback). It is the input's RecommendInputError (kind prompt_template, field its history), skipped
    with on_error like any bad input."""
    from grserve.recommender import RecommendInputError, Recommender

    t = tmp_path / "sum.jinja"
    t.write_text("{{ history }} {{ item_ids | sum }}")
    sids = [[int(x) for x in minionerec_dir.sids[i]] for i in HIST]
    inputs = [{"history_items": HIST}, {"history_sids": sids}, {"history_items": HIST[:2]}]
    with Recommender(model=str(minionerec_dir.path), catalog=str(minionerec_dir.catalog), prompt_template=str(t),
                     beam_width=8) as rec:
        seen = []
        out = list(rec.stream(inputs, top_n=4, progress=False, on_error=lambda i, e: seen.append((i, e.field, e.kind))))
        assert len(out) == 2 and seen == [(1, "history_sids", "prompt_template")]
        with pytest.raises(RecommendInputError, match="sum.jinja"):
            rec.recommend(inputs, top_n=4, progress=False)
