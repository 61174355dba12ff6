"""OpenAI beams on the retrieval server: chat / text prompts answered with ranked SID beams as ``choices[]``, equal to
HF ``generate(num_beams, prefix_allowed_tokens_fn=<catalog trie>)`` over the same rendered prompt (``--scoring hf``);
think-then-recommend equal to the two HF stages; never a duplicate SID or an item outside the catalog; bad input a
400 naming the field in OpenAI's shape; the official ``openai`` client gets the ranked beams."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from fastapi.testclient import TestClient  # noqa: E402

from grserve.config import (  # noqa: E402
    BeamApiConfig,
    CatalogConfig,
    EdgeConfig,
    ModelConfig,
    SearchConfig,
    ServeConfig,
    ServerConfig,
)
from grserve.engine.retrieval_engine import RetrievalEngine  # noqa: E402
from grserve.server.retrieval.app import create_app  # noqa: E402


# ---- the reference: HF transformers on the model directory, nothing of grserve -----------------------------------
class HFReference:
    """The model directory through transformers alone: its tokenizer renders and encodes the prompt, its model runs
    beam search constrained by a trie of the items' SID token ids (built from the tokenizer)."""

    def __init__(self, d):
        self.tok = transformers.AutoTokenizer.from_pretrained(d.path)
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(d.path, attn_implementation="eager").float().eval()
        self.item_of: dict[tuple[int, ...], int] = {}
        self.children: dict[tuple[int, ...], set[int]] = {}
        for item, strings in enumerate(d.strings):
            ids = tuple(self.tok.convert_tokens_to_ids(s) for s in strings)
            self.item_of[ids] = item
            for level in range(len(ids)):
                self.children.setdefault(ids[:level], set()).add(ids[level])
        self.depth = len(d.strings[0])

    def chat_ids(self, messages, **kwargs) -> list[int]:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return self.tok.encode(text, add_special_tokens=False)

    @torch.inference_mode()
    def beams(self, ids: list[int], bw: int) -> list[tuple[int, float]]:
        """(item, summed log-prob) of HF's returned beams, best first."""
        x = torch.tensor([ids])
        n = x.shape[1]

        def allowed(_batch: int, seq: torch.Tensor) -> list[int]:
            return sorted(self.children.get(tuple(seq[n:].tolist()), ()))

        out = self.hf.generate(x, attention_mask=torch.ones_like(x), num_beams=bw, num_return_sequences=bw,
                               max_new_tokens=self.depth, do_sample=False, length_penalty=0.0, early_stopping=True,
                               prefix_allowed_tokens_fn=allowed, output_scores=True, return_dict_in_generate=True,
                               pad_token_id=0, eos_token_id=None)
        rows = out.sequences[:, n:].tolist()
        return [(self.item_of[tuple(r)], float(s)) for r, s in zip(rows, out.sequences_scores) if np.isfinite(float(s))]

    @torch.inference_mode()
    def think(self, ids: list[int], max_new: int, sid_begin: int, sample: dict | None = None) -> list[int]:
        """Stage 1: free text until sid_begin (HF generate), sid_begin appended when the limit is reached."""
        x = torch.tensor([ids])
        kw: dict = dict(do_sample=False)
        if sample is not None:
            sample = dict(sample)
            torch.manual_seed(sample.pop("seed"))  # HF samples from the global generator
            kw = dict(do_sample=True, **sample)
        out = self.hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, eos_token_id=sid_begin,
                               pad_token_id=0, **kw)
        gen = out[0, x.shape[1]:].tolist()
        return gen if gen and gen[-1] == sid_begin else gen + [sid_begin]


def _engine(d, **search):
    # float32: HF transformers at fp32 is the reference these tests compare with (the default --dtype auto is bf16
    # on a CPU with fast bf16)
    cfg = ServeConfig(model=ModelConfig(source=str(d.path), dtype="float32"),
                      catalog=CatalogConfig(path=str(d.catalog)),
                      search=SearchConfig(**{"scoring": "hf", "beam_width": 16, **search}))
    return RetrievalEngine.build(cfg).start()


