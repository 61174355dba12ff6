"""Structured output through the OpenAI API (issue 44 item 1): response_format json_schema / json_object and vLLM's
structured_outputs regex / choice / grammar, on a random-weight model, through the engine on a thread and through
an engine-core process (the spec travels with the request and is compiled there). The grammar guarantees the
output: every generation parses and validates, with n > 1, streaming and sampling; what xgrammar cannot compile
is a 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import httpx
import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from conftest import live_server  # noqa: E402
from grserve.engine.async_llm import AsyncLLMEngine, structured_backend  # noqa: E402
from grserve.engine.llm import build_model_engine  # noqa: E402
from grserve.engine.tokenizer import load_tokenizer  # noqa: E402
from grserve.model import ModelSpec, load_model  # noqa: E402
from grserve.scheduler.llm_factory import make_llm_scheduler  # noqa: E402
from grserve.server.llm.app import create_llm_app  # noqa: E402

SPEC = ModelSpec(family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=1024)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    color: Literal["red", "green", "blue"]
    tags: list[Annotated[str, Field(max_length=4)]] = Field(max_length=3)
    member: bool


SCHEMA = Person.model_json_schema()
MSG = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, tmp_path_factory):
    from grserve.model import save_pretrained

    d = tmp_path_factory.mktemp("m")
    from grserve.model.decoder import Decoder
    from grserve.model.loader import _random_init

    m = Decoder(SPEC)
    _random_init(m, 3)
    save_pretrained(m, d)
    if request.param == "process":
        yield from _split_server(d)
        return
    model = load_model(str(d))
    tok = load_tokenizer("preset", SPEC.vocab_size, SPEC.max_position_embeddings, d / "tok")
    eng = build_model_engine(model, make_llm_scheduler("fcfs"), num_blocks=512, block_size=8,
                             eos_token_id=tok.eos_token_id, detokenize=tok.decode, decoder_factory=tok.decode_stream,
                             structured=structured_backend(tok, SPEC.vocab_size))
    loop = AsyncLLMEngine(eng, tok).start()
    app = create_llm_app(loop, tok, "test-model", SPEC.max_position_embeddings, SPEC.vocab_size)
    with live_server(app, "error") as url:
        yield url
    loop.stop()


def _split_server(d):
    from grserve.config import LLMApiConfig, LLMConfig, LLMServeConfig, ModelConfig
    from grserve.server.launch.processes import start_core
    from grserve.server.llm.command import llm_front_end

    cfg = LLMServeConfig(model=ModelConfig(source=str(d)),
                         llm=LLMConfig(scheduler="fcfs", num_blocks=512, block_size=8, threads=1,
                                       served_model_name="test-model"),
                         api=LLMApiConfig(tokenizer="preset", tokenizer_cache=str(d / "tok")))
    _, core, info = start_core("llm", cfg, 1, None)
    app, _ = llm_front_end(cfg, core, info)
    with live_server(app, "error") as url:
        yield url
    core.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120)


def test_parse_pydantic_model_always_validates(client):
    """The openai client's parse() with a pydantic model: 100 of 100 sampled answers validate (20 requests × n=5,
    each its own seed)."""
    valid = 0
    for seed in range(20):
        out = client.beta.chat.completions.parse(model="test-model", messages=MSG, response_format=Person, n=5,
                                                 seed=seed, temperature=1.0, max_tokens=200)
        for c in out.choices:
            assert c.finish_reason == "stop", c.message.content
            assert isinstance(c.message.parsed, Person)
            valid += 1
    assert valid == 100


def test_json_schema_streaming_and_greedy(server):
    rf = {"type": "json_schema", "json_schema": {"name": "Person", "schema": SCHEMA, "strict": True}}
    for temperature in (0.0, 1.0):
        body = {"model": "test-model", "messages": MSG, "response_format": rf, "n": 3, "seed": 7, "stream": True,
                "temperature": temperature, "max_tokens": 200}
        texts = ["", "", ""]
        with httpx.stream("POST", server + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for ch in json.loads(line[6:])["choices"]:
                        texts[ch["index"]] += ch["delta"].get("content") or ""
        for t in texts:
            jsonschema.validate(json.loads(t), SCHEMA)


def test_completions_json_object_regex_choice_grammar(server):
    base = {"model": "test-model", "prompt": "Answer:", "max_tokens": 120, "n": 4, "seed": 11, "temperature": 1.0}
    cases = [
        # any JSON object: its strings are unbounded, so a sampling random model need not end one; greedy does
        ({"response_format": {"type": "json_object"}, "temperature": 0.0, "n": 1},
         lambda s: isinstance(json.loads(s), dict)),
        ({"structured_outputs": {"json_object": True}, "temperature": 0.0, "n": 1},
         lambda s: isinstance(json.loads(s), dict)),
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,4}"}},
         lambda s: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", s) is not None),
        ({"structured_outputs": {"choice": ["yes", "no", "maybe so"]}}, lambda s: s in ("yes", "no", "maybe so")),
        ({"guided_choice": ["alpha", "beta"]}, lambda s: s in ("alpha", "beta")),
        ({"structured_outputs": {"grammar": 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'}},
         lambda s: re.fullmatch(r"\([1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){0,3}\)", s) is not None),
        ({"structured_outputs": {"json": SCHEMA}}, lambda s: jsonschema.validate(json.loads(s), SCHEMA) is None),
    ]
    for extra, ok in cases:
        r = httpx.post(server + "/v1/completions", json={**base, **extra}, timeout=120)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert c["finish_reason"] == "stop" and ok(c["text"]), (extra, c)


def test_stop_string_cuts_constrained_output(server):
    body = {"model": "test-model", "prompt": "x", "max_tokens": 50, "temperature": 0.0,
            "structured_outputs": {"choice": ["abc-def-ghi"]}, "stop": ["-g"]}
    r = httpx.post(server + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc-def"


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/nope"}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/completions", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= foo"}}, "structured_outputs.grammar"),
    ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("/v1/completions", {"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"guided_regex": "a+", "min_tokens": 3}, "min_tokens"),
])
def test_uncompilable_is_400_naming_the_field(server, path, extra, param):
    body = {"model": "test-model", "max_tokens": 5, **extra}
    body.update({"messages": MSG} if "chat" in path else {"prompt": "hi"})
    r = httpx.post(server + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
