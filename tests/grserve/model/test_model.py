"""grserve Decoder vs HF transformers (Qwen2 / Qwen3), loading/saving, presets and specs."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from grserve.attention.context import SequenceKVContext  # noqa: E402
from grserve.model import PRESETS, Decoder, ModelSpec, load_model, resolve_spec, save_pretrained  # noqa: E402

TOL = 1e-4
VOCAB = 300
CASES = [("qwen3", True), ("qwen3", False), ("qwen2", True), ("qwen2", False)]
CASE_IDS = [f"{f}-{'tied' if t else 'untied'}" for f, t in CASES]


def _hf_model(family: str, tied: bool):
    torch.manual_seed(1234)
    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=tied,
        initializer_range=0.05,
    )
    cfg = (Qwen3Config if family == "qwen3" else Qwen2Config)(**kw)
    cfg._attn_implementation = "eager"
    model = (Qwen3ForCausalLM if family == "qwen3" else Qwen2ForCausalLM)(cfg).float().eval()
    with torch.no_grad():  # make every norm weight and bias matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0].float()


def _prefill(model: Decoder, ids: torch.Tensor, ctx=None, start: int = 0):
    ctx = ctx or SequenceKVContext(model.spec.num_hidden_layers)
    with torch.no_grad():
        h = model(ids, torch.arange(start, start + ids.shape[0]), ctx)
    return h, ctx


@pytest.fixture(scope="module", params=CASES, ids=CASE_IDS)
def pair(request, tmp_path_factory):
    family, tied = request.param
    hf = _hf_model(family, tied)
    d = tmp_path_factory.mktemp(f"hf-{family}-{tied}")
    hf.save_pretrained(d)
    ours = load_model(str(d))
    assert ours.spec.family == family and ours.spec.tie_word_embeddings == tied
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    return hf, ours


def test_prefill_matches_hf(pair):
    hf, ours = pair
    ids = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(0))
    h, _ = _prefill(ours, ids)
    got = ours.logits(h)
    want = _hf_logits(hf, ids)
    assert got.shape == (37, VOCAB) and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= TOL
    assert want.abs().max().item() > 0.1  # the comparison is not vacuous


def test_incremental_decode_matches_hf(pair):
    hf, ours = pair
    ids = torch.randint(0, VOCAB, (26,), generator=torch.Generator().manual_seed(1))
    want = _hf_logits(hf, ids)
    h, ctx = _prefill(ours, ids[:20])
    assert (ours.logits(h) - want[:20]).abs().max().item() <= TOL
    for t in range(20, 26):
        h, _ = _prefill(ours, ids[t:t + 1], ctx, start=t)
        assert ctx.length == t + 1
        assert (ours.logits(h)[0] - want[t]).abs().max().item() <= TOL, f"step {t}"


def test_logits_token_range(pair):
    _, ours = pair
    ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(2))
    h, _ = _prefill(ours, ids)
    full = ours.logits(h)
    for a, b in [(0, VOCAB), (0, 1), (17, 123), (VOCAB - 5, VOCAB)]:
        part = ours.logits(h, token_range=(a, b))
        assert part.shape == (9, b - a)
        torch.testing.assert_close(part, full[:, a:b], rtol=1e-5, atol=1e-6)
    for bad in [(5, 5), (-1, 3), (0, VOCAB + 1)]:
        with pytest.raises(ValueError):
            ours.logits(h, token_range=bad)


def test_save_pretrained_roundtrip(pair, tmp_path):
    hf, ours = pair
    save_pretrained(ours, tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert ("lm_head.weight" in names) != ours.spec.tie_word_embeddings
    assert names == {n for n, _ in hf.named_parameters()}  # HF dedups the tied lm_head too
    hf2 = AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").float().eval()
    assert type(hf2) is type(hf)
    ids = torch.randint(0, VOCAB, (15,), generator=torch.Generator().manual_seed(3))
    h, _ = _prefill(ours, ids)
    assert (_hf_logits(hf2, ids) - ours.logits(h)).abs().max().item() <= TOL
    again = load_model(str(tmp_path))
    assert again.spec == ours.spec
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_sharded_checkpoint_and_bf16(tmp_path):
    hf = _hf_model("qwen3", False)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = load_model(str(tmp_path))
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(4))
    want = _hf_logits(hf, ids)
    h, _ = _prefill(ours, ids)
    assert (ours.logits(h) - want).abs().max().item() <= TOL
    half = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in half.parameters())
    h, _ = _prefill(half, ids)
    got = half.logits(h)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max().item() <= 0.05 * want.abs().max().item()


def test_checkpoint_errors(tmp_path):
    hf = _hf_model("qwen2", False)
    good = tmp_path / "good"
    hf.save_pretrained(good)
    sd = load_file(str(good / "model.safetensors"))
    cfg = json.loads((good / "config.json").read_text())

    def write(name: str, tensors: dict, config: dict):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        if tensors:
            save_file(tensors, str(d / "model.safetensors"))
        return str(d)

    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(write("missing", missing, cfg))
    bad_shape = dict(sd, **{"model.norm.weight": torch.ones(65)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model(write("shape", bad_shape, cfg))
    extra = dict(sd, **{"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)})
    with pytest.raises(ValueError, match="o_proj.bias"):
        load_model(write("extra", extra, cfg))
    with pytest.raises(ValueError, match="safetensors"):
        load_model(write("noweights", {}, cfg))
    with pytest.raises(ValueError, match="config.json"):
        (tmp_path / "empty").mkdir()
        load_model(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="llama"):
        load_model(write("llama", sd, dict(cfg, model_type="llama")))


# ---------------------------------------------------------------------------------------------- presets / spec

PRESET_SHAPES = {
    # vocab, hidden, inter, layers, q heads, kv heads, head_dim, tied, family, max_pos
    "tiny": (32000, 256, 1024, 4, 8, 2, 32, True, "qwen3", 32768),
    "qwen3-0.6b": (151936, 1024, 3072, 28, 16, 8, 128, True, "qwen3", 40960),
    "qwen3-1.7b": (151936, 2048, 6144, 28, 16, 8, 128, True, "qwen3", 40960),
    "qwen2-1.5b": (151936, 1536, 8960, 28, 12, 2, 128, True, "qwen2", 32768),
    "tiny-bat": (32000, 256, 2560, 4, 2, 2, 32, True, "qwen2", 32768),
}


def _linear_vs_pair_macs(s):
    h, q, kv = s.hidden_size, s.q_size, s.kv_size
    linear = h * q + 2 * h * kv + q * h + 3 * h * s.intermediate_size  # per token and layer
    return linear / (2 * q)  # attention: q·k and p·v per (query, key) pair and layer


def test_tiny_bat_has_qwen2_1_5b_flop_mix():
    """The ranking benchmark's model: the linear-vs-attention cost ratio of the paper's Qwen2-1.5B (±10 %),
    with tiny's KV bytes per token; `tiny` itself is 8× more attention-heavy."""
    ref = _linear_vs_pair_macs(PRESETS["qwen2-1.5b"])
    assert abs(_linear_vs_pair_macs(PRESETS["tiny-bat"]) / ref - 1) < 0.1
    assert _linear_vs_pair_macs(PRESETS["tiny"]) < ref / 7
    assert PRESETS["tiny-bat"].kv_bytes_per_token(4) == PRESETS["tiny"].kv_bytes_per_token(4)