def _client(engine, edge=None, **beams):
    return TestClient(create_app(engine, ServerConfig(max_top_n=64), edge=edge, beams=BeamApiConfig(**beams),
                                 model_name="gr"))


@pytest.fixture(scope="module")
def onerec(onerec_dir):
    engine = _engine(onerec_dir)
    with _client(engine, max_think_tokens=32) as client:
        yield onerec_dir, engine, client, HFReference(onerec_dir)
    engine.stop()


def _history(d, items) -> str:
    return "".join("<|sid_begin|>" + "".join(d.strings[i]) + "<|sid_end|>" for i in items)


def _check_answer(body, catalog, n):
    """Ranked, n choices, each one catalog item whose SID text is its content; no SID twice."""
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(n))
    sids = [tuple(c["sid"]) for c in choices]
    assert len(set(sids)) == len(sids)  # never a duplicate SID
    scores = [c["cumulative_logprob"] for c in choices]
    assert scores == sorted(scores, reverse=True)
    for c in choices:
        assert catalog.sid_of(c["item_id"]) == tuple(c["sid"])  # an item of the catalog, with its own SID
        content = c["message"]["content"] if "message" in c else c["text"]
        assert content == catalog.text.item_text(tuple(c["sid"]))


# ---- equal to HF --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bw", [4, 16])
def test_chat_beams_equal_hf_generate_over_the_rendered_prompt(onerec, bw):
    d, engine, client, ref = onerec
    for k, items in enumerate(([3, 8, 21], [150, 7], [60])):
        messages = [{"role": "system", "content": "You recommend items."},
                    {"role": "user", "content": f"I bought {_history(d, items)}. What next? ({k})"}]
        r = client.post("/v1/chat/completions", json={"model": "gr", "messages": messages, "n": bw, "beam_width": bw})
        assert r.status_code == 200, r.text
        body = r.json()
        _check_answer(body, engine.catalogs.current(), bw)
        want = ref.beams(ref.chat_ids(messages) + [ref.tok.convert_tokens_to_ids("<|sid_begin|>")], bw)
        assert [c["item_id"] for c in body["choices"]] == [i for i, _ in want]
        assert max(abs(c["cumulative_logprob"] - s) for c, (_, s) in zip(body["choices"], want)) <= 1e-4
        prompt_len = len(ref.chat_ids(messages)) + 1
        assert body["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": 3 * bw,
                                 "total_tokens": prompt_len + 3 * bw, "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_beams_of_an_instruction_prompt_equal_hf_generate(minionerec_dir):
    from gr_fixtures import INSTRUCTION

    engine = _engine(minionerec_dir)
    ref = HFReference(minionerec_dir)
    try:
        with _client(engine) as client:
            history = ", ".join("".join(minionerec_dir.strings[i]) for i in (5, 77, 130))
            prompt = INSTRUCTION.format(history=history)
            r = client.post("/v1/completions", json={"model": "gr", "prompt": prompt, "n": 8, "best_of": 8,
                                                    "use_beam_search": True, "max_tokens": 3})
            assert r.status_code == 200, r.text
            _check_answer(r.json(), engine.catalogs.current(), 8)
            want = ref.beams(ref.tok.encode(prompt), 8)  # the text prompt encoded as the tokenizer does by default
            assert [c["item_id"] for c in r.json()["choices"]] == [i for i, _ in want]
            assert max(abs(c["cumulative_logprob"] - s) for c, (_, s) in zip(r.json()["choices"], want)) <= 1e-4
            ids = ref.tok.encode(prompt)  # the same as token ids
            r2 = client.post("/v1/completions", json={"model": "gr", "prompt": ids, "n": 8, "beam_width": 8})
            assert [c["item_id"] for c in r2.json()["choices"]] == [i for i, _ in want]
    finally:
        engine.stop()


def test_think_then_recommend_equals_the_two_hf_stages(thinking_onerec_dir):
    d = thinking_onerec_dir
    engine = _engine(d)
    ref = HFReference(d)
    sid_begin = ref.tok.convert_tokens_to_ids("<|sid_begin|>")
    forced_seen = natural_seen = False
    try:
        with _client(engine, max_think_tokens=64) as client:
            for k, limit, sample in ((0, 30, None), (1, 10, None), (2, 30, None),
                                     (3, 12, dict(temperature=0.8, top_p=0.9, top_k=0, seed=5))):
                messages = [{"role": "user", "content": f"question {k}: what next?"}]
                extra = {} if sample is None else {"temperature": 0.8, "top_p": 0.9, "seed": 5}
                r = client.post("/v1/chat/completions", json={"model": "gr", "messages": messages, "n": 6,
                                                              "beam_width": 6, "max_think_tokens": limit, **extra})
                assert r.status_code == 200, r.text
                body = r.json()
                ids = ref.chat_ids(messages)
                thought = ref.think(ids, limit, sid_begin, sample)
                assert body["thinking"]["tokens"] == len(thought)
                assert body["thinking"]["text"] == ref.tok.decode(thought[:-1])
                assert body["thinking"]["sid_begin_forced"] == (len(thought) == limit + 1)
                forced_seen |= body["thinking"]["sid_begin_forced"]
                natural_seen |= not body["thinking"]["sid_begin_forced"]
                want = ref.beams(ids + thought, 6)
                assert [c["item_id"] for c in body["choices"]] == [i for i, _ in want]
                assert max(abs(c["cumulative_logprob"] - s) for c, (_, s) in zip(body["choices"], want)) <= 1e-4
                assert body["usage"]["completion_tokens"] == len(thought) + 3 * 6
        assert forced_seen and natural_seen  # both ends of a thought were exercised
    finally:
        engine.stop()


def test_think_without_sid_begin_ends_at_the_models_first_sid_token(minionerec_dir):
    """An LC-Rec layout has no sid_begin: the thought ends where the model writes its first level-0 SID token (not
    kept), or at the limit; the beams search that position. Equal to HF ``generate(eos_token_id=<level-0 SID
    tokens>)`` without that last token, then the constrained beams on prompt + thought."""
    d = minionerec_dir
    engine = _engine(d)
    ref = HFReference(d)
    firsts = sorted({ref.tok.convert_tokens_to_ids(row[0]) for row in d.strings})
    natural_seen = forced_seen = False
    try:
        with _client(engine, max_think_tokens=64) as client:
            for k, limit, sample in ((0, 12, None), *((k, 24, dict(temperature=1.5, top_p=1.0, top_k=0, seed=k))
                                                      for k in range(1, 7))):
                prompt = f"question {k}: what next?"
                extra = {} if sample is None else {"temperature": 1.5, "seed": k}
                r = client.post("/v1/completions", json={"model": "gr", "prompt": prompt, "n": 4, "beam_width": 4,
                                                         "max_think_tokens": limit, **extra})
                assert r.status_code == 200, r.text
                body = r.json()
                ids = ref.tok.encode(prompt)
                gen = ref.think(ids, limit, firsts, sample)[:-1]  # the appended "sid_begin" stand-in dropped
                natural = bool(gen) and gen[-1] in firsts
                thought = gen[:-1] if natural else gen
                assert body["thinking"]["tokens"] == len(thought) and body["thinking"]["sid_begin_forced"] == (
                    not natural)
                assert body["thinking"]["text"] == ref.tok.decode(thought)
                natural_seen |= natural
                forced_seen |= not natural
                want = ref.beams(ids + thought, 4)
                assert [c["item_id"] for c in body["choices"]] == [i for i, _ in want]
                assert max(abs(c["cumulative_logprob"] - s) for c, (_, s) in zip(body["choices"], want)) <= 1e-4
        assert natural_seen and forced_seen
    finally:
        engine.stop()


# ---- streaming, /v1/recommend, the openai client -----------------------------------------------------------------
def test_stream_sends_the_finished_beam_set_once(onerec):
    d, engine, client, _ = onerec
    messages = [{"role": "user", "content": f"I liked {_history(d, [4, 9])}."}]
    whole = client.post("/v1/chat/completions", json={"model": "gr", "messages": messages, "n": 5}).json()
    with client.stream("POST", "/v1/chat/completions", json={"model": "gr", "messages": messages, "n": 5,
                                                             "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 3
    beams, use = json.loads(events[0]), json.loads(events[1])
    assert beams["object"] == "chat.completion.chunk" and len(beams["choices"]) == 5
    assert [c["item_id"] for c in beams["choices"]] == [c["item_id"] for c in whole["choices"]]
    assert [c["delta"]["content"] for c in beams["choices"]] == [c["message"]["content"] for c in whole["choices"]]
    assert use["choices"] == [] and use["usage"] == whole["usage"]


def test_recommend_takes_messages_and_items_laid_out_as_the_chat_writes_them(onerec):
    d, engine, client, _ = onerec
    messages = [{"role": "user", "content": f"I liked {_history(d, [12, 30])}."}]
    chat = client.post("/v1/chat/completions", json={"model": "gr", "messages": messages, "n": 6}).json()
    rec = client.post("/v1/recommend", json={"messages": messages, "top_n": 6})
    assert rec.status_code == 200, rec.text
    assert [it["item_id"] for it in rec.json()["items"]] == [c["item_id"] for c in chat["choices"]]
    layout = engine.catalogs.current().layout
    items = client.post("/v1/recommend", json={"history_items": [12, 30], "top_n": 4}).json()["items"]
    tokens = layout.items_to_tokens(np.array([d.sids[12], d.sids[30]])).tolist() + [layout.sid_begin]
    same = client.post("/v1/recommend", json={"history_tokens": tokens, "top_n": 4}).json()["items"]
    assert items == same  # history_items = the wrapped SID tokens, the beams starting after sid_begin


def test_openai_client_gets_ranked_beams(onerec):
    openai = pytest.importorskip("openai")
    from conftest import live_server

    d, engine, client, _ = onerec
    messages = [{"role": "user", "content": f"I liked {_history(d, [40])}."}]
    want = client.post("/v1/chat/completions", json={"model": "gr", "messages": messages, "n": 4,
                                                     "beam_width": 8}).json()
    with live_server(client.app) as url:
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        got = api.chat.completions.create(model="gr", messages=messages, n=4, extra_body={"beam_width": 8})
        assert [c.message.content for c in got.choices] == [c["message"]["content"] for c in want["choices"]]
        assert [c.model_extra["item_id"] for c in got.choices] == [c["item_id"] for c in want["choices"]]
        assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]
        done = api.completions.create(model="gr", prompt=[int(t) for t in np.arange(5, 25)], n=3,
                                      extra_body={"beam_width": 6})
        assert len(done.choices) == 3 and all("item_id" in c.model_extra for c in done.choices)
        with pytest.raises(openai.BadRequestError) as e:
            api.chat.completions.create(model="gr", messages=messages, n=9, extra_body={"beam_width": 8})
        assert e.value.body["param"] == "n"


# ---- bad input: a 400 naming the field, the server keeps serving --------------------------------------------------
BAD = [
    ({"n": 9, "beam_width": 8}, 400, "n"),
    ({"model": "other"}, 404, "model"),
    ({"max_tokens": 2}, 400, "max_tokens"),
    ({"max_completion_tokens": 1}, 400, "max_completion_tokens"),
    ({"max_think_tokens": 33}, 400, "max_think_tokens"),
    ({"max_think_tokens": -1}, 400, "max_think_tokens"),
    ({"use_beam_search": False}, 400, None),
    ({"best_of": 4, "beam_width": 8}, 400, None),
    ({"beam_width": 10_000}, 400, "beam_width"),
    ({"top_logprobs": 3, "logprobs": True}, 400, "top_logprobs"),
    ({"chat_template_kwargs": {"tokenize": True}}, 400, None),
    ({"messages": [{"role": "user", "content": "I liked <s_a_12>"}]}, 400, "messages[0].content"),  # code 12 ≥ 12
    ({"messages": [{"role": "user", "content": "I liked <s_b_007>"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "<|sid_begin|><s_a_1><s_b_2><|sid_end|>"}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x <s_a_1><s_b_2><s_c_3><|sid_end|>"}]}, 400, "messages[0].content"),
    ({"exclude_items": list(range(5000))}, 413, "exclude_items"),
]


@pytest.mark.parametrize("change,status,param", BAD)
def test_bad_input_is_a_4xx_naming_the_field(onerec, change, status, param):
    _, _, client, _ = onerec
    body = {"model": "gr", "messages": [{"role": "user", "content": "hello"}], "n": 2, **change}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    ok = client.post("/v1/chat/completions", json={"model": "gr", "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200  # nothing else is affected


def test_excluded_items_never_come_back(onerec):
    d, engine, client, _ = onerec
    messages = [{"role": "user", "content": f"I liked {_history(d, [2])}."}]
    first = client.post("/v1/chat/completions", json={"model": "gr", "messages": messages, "n": 10}).json()
    top = [c["item_id"] for c in first["choices"]][:4]
    again = client.post("/v1/chat/completions", json={"model": "gr", "messages": messages, "n": 10,
                                                      "exclude_items": top}).json()
    assert not set(top) & {c["item_id"] for c in again["choices"]}
    _check_answer(again, engine.catalogs.current(), 10)


def test_auth_metrics_and_a_model_without_tokenizer(onerec, tiny_model):
    from grserve.catalog import CatalogStore, generate_catalog

    d, engine, _, _ = onerec
    with _client(engine, edge=EdgeConfig(api_key="k")) as client:
        body = {"model": "gr", "messages": [{"role": "user", "content": "hi"}]}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape here
        r = client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200
        metrics = client.get("/metrics").text
        assert 'route="/v1/chat/completions"' in metrics
    preset = RetrievalEngine(tiny_model(seed=0), CatalogStore(generate_catalog(500, 3, 16, seed=1))).start()
    try:
        with _client(preset) as client:
            r = client.post("/v1/chat/completions", json={"model": "gr", "messages": [{"role": "user",
                                                                                       "content": "hi"}]})
            assert r.status_code == 400 and r.json()["error"]["code"] == "no_tokenizer"
            r = client.post("/v1/completions", json={"model": "gr", "prompt": [20, 30, 40], "n": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["text"].count("-") == 2  # codes, dash-joined
    finally:
        preset.stop()


def test_openai_beams_through_instances_equal_one_engine(onerec):
    """``serve --instances N``: the front end renders and encodes the prompt with the model's tokenizer and its bound
    catalog; an instance actor (Ray) runs the beams; the answer equals the one engine's."""
    ray = pytest.importorskip("ray")
    from grserve.cluster.gr.instance import spawn_gr_instance
    from grserve.cluster.gr.modes import ClusterRetrievalEngine
    from grserve.cluster.core.ray_runtime import new_incarnation, start_ray
    from grserve.config import ClusterConfig

    d, engine, client, _ = onerec
    # the dtype of the engine it is compared with (float32, pinned for the HF comparisons)
    cfg = ServeConfig(model=ModelConfig(source=str(d.path), dtype=engine.model.dtype_choice.name),
                      catalog=CatalogConfig(path=str(d.catalog)),
                      search=SearchConfig(scoring="hf", beam_width=16))
    cc = ClusterConfig(instances=1, heartbeat_timeout_s=10.0)
    owns = start_ray(None)
    actors = [spawn_gr_instance(0, "retrieval", cfg, cc, new_incarnation())]
    cluster = ClusterRetrievalEngine(actors, ray.get([a.info.remote() for a in actors]), cc, cfg).start()
    try:
        assert cluster.catalogs.current().layout == engine.catalogs.current().layout
        messages = [{"role": "user", "content": f"I liked {_history(d, [5, 6])}."}]
        body = {"model": "gr", "messages": messages, "n": 6, "max_think_tokens": 4}
        with _client(cluster, max_think_tokens=8) as front:
            got = front.post("/v1/chat/completions", json=body)
        want = client.post("/v1/chat/completions", json=body).json()
        assert got.status_code == 200, got.text
        assert [c["item_id"] for c in got.json()["choices"]] == [c["item_id"] for c in want["choices"]]
        assert got.json()["thinking"] == want["thinking"]
    finally:
        cluster.stop()
        if owns:
            ray.shutdown()


@pytest.mark.parametrize("prompt", ["", []])
def test_an_empty_completion_prompt_is_a_400_naming_prompt(onerec, prompt):
    """The hostile pass (issue 25): an empty prompt on the retrieval server's /v1/completions answered
    ``invalid 'None': ...`` with ``param`` null (a model-level check); the LLM server names ``prompt``."""
    _, _, client, _ = onerec
    r = client.post("/v1/completions", json={"model": "gr", "prompt": prompt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "None" not in err["message"], err


def test_a_request_level_error_never_names_a_field_none(onerec):
    """An error of the whole request (no field) reads as its message, not ``invalid 'None': ...``."""
    _, _, client, _ = onerec
    r = client.post("/v1/chat/completions", json={"model": "gr", "messages": [{"role": "user", "content": "hi"}],
                                                  "best_of": 4, "beam_width": 8})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is None and "None" not in err["message"] and err["message"], err


def test_per_token_logprobs_of_each_beam_equal_hf(onerec):
    """Asked, every choice carries its SID tokens' own log-probabilities (OpenAI's shape, no alternatives): under
    ``--scoring hf`` each equals HF's full-vocabulary log-softmax at that position of prompt + the item's tokens,
    and they sum to ``cumulative_logprob``."""
    d, engine, client, ref = onerec
    messages = [{"role": "user", "content": f"I liked {_history(d, [3, 8])}."}]
    r = client.post("/v1/chat/completions", json={"model": "gr", "messages": messages, "n": 4, "beam_width": 8,
                                                  "logprobs": True, "top_logprobs": 0})
    assert r.status_code == 200, r.text
    ids = ref.chat_ids(messages) + [ref.tok.convert_tokens_to_ids("<|sid_begin|>")]
    for c in r.json()["choices"]:
        content = c["logprobs"]["content"]
        tokens = [e["token"] for e in content]
        assert tokens == d.strings[c["item_id"]] and all(e["top_logprobs"] == [] for e in content)
        sid_ids = [ref.tok.convert_tokens_to_ids(t) for t in tokens]
        with torch.inference_mode():
            logits = ref.hf(torch.tensor([ids + sid_ids])).logits[0].float()
        want = [float(torch.log_softmax(logits[len(ids) - 1 + k], -1)[t]) for k, t in enumerate(sid_ids)]
        assert max(abs(e["logprob"] - w) for e, w in zip(content, want)) <= 1e-4
        assert abs(sum(e["logprob"] for e in content) - c["cumulative_logprob"]) <= 1e-4
    plain = client.post("/v1/chat/completions", json={"model": "gr", "messages": messages, "n": 4, "beam_width": 8})
    assert [c["item_id"] for c in plain.json()["choices"]] == [c["item_id"] for c in r.json()["choices"]]
    assert all(c["logprobs"] is None for c in plain.json()["choices"])
    r = client.post("/v1/completions", json={"model": "gr", "prompt": "x", "n": 2, "logprobs": 0})
    for c in r.json()["choices"]:
        lp = c["logprobs"]
        assert [c["text"][o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] == lp["tokens"]
        assert abs(sum(lp["token_logprobs"]) - c["cumulative_logprob"]) <= 1e-4


# ---- client defaults: a parameter at its default (or null) asks for nothing and is accepted -----------------------
CHAT_DEFAULTS = {"logprobs": False, "top_logprobs": None, "stop": None, "frequency_penalty": 0,
                 "presence_penalty": 0.0, "response_format": {"type": "text"}, "logit_bias": None, "temperature": None,
                 "top_p": None, "seed": None, "tools": None, "tool_choice": None, "parallel_tool_calls": None,
                 "user": None, "stream": False, "stream_options": None, "max_tokens": None, "n": None}
COMPLETION_DEFAULTS = {"logprobs": None, "echo": False, "stop": None, "frequency_penalty": 0, "presence_penalty": 0,
                       "suffix": None, "best_of": None, "logit_bias": {}, "temperature": None}


def test_client_defaults_are_accepted_and_change_nothing(onerec):
    d, _, client, _ = onerec
    messages = [{"role": "user", "content": f"I liked {_history(d, [2, 5])}."}]
    plain = client.post("/v1/chat/completions", json={"model": "gr", "messages": messages, "n": 4}).json()
    r = client.post("/v1/chat/completions", json={"model": "gr", "messages": messages, **CHAT_DEFAULTS, "n": 4})
    assert r.status_code == 200, r.text
    assert [c["item_id"] for c in r.json()["choices"]] == [c["item_id"] for c in plain["choices"]]
    prompt = f"I liked {_history(d, [2, 5])}. Next: "
    plain = client.post("/v1/completions", json={"model": "gr", "prompt": prompt, "n": 3}).json()
    r = client.post("/v1/completions", json={"model": "gr", "prompt": prompt, "n": 3, **COMPLETION_DEFAULTS})
    assert r.status_code == 200, r.text
    assert [c["item_id"] for c in r.json()["choices"]] == [c["item_id"] for c in plain["choices"]]


@pytest.mark.parametrize("path,change,param", [
    ("/v1/chat/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": False}, "frequency_penalty"),  # a bool is not 0
    ("/v1/chat/completions", {"stop": ["\n"]}, "stop"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 2}, "logprobs"),  # alternatives are not returned (0: the tokens' own)
    ("/v1/completions", {"echo": True}, "echo"),
])
def test_a_value_the_beam_routes_cannot_honour_is_a_400_naming_it(onerec, path, change, param):
    _, _, client, _ = onerec
    body = {"model": "gr", "n": 2, **change}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "unsupported_parameter"


def test_allowlist_on_the_openai_routes(onerec):
    d, engine, client, _ = onerec
    catalog = engine.catalogs.current()
    messages = [{"role": "user", "content": f"I liked {_history(d, [2])}."}]
    allow = [int(i) for i in catalog.item_ids[::7][:9]]
    r = client.post("/v1/chat/completions", json={"model": "gr", "messages": messages, "n": 5,
                                                  "include_items": allow})
    assert r.status_code == 200, r.text
    got = [c["item_id"] for c in r.json()["choices"]]
    assert len(got) == 5 and set(got) <= set(allow)
    prefix = [int(catalog.sids[0][0])]
    r = client.post("/v1/completions", json={"model": "gr", "prompt": "x", "n": 3, "include_sid_prefix": prefix})
    assert r.status_code == 200, r.text
    assert all(c["sid"][:1] == prefix for c in r.json()["choices"])
    rec = client.post("/v1/recommend", json={"messages": messages, "top_n": 5, "include_items": allow}).json()
    assert [it["item_id"] for it in rec["items"]] == got  # the same search as /v1/recommend's


def test_created_is_the_answers_time_not_the_servers_start(onerec, monkeypatch):
    import time
    from types import SimpleNamespace

    from grserve.server.retrieval import beams as openai_beams

    _, _, client, _ = onerec
    later = time.time() + 1000
    monkeypatch.setattr(openai_beams, "time", SimpleNamespace(time=lambda: later))
    r = client.post("/v1/chat/completions", json={"model": "gr", "messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["created"] == int(later)


def test_exclude_history_on_the_openai_routes(onerec):
    """The items whose SIDs the prompt writes never come back: the same search as ``exclude_items`` listing them."""
    d, _, client, _ = onerec
    history = [2, 5, 9, 11, 40, 41, 42, 77]
    messages = [{"role": "user", "content": f"I liked {_history(d, history)}."}]
    body = {"model": "gr", "messages": messages, "n": 16, "beam_width": 16}
    got = client.post("/v1/chat/completions", json={**body, "exclude_history": True}).json()["choices"]
    ref = client.post("/v1/chat/completions", json={**body, "exclude_items": history}).json()["choices"]
    assert [c["item_id"] for c in got] == [c["item_id"] for c in ref] and not {c["item_id"] for c in got} & set(history)
    r = client.post("/v1/completions", json={"model": "gr", "prompt": _history(d, history), "n": 16,
                                             "beam_width": 16, "exclude_history": True})
    assert r.status_code == 200, r.text
    assert not {c["item_id"] for c in r.json()["choices"]} & set(history)
