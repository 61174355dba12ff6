"""Model runtime: Qwen2/Qwen3 decoder specs, the packed-token decoder, and weight loading."""

from grserve.model.decoder import Decoder
from grserve.model.loader import load_model, resolve_spec, save_pretrained
from grserve.model.spec import PRESETS, ModelSpec

__all__ = ["ModelSpec", "PRESETS", "Decoder", "load_model", "save_pretrained", "resolve_spec"]