@pytest.mark.parametrize("name", sorted(PRESET_SHAPES))
def test_preset_specs(name):
    s = resolve_spec(name)
    assert s is PRESETS[name]
    got = (s.vocab_size, s.hidden_size, s.intermediate_size, s.num_hidden_layers, s.num_attention_heads,
           s.num_key_value_heads, s.head_dim, s.tie_word_embeddings, s.family, s.max_position_embeddings)
    assert got == PRESET_SHAPES[name]
    assert s.rope_theta == 1e6 and s.rms_norm_eps == 1e-6
    assert s.attention_bias == (s.family == "qwen2") and s.qk_norm == (s.family == "qwen3")
    assert s.kv_bytes_per_token(2) == 2 * s.num_hidden_layers * s.num_key_value_heads * s.head_dim * 2
    # the HF config we emit builds an HF model with exactly our parameter count, and parses back to the same spec
    cfg = s.to_hf_config()
    assert ModelSpec.from_hf_config(json.loads(json.dumps(cfg))) == s
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    assert sum(p.numel() for p in hf.parameters()) == s.num_parameters()


def test_preset_param_counts():
    assert round(PRESETS["qwen3-0.6b"].num_parameters() / 1e6) == 596
    assert round(PRESETS["qwen2-1.5b"].num_parameters() / 1e6) == 1544
    assert PRESETS["qwen3-0.6b"].kv_bytes_per_token(2) == 114688


