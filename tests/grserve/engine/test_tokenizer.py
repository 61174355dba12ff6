"""Tokenizers (issue 14 finding 6): presets carry a real byte-level tokenizer an HF client loads; HF directories go
through AutoTokenizer with their own chat template (chat_template.jinja, tools, template errors a 400); stored
padding/truncation never pads or truncates a prompt; detokenization is incremental and stop strings are matched on
the new text only."""

from __future__ import annotations

import json
import random

import pytest

transformers = pytest.importorskip("transformers")

from grserve.engine.sampling import SamplingParams  # noqa: E402
from grserve.engine.tokenizer import (  # noqa: E402
    ChatTemplateError,
    HFTokenizer,
    WindowDecoder,
    load_tokenizer,
    preset_tokenizer_json,
    write_preset_tokenizer,
)

TEXTS = ["hello world", "héllo wörld ✓ 日本語 🙂", "tabs\tand\nnewlines  ", "<|user|> not special"]


def test_preset_tokenizer_is_deterministic_and_loads_in_autotokenizer(tmp_path):
    assert preset_tokenizer_json(600) == preset_tokenizer_json(600)
    d = write_preset_tokenizer(tmp_path / "t", 600, 512)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))  # what aiperf --tokenizer DIR does
    assert len(hf) == 600 and hf.eos_token_id == 2 and hf.bos_token_id == 1
    ours = HFTokenizer(d)
    for s in TEXTS:
        assert hf(s)["input_ids"] == ours.encode(s)
        assert hf.decode(hf(s)["input_ids"], skip_special_tokens=True) == ours.decode(ours.encode(s)) == s
    assert ours.encode("ABC!\n") == [1] + [b + 3 for b in b"ABC!\n"]  # bytes + 3 unless " " + lowercase
    assert ours.decode([259, 260, 2, 285, 286]) == " a b aa ab"  # fillers decode to words
    assert ours.token_bytes(3 + 0xC3) == b"\xc3" and ours.token_bytes(285) == b" aa"
    # every filler's text encodes back to the filler: a client re-tokenizing the output counts the same tokens
    assert all(ours.encode(ours.decode([i]), add_special_tokens=False) == [i] for i in range(259, 600))


def test_preset_dir_for_a_preset_model_is_written_once(tmp_path):
    tok = load_tokenizer("tiny", 700, 4096, tmp_path)
    d = tmp_path / "grserve-bytes-v2-700"
    assert (d / "tokenizer.json").is_file()
    assert tok.name_or_path == str(d.resolve()) and tok.vocab_size == 700
    mtime = (d / "tokenizer.json").stat().st_mtime_ns
    load_tokenizer("tiny", 700, 4096, tmp_path)
    assert (d / "tokenizer.json").stat().st_mtime_ns == mtime


def _hf_dir(tmp_path, template: str | None = None, pad_trunc: bool = False):
    from tokenizers import Tokenizer

    d = write_preset_tokenizer(tmp_path / "hf", 300, 512)
    if template is not None:
        (d / "chat_template.jinja").write_text(template)
    if pad_trunc:  # a tokenizer.json that stores padding and truncation (as some hub tokenizers do)
        t = Tokenizer.from_file(str(d / "tokenizer.json"))
        t.enable_padding(length=64, pad_id=0, pad_token="<pad>")
        t.enable_truncation(max_length=4)
        t.save(str(d / "tokenizer.json"))
        assert json.loads((d / "tokenizer.json").read_text())["padding"] is not None
    return d


def test_stored_padding_and_truncation_do_not_touch_prompts(tmp_path):
    tok = HFTokenizer(_hf_dir(tmp_path, pad_trunc=True))
    s = "A PROMPT MUCH LONGER THAN FOUR TOKENS"
    assert tok.encode(s) == [1] + [b + 3 for b in s.encode()]


