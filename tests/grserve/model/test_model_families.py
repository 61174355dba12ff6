"""The model families GR checkpoints are published in: Qwen2 / Qwen2.5 / Qwen3 with embeddings resized for added SID
tokens, and LLaMA (LC-Rec's backbone), each = HF transformers; other architectures refused by name; a model directory
without tokenizer files refused for text and chat input."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from grserve.attention.context import SequenceKVContext  # noqa: E402
from grserve.model import ModelSpec, load_model, save_pretrained  # noqa: E402

TOL = 1e-4
BASE = 300


def _config(family: str, tied: bool, **extra):
    kw = dict(vocab_size=BASE, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": extra.pop("rope_theta", 10000.0)},
              tie_word_embeddings=tied, initializer_range=0.05, **extra)
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "llama": transformers.LlamaConfig}[family]
    cfg = cls(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _hf(family: str, tied: bool, added: int = 0, seed: int = 7, **extra):
    """An HF model with every norm weight and bias perturbed; ``added`` > 0: its embeddings resized for that many
    added tokens (padded to a multiple of 64, as published checkpoints are) and the new rows drawn at random."""
    torch.manual_seed(seed)
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
           "llama": transformers.LlamaForCausalLM}[family]
    hf = cls(_config(family, tied, **extra)).float().eval()
    if added:
        hf.resize_token_embeddings(BASE + added, pad_to_multiple_of=64, mean_resizing=False)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif added and name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p[BASE:].normal_(0.0, 0.1)  # the added tokens' rows (resizing leaves them near-identical)
    return hf


def _same_as_hf(hf, ours, ids: torch.Tensor) -> None:
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0].float()
        ctx = SequenceKVContext(ours.spec.num_hidden_layers)
        got = ours.logits(ours(ids[:-3], torch.arange(ids.shape[0] - 3), ctx))
        for t in range(ids.shape[0] - 3, ids.shape[0]):  # then one token at a time on the same cache
            got = torch.cat([got, ours.logits(ours(ids[t:t + 1], torch.tensor([t]), ctx))])
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOL
    assert want.abs().max().item() > 0.1


CASES = [
    ("qwen2", False, {}),  # Qwen2
    ("qwen2", True, {"rope_theta": 1e6, "use_sliding_window": False, "max_window_layers": 21}),  # Qwen2.5 (tied)
    ("qwen3", True, {}),
    ("qwen3", False, {"attention_bias": True}),
]


@pytest.mark.parametrize("family,tied,extra", CASES, ids=["qwen2", "qwen2.5-tied", "qwen3-tied", "qwen3-bias"])
def test_resized_embeddings_for_added_tokens_match_hf(family, tied, extra, tmp_path):
    hf = _hf(family, tied, added=100, **extra)
    assert hf.config.vocab_size == 448  # 300 + 100 padded to a multiple of 64
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path))
    assert ours.spec.vocab_size == 448 and ours.spec.family == family and ours.spec.tie_word_embeddings == tied
    ids = torch.cat([torch.randint(0, BASE, (12,)), torch.arange(BASE, BASE + 100, 9), torch.tensor([447])])
    _same_as_hf(hf, ours, ids)


@pytest.mark.parametrize("tied,bias", [(False, False), (True, False), (False, True)],
                         ids=["untied", "tied", "attention-bias"])
def test_llama_matches_hf(tied, bias, tmp_path):
    hf = _hf("llama", tied, added=40, attention_bias=bias)
    hf.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path))
    assert ours.spec.family == "llama" and not ours.spec.qk_norm and ours.spec.attention_bias == bias
    assert (ours.model.layers[0].self_attn.o_proj.bias is not None) == bias  # LLaMA's o_proj has the bias too
    _same_as_hf(hf, ours, torch.randint(0, 340, (25,), generator=torch.Generator().manual_seed(3)))
    save_pretrained(ours, tmp_path / "again")  # and grserve writes a checkpoint HF loads as LLaMA
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "again"), attn_implementation="eager")
    assert type(back).__name__ == "LlamaForCausalLM"
    _same_as_hf(back.float().eval(), ours, torch.randint(0, 340, (10,), generator=torch.Generator().manual_seed(4)))


@pytest.mark.parametrize("config,named", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "MistralForCausalLM"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}, "Qwen3MoeForCausalLM"),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ({"model_type": "gemma"}, "'gemma'"),
    ({"architectures": ["Qwen2ForSequenceClassification"], "model_type": "qwen2"}, "Qwen2ForSequenceClassification"),
])
def test_other_architectures_are_refused_by_name(config, named):
    d = _config("qwen2", False).to_dict() | config
    if "architectures" not in config:
        d.pop("architectures", None)
    with pytest.raises(ValueError) as e:
        ModelSpec.from_hf_config(d)
    assert named in str(e.value) and "LlamaForCausalLM" in str(e.value)


@pytest.mark.parametrize("change,fragment", [
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "llama3"),
    ({"pretraining_tp": 2}, "pretraining_tp"),
])
def test_llama_variants_grserve_does_not_compute_are_refused(change, fragment):
    d = _config("llama", False).to_dict() | change
    with pytest.raises(ValueError, match=fragment):
        ModelSpec.from_hf_config(d)


def test_model_dir_without_tokenizer_refuses_text_and_chat(tmp_path):
    from grserve.engine.tokenizer import MissingTokenizerError, load_tokenizer, model_tokenizer

    _hf("qwen3", True).save_pretrained(tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()
    tok = load_tokenizer(str(tmp_path), BASE)
    for call in (lambda: tok.encode("hello"), lambda: tok.apply_chat_template([{"role": "user", "content": "x"}])):
        with pytest.raises(MissingTokenizerError) as e:
            call()
        assert str(tmp_path) in str(e.value) and "no tokenizer files" in str(e.value)
    assert tok.decode([1, 2, 3]) == "" and tok.decode_stream([1]).step(5) == ""  # token ids still flow
    assert model_tokenizer(str(tmp_path)) is None


def test_llm_server_on_a_model_dir_without_tokenizer_refuses_text_not_token_ids(tmp_path):
    from fastapi.testclient import TestClient

    from grserve.engine.async_llm import AsyncLLMEngine
    from grserve.engine.llm import build_model_engine
    from grserve.engine.tokenizer import load_tokenizer
    from grserve.scheduler.fcfs import FCFSScheduler
    from grserve.server.llm.app import create_llm_app

    _hf("qwen3", True).save_pretrained(tmp_path)
    model = load_model(str(tmp_path))
    tok = load_tokenizer(str(tmp_path), model.spec.vocab_size)
    eng = build_model_engine(model, FCFSScheduler(), num_blocks=64, block_size=8, eos_token_id=None,
                             detokenize=tok.decode, decoder_factory=tok.decode_stream)
    loop = AsyncLLMEngine(eng, tok).start()
    try:
        with TestClient(create_llm_app(loop, tok, "m", 256, model.spec.vocab_size)) as c:
            for path, body, param in (("/v1/completions", {"prompt": "hello"}, "prompt"),
                                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                                       "messages")):
                r = c.post(path, json={"model": "m", "max_tokens": 3, **body})
                assert r.status_code == 400 and r.json()["error"]["param"] == param
                assert "no tokenizer files" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        loop.stop()