def test_tiny_preset_seeded():
    a, b, c = load_model("tiny", seed=0), load_model("tiny", seed=0), load_model("tiny", seed=1)
    assert a.spec == PRESETS["tiny"] and a.dtype == torch.float32 and a.device.type == "cpu"
    assert a.lm_head.weight is a.model.embed_tokens.weight
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(not torch.equal(sa[k], sc[k]) for k in sa)
    norms = [p for n, p in a.named_parameters() if n.endswith("norm.weight")]
    assert all(not torch.all(p == 1) and (p - 1).abs().max() < 0.5 for p in norms)
    assert sum(p.numel() for p in a.parameters()) == PRESETS["tiny"].num_parameters()
    ids = torch.randint(0, 32000, (11,), generator=torch.Generator().manual_seed(5))
    h, _ = _prefill(a, ids)
    assert h.shape == (11, 256) and torch.isfinite(a.logits(h)).all()
    half = load_model("tiny", dtype=torch.bfloat16, seed=0)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    h, _ = _prefill(half, ids)
    assert half.logits(h, token_range=(10, 20)).dtype == torch.bfloat16


@pytest.mark.parametrize("bad", ["", "qwen3-7b", "TINY", "/nonexistent/path/to/model"])
def test_bad_source(bad):
    with pytest.raises(ValueError) as e:
        resolve_spec(bad)
    assert all(name in str(e.value) for name in PRESETS)
    with pytest.raises(ValueError):
        load_model(bad)


def test_from_hf_config_validation():
    base = PRESETS["tiny"].to_hf_config()
    with pytest.raises(ValueError, match="mistral"):
        ModelSpec.from_hf_config(dict(base, model_type="mistral"))
    with pytest.raises(ValueError, match="hidden_size"):
        ModelSpec.from_hf_config({k: v for k, v in base.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="divisible"):
        ModelSpec.from_hf_config(dict(base, num_key_value_heads=3))
    no_type = {k: v for k, v in base.items() if k != "model_type"}
    assert ModelSpec.from_hf_config(no_type).family == "qwen3"
    no_hd = {k: v for k, v in base.items() if k != "head_dim"}
    assert ModelSpec.from_hf_config(no_hd).head_dim == 256 // 8
    old_style = {k: v for k, v in base.items() if k != "rope_parameters"}
    assert ModelSpec.from_hf_config(dict(old_style, rope_theta=5e5)).rope_theta == 5e5


def test_dtype_by_name_equals_dtype_object_and_bad_names_fail():
    import grserve.model as gm

    by_name = gm.load_model("tiny", dtype="bfloat16", seed=1)
    by_obj = gm.load_model("tiny", dtype=torch.bfloat16, seed=1)
    assert by_name.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(by_name.state_dict().values(), by_obj.state_dict().values()))
    with pytest.raises(ValueError, match="unknown dtype 'fp8'.*float32"):
        gm.load_model("tiny", dtype="fp8")
