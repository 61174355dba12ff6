"""Model shape description (Qwen2 / Qwen2.5 / Qwen3 and LLaMA dense decoders) and the built-in presets.

``ModelSpec.from_hf_config`` accepts exactly the architectures the decoder computes like HF transformers
(``Qwen2ForCausalLM`` — Qwen2 and Qwen2.5 —, ``Qwen3ForCausalLM``, ``LlamaForCausalLM``) and refuses any other,
naming it. A checkpoint whose embeddings were resized for added tokens (SID tokens) is an ordinary config: its
``vocab_size`` is the resized one."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

FAMILIES = ("qwen2", "qwen3", "llama")
_ARCH_TO_FAMILY = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
_FAMILY_TO_ARCH = {v: k for k, v in _ARCH_TO_FAMILY.items()}
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ModelSpec:
    family: str  # "qwen2" | "qwen3" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # qwen2: bias on q/k/v (never o); qwen3, llama: bias on q/k/v/o (HF semantics)
    qk_norm: bool = True  # qwen3: RMSNorm over head_dim on q and k before RoPE
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unsupported model family {self.family!r}; supported: {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelSpec.{name} must be a positive int, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.family == "qwen2" and (not self.attention_bias or self.qk_norm):
            raise ValueError("qwen2 models have q/k/v bias and no q/k norm (attention_bias=True, qk_norm=False)")
        if self.family == "qwen3" and not self.qk_norm:
            raise ValueError("qwen3 models always use q/k norm (qk_norm=True)")
        if self.family == "llama" and self.qk_norm:
            raise ValueError("llama models have no q/k norm (qk_norm=False)")

    # ------------------------------------------------------------------ HF config conversion
    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> "ModelSpec":
        if not isinstance(d, dict):
            raise ValueError(f"expected a config dict, got {type(d).__name__}")
        family = _family(d)
        missing = [k for k in _REQUIRED_KEYS if d.get(k) is None]
        if missing:
            raise ValueError(f"config is missing required key(s): {', '.join(missing)}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only 'silu')")
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        if d.get("mlp_bias"):
            raise ValueError("MLP biases (mlp_bias=true) are not supported")
        if int(d.get("pretraining_tp") or 1) != 1:
            raise ValueError(f"pretraining_tp={d.get('pretraining_tp')} is not supported (only 1)")

        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r} (only 'default')")
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))

        heads = int(d["num_attention_heads"])
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be divisible by num_key_value_heads ({kv_heads})")
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"hidden_size ({hidden}) not divisible by num_attention_heads ({heads}) "
                                 "and no head_dim given")
            head_dim = hidden // heads
        return cls(
            family=family,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),  # HF default for Qwen2/3 is False
            attention_bias=True if family == "qwen2" else bool(d.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        )

    def to_hf_config(self, dtype: torch.dtype | str = torch.float32) -> dict[str, Any]:
        dtype_name = str(dtype).removeprefix("torch.")
        cfg: dict[str, Any] = {
            "architectures": [_FAMILY_TO_ARCH[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "use_cache": True,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "torch_dtype": dtype_name,
            "dtype": dtype_name,
        }
        if self.family != "qwen2":
            cfg["attention_bias"] = self.attention_bias
        if self.family == "llama":
            cfg.update(mlp_bias=False, pretraining_tp=1)
            del cfg["use_sliding_window"]
        return cfg

    # ------------------------------------------------------------------ sizes
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.family != "qwen2"

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv + (h if self.o_bias else 0)
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * h * self.intermediate_size + 2 * h
        emb = self.vocab_size * h
        return emb + self.num_hidden_layers * layer + h + (0 if self.tie_word_embeddings else emb)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _family(d: dict[str, Any]) -> str:
    """The family of an HF config, or ValueError naming the architecture grserve does not compute."""
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    supported = (f"supported: {', '.join(_ARCH_TO_FAMILY)} (model_type "
                 f"{', '.join(repr(f) for f in FAMILIES)})")
    if archs and isinstance(archs, list) and not any(a in _ARCH_TO_FAMILY for a in archs):
        raise ValueError(f"unsupported architecture {', '.join(map(str, archs))} (model_type {model_type!r}); "
                         f"{supported}")
    if model_type is None:
        family = next((_ARCH_TO_FAMILY[a] for a in archs if a in _ARCH_TO_FAMILY), None)
        if family is None:
            raise ValueError(f"config has no model_type and no supported architecture (got {archs!r}); {supported}")
        return family
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; {supported}")
    return model_type


PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        family="qwen3", vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, attention_bias=False, qk_norm=True, max_position_embeddings=32768,
    ),
    "qwen3-0.6b": ModelSpec(
        family="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, attention_bias=False, qk_norm=True, max_position_embeddings=40960,
    ),
    "qwen3-1.7b": ModelSpec(
        family="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, attention_bias=False, qk_norm=True, max_position_embeddings=40960,
    ),
    "qwen2-1.5b": ModelSpec(
        family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, attention_bias=True, qk_norm=False, max_position_embeddings=32768,
    ),
    # Multi-head attention (num_key_value_heads == num_attention_heads), as the paper's OPT models: the hidden
    # state (256) is half of K+V (2·4·64 = 512) per token per layer, so Apt-Serve's hidden cache can pay off.
    "tiny-mha": ModelSpec(
        family="qwen3", vocab_size=32000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, attention_bias=False, qk_norm=True, max_position_embeddings=32768,
    ),
    # Qwen2-1.5B's FLOP mix at tiny cost, for the BAT ranking benchmark: per layer Qwen2-1.5B spends 46.8M MACs
    # on the linear layers per token and 3,072 MACs per (query, key) pair in attention (ratio 15.2k); `tiny`
    # spends 0.95M vs 512 (1.9k), so attending to a cached prefix weighs 8× more there than in the paper's model.
    # Here: 2.03M vs 128 (15.8k). KV bytes per token are tiny's (2 KiB in fp32). See docs/ranking.md.
    "tiny-bat": ModelSpec(
        family="qwen2", vocab_size=32000, hidden_size=256, intermediate_size=2560, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, attention_bias=True, qk_norm=False, max_position_embeddings=32768,
    ),
}
