"""Tool calling (issue 44 item 2): tools reach the chat template, ``required`` and a named function are enforced by
the grammar so the answer always parses into ``tool_calls`` (hermes format through the API, whole and streamed;
llama3_json through the engine and the parser), ``auto`` / ``none`` leave text as content, and malformed tools or
choices are a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from test_structured_output import SPEC, client, server  # noqa: E402,F401 - the module's servers
from grserve.engine.async_llm import structured_backend  # noqa: E402
from grserve.engine.llm import build_model_engine  # noqa: E402
from grserve.engine.sampling import SamplingParams  # noqa: E402
from grserve.engine.tokenizer import load_tokenizer  # noqa: E402
from grserve.scheduler.llm_factory import make_llm_scheduler  # noqa: E402
from grserve.inputs.openai_tools import parse_tool_calls, tool_plan, tool_spec  # noqa: E402

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["utc", "cet", "pst"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(name: str, arguments: str, allowed: set[str]) -> None:
    assert name in allowed
    jsonschema.validate(json.loads(arguments), PARAMS[name])


def test_named_and_required_tool_choice_always_parse(client):  # noqa: F811
    for seed in range(4):
        r = client.chat.completions.create(model="test-model", messages=MSG, tools=TOOLS, n=3, seed=seed,
                                           temperature=1.0, max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
            call = c.message.tool_calls[0]
            assert call.id.startswith("call_") and call.type == "function"
            _check_call(call.function.name, call.function.arguments, {"get_time"})
        r = client.chat.completions.create(model="test-model", messages=MSG, tools=TOOLS, tool_choice="required",
                                           n=3, seed=seed, temperature=1.0, max_tokens=120)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            _check_call(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments,
                        {"get_weather", "get_time"})


def test_streamed_tool_call_deltas(client):  # noqa: F811
    stream = client.chat.completions.create(model="test-model", messages=MSG, tools=TOOLS, tool_choice="required",
                                            n=2, seed=5, temperature=1.0, max_tokens=120, stream=True)
    calls: dict[int, dict] = {}
    reasons = {}
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(ch.index, {"name": "", "arguments": ""})
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    for c in calls.values():
        _check_call(c["name"], c["arguments"], {"get_weather", "get_time"})


def test_auto_and_none_answer_text(client):  # noqa: F811
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model="test-model", messages=MSG, tools=TOOLS, tool_choice=choice,
                                           max_tokens=8, temperature=0)
        c = r.choices[0]
        assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")
        assert isinstance(c.message.content, str)


@pytest.mark.parametrize("extra,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_are_a_400_naming_the_field(server, extra, param):  # noqa: F811
    r = httpx.post(server + "/v1/chat/completions", json={"model": "test-model", "messages": MSG, "max_tokens": 4,
                                                          **extra}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_parsers():
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "g", ' \
           '"arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    assert parse_tool_calls("<tool_call>{broken</tool_call>", "hermes") == ("<tool_call>{broken</tool_call>", [])
    content, calls = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"s": "a;b"}}', "llama3_json")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"s": "a;b"}
    content, calls = parse_tool_calls('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}',
                                      "llama3_json")
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert parse_tool_calls("hello {", "llama3_json") == ("hello {", [])


def test_llama3_json_grammar_always_parses(tmp_path):
    from grserve.model.decoder import Decoder
    from grserve.model.loader import _random_init

    model = Decoder(SPEC).eval().requires_grad_(False)
    _random_init(model, 9)
    tok = load_tokenizer("preset", SPEC.vocab_size, SPEC.max_position_embeddings, tmp_path)
    eng = build_model_engine(model, make_llm_scheduler("fcfs"), num_blocks=512, block_size=8,
                             eos_token_id=tok.eos_token_id, detokenize=tok.decode, decoder_factory=tok.decode_stream,
                             structured=structured_backend(tok, SPEC.vocab_size))
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        spec = tool_spec(tool_plan(TOOLS, choice), "llama3_json")
        eng.keep_finished = True
        eng.finished.clear()
        eng.generate([tok.encode("q")] * 6, [SamplingParams(max_tokens=120, seed=i, structured=spec)
                                             for i in range(6)])
        for s in eng.finished:
            content, calls = parse_tool_calls(s.text, "llama3_json")
            assert content is None and len(calls) == 1, s.text
            _check_call(calls[0]["function"]["name"], calls[0]["function"]["arguments"],
                        {"get_weather", "get_time"} if choice == "required" else {"get_weather"})
