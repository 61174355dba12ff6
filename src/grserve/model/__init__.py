"""Model runtime: Qwen2/Qwen3 decoder specs, the packed-token decoder, and weight loading."""

from grserve.model.decoder import Decoder
from grserve.model.loader import DTYPES, load_model, resolve_dtype, resolve_spec, save_pretrained
from grserve.model.spec import PRESETS, ModelSpec

__all__ = ["ModelSpec", "PRESETS", "DTYPES", "Decoder", "load_model", "resolve_dtype", "save_pretrained", "resolve_spec"]
