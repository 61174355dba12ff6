"""What a model runs in, for start lines: its dtype (``model/dtype_choice.py``: ``auto`` resolved, and why) and its
quantization (``model/quantized_linear.py``), e.g. ``bfloat16: auto, CPU computes bf16 2.0x faster than fp32, cpu;
quantization int8 (...)``."""

from __future__ import annotations

from grserve.model.dtype_choice import choice
from grserve.model.quantized_linear import check_config


def dtype_label(model_cfg) -> str:
    """A ``ModelConfig``'s dtype for start lines: ``bfloat16: auto, CPU computes bf16 2.0x faster than fp32, cpu``;
    its ``--quantization`` appended when asked (``; quantization int8 (W8A8 via torch._int_mm, ...)``)."""
    c = choice(model_cfg.dtype, str(model_cfg.device))
    return f"{c.name}: {c.reason}, {model_cfg.device}{_quantization_label(None, model_cfg)}"


def model_label(model, model_cfg) -> str:
    """What a built model runs in (its ``dtype_choice``, set by ``load_model``, and its quantization), else
    ``dtype_label(model_cfg)``."""
    chosen = getattr(model, "dtype_choice", None)
    if chosen is None:
        return dtype_label(model_cfg)
    return chosen.label(str(model_cfg.device)) + _quantization_label(model, model_cfg)


def _quantization_label(model, model_cfg) -> str:
    quantized = getattr(model, "quantized", None)
    if quantized is not None:
        return f"; quantization {quantized.choice.label()}"
    if getattr(model_cfg, "quantization", "none") == "none":
        return ""
    return f"; quantization {check_config(model_cfg).label()}"