def test_the_directorys_chat_template_gets_tools_and_specials_and_its_errors_are_chat_template_errors(tmp_path):
    template = ("CUSTOM {{ bos_token }}{% for t in tools or [] %}[tool {{ t['function']['name'] }}]{% endfor %}"
                "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
                "{% endif %}{{ m['role'] }}: {{ m['content'] }};{% endfor %}{% if add_generation_prompt %}A:"
                "{% endif %}")
    tok = HFTokenizer(_hf_dir(tmp_path, template))
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools)
    assert out == "CUSTOM <bos>[tool weather]user: hi;A:"
    with pytest.raises(ChatTemplateError, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_a_template_error_is_a_400(tmp_path, random_decoder):
    from fastapi.testclient import TestClient

    from grserve.engine.async_llm import AsyncLLMEngine
    from grserve.engine.llm import build_model_engine
    from grserve.model import ModelSpec
    from grserve.scheduler.llm_factory import make_llm_scheduler
    from grserve.server.llm.app import create_llm_app

    tok = HFTokenizer(_hf_dir(tmp_path, "{{ raise_exception('bad conversation') }}"))
    spec = ModelSpec(family="qwen3", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
    core = build_model_engine(random_decoder(spec, 0, 0.1), make_llm_scheduler("fcfs"), num_blocks=16, block_size=8)
    app = create_llm_app(AsyncLLMEngine(core, tok), tok, "m", 128, 300)
    r = TestClient(app).post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user",
                                                                                      "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_error"
    assert "bad conversation" in r.json()["error"]["message"] and r.json()["error"]["param"] == "messages"


def test_incremental_decoding_equals_the_whole_decode(tmp_path):
    tok = HFTokenizer(write_preset_tokenizer(tmp_path / "t", 400, 512))
    rng = random.Random(0)
    for s in TEXTS:
        ids = tok.encode(s, add_special_tokens=False)
        stream = tok.decode_stream()
        assert "".join(stream.step(i) for i in ids) == s
    ids = [rng.randrange(3, 400) for _ in range(300)] + [999]  # random bytes and fillers; an id past the vocab
    stream = tok.decode_stream()
    assert "".join(stream.step(i) for i in ids).replace("\ufffd", "") == tok.decode(ids).replace("\ufffd", "")


def test_window_decoder_does_linear_work():
    seen = []

    def decode(ids):
        seen.append(len(ids))
        return bytes((i - 3) % 256 for i in ids).decode("utf-8", errors="replace")

    text = "incremental ✓ décodage " * 40
    ids = [b + 3 for b in text.encode()]
    d = WindowDecoder(decode)
    assert "".join(d.step(i) for i in ids) == text
    assert sum(seen) <= 12 * len(ids)  # O(1) tokens decoded per step, never the whole output


def test_stop_strings_are_matched_on_new_text_across_tokens(random_decoder):
    """A stop string split over tokens ends the text before it; held-back text is never streamed past a stop;
    the engine never re-decodes the output (``detokenize`` is not called when a decoder is given)."""
    from grserve.engine.llm import build_model_engine
    from grserve.model import ModelSpec
    from grserve.scheduler.llm_factory import make_llm_scheduler

    spec = ModelSpec(family="qwen3", vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256)
    model = random_decoder(spec, 0, 0.3)

    class Letters:  # token t → one letter (a stand-in incremental decoder)
        def step(self, t):
            return chr(97 + t % 26)

    def never(ids):
        raise AssertionError("the engine re-decoded the output")

    def run(stop):
        core = build_model_engine(model, make_llm_scheduler("fcfs"), num_blocks=32, block_size=8,
                                  detokenize=never, decoder_factory=lambda prompt: Letters())
        deltas = []
        core.add_request(list(range(10, 20)), SamplingParams(max_tokens=20, temperature=0, stop=stop),
                         on_event=lambda ev: deltas.append(ev))
        while core.has_work():
            core.step()
        return "".join(ev.text for ev in deltas), deltas[-1].finish_reason

    full, reason = run(())
    assert reason == "length" and len(full) == 20
    stop = full[5:8]
    text, reason = run((stop, "zzzzzzzz"))
    assert reason == "stop" and text == full[:full.find(stop)] and stop not in text


def test_generation_config_eos_ids_stop_like_eos(tmp_path):
    from grserve.inputs.generation import sampling_params
    from grserve.inputs.openai_schemas import CompletionRequest

    d = _hf_dir(tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    tok = HFTokenizer(d)
    assert tok.eos_token_id == 2 and tok.extra_eos_ids == (7, 9)
    body = CompletionRequest(model="m", prompt="x", stop_token_ids=[9, 11])
    assert sampling_params(body, 4, 300, extra_eos=tok.extra_eos_ids).stop_token_ids == (9, 11, 7)
    ignore = CompletionRequest(model="m", prompt="x", ignore_eos=True)
    assert sampling_params(ignore, 4, 300, extra_eos=tok.extra_eos_ids).stop_token_ids == ()


def test_serve_llm_prints_the_tokenizer_directory(tmp_path, monkeypatch, capsys):
    """`grserve serve llm MODEL` writes a preset's tokenizer and prints its directory (aiperf --tokenizer DIR)."""
    import grserve.server.launch.serving as core
    from grserve import cli

    monkeypatch.setattr(core, "serve_until_exit", lambda app, host, port, level, stop: stop() or 0)
    assert cli.main(["serve", "llm", "tiny", "--scheduler", "fcfs", "--num-blocks", "64", "--port", "18150",
                     "--tokenizer-cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    d = tmp_path / "grserve-bytes-v2-32000"
    assert f"tokenizer {d.resolve()}" in out
    assert len(transformers.AutoTokenizer.from_pretrained(str(d))) == 32000


def test_the_first_generated_token_is_decoded_in_context():
    """A SentencePiece-style (Metaspace) decoder drops the leading space of a sequence's first token: the stream is
    primed with the prompt's last tokens, so the output reads as decoding prompt + output does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from grserve.engine.tokenizer import _DecodeStream

    t = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    assert t.decode([0, 1, 1]) == "Hello world world" and t.decode([1]) == "world"
    primed = _DecodeStream(t, 3, prompt_ids=[0])
    assert "".join(primed.step(i) for i in (1, 1)) == " world world"
    unprimed = _DecodeStream(t, 3)
    assert "".join(unprimed.step(i) for i in (1, 1)) == "world world"
