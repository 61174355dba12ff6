"""``--quantization``: the decoder's projections in int8 (CPU) or fp8 (CUDA), quantized at load (issue 42 item 4).

Schemes (``SCHEMES``):

- ``int8`` (W8A8): each projection weight quantized once, per output channel, symmetric int8 (scale = row
  max |w| / 127); each activation row quantized per call, per token, symmetric int8; the int8 x int8 product
  accumulates in int32 (``torch._int_mm``; at most ``SMALL_ROWS`` rows, oneDNN's ``qlinear`` on a prepacked weight,
  the same sums) and is scaled back by (token scale x channel scale) in fp32, then cast to the model dtype. Integer sums are exact, so a row's result does not depend on the other rows of the call:
  ``exact_rows`` lets ``grouped_linear`` run one GEMM over every request's rows and stay batch invariant.
- ``int8-weight-only``: int8 weights as above, activations in the model dtype (``aten._weight_int8pack_mm``):
  half the bytes of bf16 weights, for decode steps bound by reading weights.
- ``fp8`` (CUDA, compute capability >= 8.9): e4m3 weights with one scale per output row, e4m3 activations with one
  scale per token, ``torch._scaled_mm`` with row-wise scales, bf16 out.

The choice of op was measured on a 2-core AMD EPYC with AVX512-VNNI (``scripts/int8_gemm_probe.py``, docs/
benchmarks.md, "int8"): ``torch._int_mm`` with the weight stored K x N was the fastest W8A8 op at 64-1024 rows
(3.1-5.4x fp32-packed, 1.5-2.7x bf16-packed, activation quantization included); oneDNN's ``qlinear_pointwise``
was equal at 64 rows, faster at 1-32 rows (up to 4x on a 4096-wide layer), slower at 512, and runs a reference
kernel (1000x slower) for signed activations, so small calls give it unsigned ones (zero point 128); ``_weight_int8pack_mm`` runs a scalar loop for fp32 activations and is slower than
bf16-packed weights for bf16 ones at 8+ rows.

A scheme this machine cannot run fast is refused at load with the reason (``QuantizationRefused``, a
``ConfigError``: ``grserve: error: --quantization: ...``), never run slowly: ``choose(scheme, device, dtype)``
checks the device, ``model/cpu_support.py`` (no fast paths under ``GRSERVE_CPU_ISA=reference``; int8 needs VNNI or
AMX-INT8, so not under ``GRSERVE_CPU_ISA=avx2`` or ``ONEDNN_MAX_CPU_ISA=AVX2``), a trial call of the op against the reference, and a timed trial:
one thread, the op against the unquantized projection it replaces (oneDNN-packed weights in the model dtype, as
``model/dtype_choice.py`` times bf16), best of 7; it must be ``MIN_SPEEDUP`` x faster. The trial runs once per
process and is handed to the processes this one starts (``TRIAL_ENV``), as the bf16 trial is.

Every scheme has a reference path, ``QuantizedLinears.reference()``: the same quantized values, dequantized and
multiplied by ``F.linear`` in fp32 (tests: the fast op equals it to fp32 rounding). What is quantized: the seven
projections of every layer. Not the embeddings, the LM head or the SID head: the beam scores, log-sum-exp merges
and softmax read fp32 logits as before. The model's own (unquantized) projection weights stay beside the
quantized ones (the training recipe, ``save_pretrained``); ``Decoder.forward`` runs the quantized ones whenever the
model carries them.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from grserve.flags import ConfigError
from grserve.model.cpu_support import cpu_support, trial_call
from grserve.model.dtype_choice import best_time
from grserve.model.thread_choice import torch_threads

NONE = "none"
SCHEMES = (NONE, "int8", "int8-weight-only", "fp8")
MIN_SPEEDUP = 1.1  # the quantized op must beat the unquantized projection by this much in the timed trial
TRIAL_SHAPES = {"int8": (64, 1024, 1024), "int8-weight-only": (8, 1024, 1024)}  # rows, in, out features
TRIAL_REPEATS = 7
TRIAL_ENV = "GRSERVE_QUANT_TRIAL"  # "<scheme>:<dtype>=<base seconds>,<quantized seconds>;..." for child processes
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
_TINY = 1e-12


class QuantizationRefused(ConfigError):
    """This machine cannot run the scheme fast (or at all); the message says why."""

    def __init__(self, scheme: str, reason: str):
        self.scheme, self.reason = scheme, reason
        super().__init__("quantization", f"{scheme} refused: {reason}")


@dataclass(frozen=True)
class QuantChoice:
    scheme: str   # one of SCHEMES
    op: str       # the op that runs it ("torch._int_mm", ...); "" for none
    reason: str   # why it may run here (the timed trial's speed-up), for start lines

    def label(self) -> str:
        """``int8 (W8A8 via torch._int_mm, 3.1x the float32 projection in a trial)``; ``none``."""
        return self.scheme if self.scheme == NONE else f"{self.scheme} ({self.op}, {self.reason})"

    def to_dict(self) -> dict:
        return {"quantization": self.scheme, "quantization_op": self.op, "quantization_reason": self.reason}


NO_QUANTIZATION = QuantChoice(NONE, "", "")


# ---- the arithmetic: one quantizer for the fast ops and the reference ---------------------------------------
def quantize_int8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (int8 [..., K], fp32 scale [..., 1]); ``t ~ q * scale``, |error| <= scale / 2."""
    tf = t.float()
    scale = tf.abs().amax(dim=-1, keepdim=True).clamp_min(_TINY) / INT8_MAX
    return torch.round(tf / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 per row: (float8_e4m3fn [..., K], fp32 scale [..., 1]), the row's max |t| mapped to 448."""
    tf = t.float()
    scale = tf.abs().amax(dim=-1, keepdim=True).clamp_min(_TINY) / FP8_MAX
    return (tf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


class QuantizedWeight(NamedTuple):
    q: torch.Tensor                # int8 / e4m3 [N, K] (row = output channel)
    scale: torch.Tensor            # fp32 [N, 1]
    bias: torch.Tensor | None      # the projection's bias, in the model dtype
    kernel: torch.Tensor | None    # the op's own copy: int8 [K, N] (_int_mm), scales in the model dtype (weight-only)
    small: tuple | None = None     # int8, <= SMALL_ROWS rows: (oneDNN-prepacked int8 weight, ones [N], zeros [N])


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _finish(y: torch.Tensor, w: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    if w.bias is not None:
        y = y + w.bias.float() if y.dtype != w.bias.dtype else y + w.bias
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


# W8A8 int8
SMALL_ROWS = 32  # at most this many rows: oneDNN's qlinear on a prepacked weight (faster there; docs/benchmarks.md)


def _int8_sums(xq: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """The int32 sums xq @ w.q.T as fp32 [M, N]: the same bits through either op (exact integer sums, one rounding
    to fp32; checked in the tests), so the choice by row count keeps a row's result independent of its batch."""
    if w.small is not None and xq.shape[0] <= SMALL_ROWS:
        packed, ones, zeros = w.small
        u8 = torch.bitwise_xor(xq.view(torch.uint8), 128)  # v + 128 as uint8 (zero point 128): its fast path
        return torch.ops.onednn.qlinear_pointwise(u8, 1.0, 128, packed, ones, zeros, None, 1.0, 0, torch.float32,
                                                  "none", [], "")
    return torch._int_mm(xq, w.kernel).float()


def _int8_op(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    rows = _rows(x)
    if rows.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], w.q.shape[0]))
    xq, xs = quantize_int8_rows(rows)
    y = _int8_sums(xq, w).mul_(xs).mul_(w.scale.view(1, -1))
    return _finish(y, w, x)


def _prepack_small(q: torch.Tensor) -> tuple | None:
    """oneDNN's prepacked int8 weight for ``SMALL_ROWS``-row calls, None where this torch build lacks the op."""
    try:
        packed = torch.ops.onednn.qlinear_prepack(q, [SMALL_ROWS // 2, q.shape[1]])
    except (AttributeError, RuntimeError):
        return None
    n = q.shape[0]
    return packed, torch.ones(n), torch.zeros(n, dtype=torch.int64)


def _int8_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    rows = _rows(x)
    return _finish(F.linear(dequantize_rows(*quantize_int8_rows(rows)), dequantize_rows(w.q, w.scale)), w, x)


# int8 weight-only
def _weight_only_op(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    rows = _rows(x)
    return _finish(torch.ops.aten._weight_int8pack_mm(rows, w.q, w.kernel), w, x)


def _weight_only_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return _finish(F.linear(_rows(x).float(), dequantize_rows(w.q, w.scale)), w, x)


# fp8 (CUDA)
def _fp8_op(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    rows = _rows(x)
    m = rows.shape[0]
    pad = -m % 16  # _scaled_mm wants every dimension a multiple of 16
    if pad:
        rows = F.pad(rows, (0, 0, 0, pad))
    xq, xs = quantize_fp8_rows(rows)
    y = torch._scaled_mm(xq, w.q.t(), scale_a=xs, scale_b=w.scale.view(1, -1), out_dtype=torch.bfloat16)
    return _finish(y[:m], w, x)


def _fp8_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    rows = _rows(x)
    return _finish(F.linear(dequantize_rows(*quantize_fp8_rows(rows)), dequantize_rows(w.q, w.scale)), w, x)


# scheme -> (op name, fast op, reference, exact rows)
_OPS = {
    "int8": ("W8A8 via torch._int_mm, oneDNN qlinear at <= 32 rows", _int8_op, _int8_reference, True),
    "int8-weight-only": ("weight-only via aten._weight_int8pack_mm", _weight_only_op, _weight_only_reference, False),
    "fp8": ("W8A8 e4m3 via torch._scaled_mm, row-wise scales", _fp8_op, _fp8_reference, False),
}


def quantize_weight(scheme: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> QuantizedWeight:
    """A projection weight [N, K] (and bias) in ``scheme``'s storage, with the op's own copy."""
    with torch.inference_mode():
        if scheme == "fp8":
            q, scale = quantize_fp8_rows(weight)
            return QuantizedWeight(q, scale, bias, None)
        q, scale = quantize_int8_rows(weight)
        if scheme == "int8":
            kernel = q.t().contiguous()  # K x N: the layout _int_mm ran fastest with (docs/benchmarks.md)
            return QuantizedWeight(q, scale, bias, kernel, _prepack_small(q) if weight.device.type == "cpu" else None)
        return QuantizedWeight(q, scale, bias, scale.view(-1).to(weight.dtype))


def projections(model: nn.Module) -> list[nn.Linear]:
    from grserve.model.packed_linear import projections as all_projections

    return all_projections(model)


class QuantizedLinears:
    """The quantized projections of a model, held beside it (``Decoder.quantized``): ``linear(x, lin)`` runs the
    scheme's op, or its reference (``reference()``) -- the same ``linear`` interface as ``PackedLinears``."""

    def __init__(self, model: nn.Module, choice: QuantChoice, *, reference: bool = False,
                 weights: dict[nn.Linear, QuantizedWeight] | None = None):
        if choice.scheme not in _OPS:
            raise ValueError(f"unknown quantization {choice.scheme!r}; choose one of {', '.join(SCHEMES)}")
        self.choice = choice
        self.is_reference = reference
        name, op, ref, exact = _OPS[choice.scheme]
        self._fn = ref if reference else op
        # int32 sums are exact: a row's result is the same in any batch (grouped_linear need not split the rows)
        self.exact_rows = exact and not reference
        if weights is None:
            weights = {lin: quantize_weight(choice.scheme, lin.weight.detach(),
                                            None if lin.bias is None else lin.bias.detach())
                       for lin in projections(model)}
        self.weights = weights

    def reference(self) -> "QuantizedLinears":
        """The same quantized weights through the plain dequantize + ``F.linear`` path (fp32)."""
        return QuantizedLinears(None, self.choice, reference=True, weights=self.weights)  # type: ignore[arg-type]

    def linear(self, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
        w = self.weights.get(lin)
        if w is None:
            return F.linear(x, lin.weight, lin.bias)
        return self._fn(x, w)

    def nbytes(self) -> int:
        """Bytes of the quantized weights, scales and the op's copies."""
        total = 0
        for w in self.weights.values():
            for t in (w.q, w.scale, w.kernel, *(w.small or ())):
                total += 0 if t is None else t.numel() * t.element_size()
        return total

    def describe(self) -> str:
        kind = "reference (dequantize + F.linear)" if self.is_reference else self.choice.op
        return f"{self.choice.scheme} {kind}, {len(self.weights)} projections, {self.nbytes() / 2**20:.1f} MiB"

    def __len__(self) -> int:
        return len(self.weights)


# ---- may this machine run it fast? ---------------------------------------------------------------------------
_VNNI_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")


def int8_isa() -> str:
    """The x86 int8 dot-product instructions this CPU has (``amx_int8``, ``avx512_vnni``, ``avx_vnni``), the first
    found in /proc/cpuinfo's flags; "" when none (or no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = set(line.partition(":")[2].split())
                    return next((fl for fl in _VNNI_FLAGS if fl in flags), "")
    except OSError:
        pass
    return ""


def _trial_call(scheme: str, dtype: torch.dtype) -> str | None:
    """One small call of the scheme's op against its reference; None when it works and agrees, else why not."""
    def compute():
        g = torch.Generator().manual_seed(0)
        w = quantize_weight(scheme, (torch.randn(48, 64, generator=g) * 0.05).to(dtype))
        x = torch.randn(SMALL_ROWS + 8, 64, generator=g).to(dtype)
        got = torch.cat([_OPS[scheme][1](x[:5], w), _OPS[scheme][1](x[5:], w)]).float()  # small and large
        return got, _OPS[scheme][2](x, w).float()

    return trial_call(compute, 1e-4 if dtype == torch.float32 else 2e-2,
                      "a trial call disagreed with the dequantize reference")


def _inherited(key: str) -> tuple[float, float] | None:
    for part in os.environ.get(TRIAL_ENV, "").split(";"):
        name, _, times = part.partition("=")
        if name == key:
            try:
                base, quant = (float(v) for v in times.split(","))
            except ValueError:
                return None
            return (base, quant) if base > 0 and quant > 0 else None
    return None


@functools.lru_cache(maxsize=None)
def timed_trial(scheme: str, dtype_name: str) -> tuple[float, float, float]:
    """(unquantized seconds, quantized seconds, speed-up) of one projection at ``TRIAL_SHAPES[scheme]``, one
    thread, best of ``TRIAL_REPEATS``: the unquantized projection through oneDNN-packed weights in ``dtype_name``
    where this CPU packs that dtype, else ``F.linear``."""
    from grserve.model.packed_linear import available, pack_weight, packed_matmul

    key = f"{scheme}:{dtype_name}"
    hit = _inherited(key)
    if hit is not None:
        return hit[0], hit[1], hit[0] / hit[1]
    dtype = getattr(torch, dtype_name)
    m, k, n = TRIAL_SHAPES[scheme]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.03).to(dtype)
    qw = quantize_weight(scheme, w)
    op = _OPS[scheme][1]
    with torch_threads(1), torch.inference_mode():
        if available(dtype):
            pw = pack_weight(w, m)
            base = best_time(lambda: packed_matmul(x, pw), TRIAL_REPEATS)
        else:
            base = best_time(lambda: F.linear(x, w), TRIAL_REPEATS)
        quant = best_time(lambda: op(x, qw), TRIAL_REPEATS)
    parts = [p for p in os.environ.get(TRIAL_ENV, "").split(";") if p and not p.startswith(key + "=")]
    os.environ[TRIAL_ENV] = ";".join([*parts, f"{key}={base:.9f},{quant:.9f}"])
    return base, quant, base / quant


def _cuda_refusal(scheme: str, device: str) -> str | None:
    if scheme != "fp8":
        return f"{scheme} runs on CPUs (torch's int8 CPU kernels); on a CUDA device use fp8 or --dtype bfloat16"
    if not torch.cuda.is_available():
        return f"no CUDA device is available for {device}"
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"this torch build ({torch.__version__}) has no torch._scaled_mm / float8_e4m3fn"
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if (major, minor) < (8, 9):
        return (f"fp8 needs a CUDA device of compute capability >= 8.9 (Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(torch.device(device))} is {major}.{minor}")
    return None


def _cpu_refusal(scheme: str, dtype: torch.dtype) -> str | None:
    s = cpu_support()
    if scheme == "fp8":
        return ("fp8 runs on CUDA devices of compute capability >= 8.9 (torch._scaled_mm); this CPU has no fast "
                "fp8 GEMM (use int8 here)")
    if not s.fast_paths:
        return "GRSERVE_CPU_ISA=reference turns every fast path off (the int8 ops included)"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the int8 projections take float32 or bfloat16 activations, not {str(dtype).removeprefix('torch.')}"
    if scheme == "int8":
        if s.forced == "avx2":
            return "GRSERVE_CPU_ISA=avx2: no VNNI / AMX-INT8, the int8 dot products torch._int_mm needs to be fast"
        held = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
        if held in ("SSE41", "AVX", "AVX2"):
            return f"ONEDNN_MAX_CPU_ISA={held} holds oneDNN below VNNI / AMX-INT8, the int8 dot products it needs"
        if s.machine in ("x86_64", "AMD64", "i686") and not int8_isa():
            return f"this CPU ({s.cpu_model}) has no VNNI / AMX-INT8 int8 dot products"
    why = _trial_call(scheme, dtype)
    if why:
        return f"the {_OPS[scheme][0]} trial call failed here ({why})"
    try:
        base, quant, speedup = timed_trial(scheme, str(dtype).removeprefix("torch."))
    except Exception as exc:  # noqa: BLE001
        return f"the timed trial failed ({type(exc).__name__}: {exc})"
    if speedup < MIN_SPEEDUP:
        m, k, n = TRIAL_SHAPES[scheme]
        return (f"{_OPS[scheme][0]} is not faster than the {str(dtype).removeprefix('torch.')} projection on this "
                f"CPU ({m} x {k} x {n}, one thread: {quant * 1e3:.3f} ms vs {base * 1e3:.3f} ms, {speedup:.2f}x; "
                f"needs {MIN_SPEEDUP}x)")
    return None


def choose(scheme: str, device: str | torch.device = "cpu", dtype: torch.dtype | str = torch.float32) -> QuantChoice:
    """The ``QuantChoice`` of ``scheme`` for a model in ``dtype`` on ``device``; ``QuantizationRefused`` (with the
    reason) where this machine cannot run it fast."""
    if scheme == NONE:
        return NO_QUANTIZATION
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    device = str(device)
    why = _cuda_refusal(scheme, device) if device.startswith("cuda") else _cpu_refusal(scheme, dtype)
    if why:
        raise QuantizationRefused(scheme, why)
    if device.startswith("cuda"):
        return QuantChoice(scheme, _OPS[scheme][0], "CUDA compute capability >= 8.9")
    _, _, speedup = timed_trial(scheme, str(dtype).removeprefix("torch."))
    m, k, n = TRIAL_SHAPES[scheme]
    return QuantChoice(scheme, _OPS[scheme][0], f"{speedup:.1f}x the {str(dtype).removeprefix('torch.')} "
                                                f"projection in a {m}-row trial")


def quantize_model(model: nn.Module, scheme: str) -> QuantizedLinears | None:
    """Quantize ``model``'s projections (``choose`` first: refused where not fast); None for ``none``."""
    choice = choose(scheme, model.device, model.dtype)
    return None if choice.scheme == NONE else QuantizedLinears(model, choice)


def check_config(model_cfg) -> QuantChoice:
    """A ``ModelConfig``'s quantization checked before anything is loaded (servers' start-up: a refusal is a usage
    error in the front end, not a dead engine process)."""
    from grserve.model import dtype_choice

    scheme = getattr(model_cfg, "quantization", NONE)
    if scheme == NONE:
        return NO_QUANTIZATION
    dtype = dtype_choice.resolve(model_cfg.dtype, str(model_cfg.device))
    return choose(scheme, model_cfg.device, dtype)


def refresh() -> None:
    """Forget the timed trials (tests)."""
    os.environ.pop(TRIAL_ENV, None)
    timed_trial.cache_clear()

