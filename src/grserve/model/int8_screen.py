"""An int8 screen of the LM head for the exact greedy pick (``engine/greedy_head.py``) on CPUs without fast bf16.

The screened greedy head needs ``lo ≈ h · Wᵀ`` cheaply and a per-row bound ``E`` with ``|lo_j − h·w_j| ≤ E``. On an
AVX2 CPU (no AVX-512 BF16, no VNNI) bf16 matmuls are slow and ``torch._int_mm`` runs a reference kernel, but
fbgemm's dynamically quantized linear (``quantized::linear_dynamic``, u8 × s8 with ``vpmaddubsw``, int32 sums) reads
a quarter of the fp32 head's bytes: 2.2–3.4× the oneDNN-packed fp32 head at 1–64 rows on the 2-core AMD EPYC
family 25 model 1 (docs/llm.md, "An int8 screen of the LM head").

That op quantizes its input per *tensor* with parameters it chooses itself, which would make a row's screen depend
on its batch and its error unknown. So the input is put on the op's grid first:

1. each row of h is quantized here, symmetric, to integers ``q`` in [−63, 63] with its own scale
   ``s = max|h| / 63`` (after scaling the row by a power of two to a maximum in [0.5, 1): the screen and its bound
   are then the row's up to that factor, which moves neither the argmax nor the band); ``ĥ = s·q``, and
   ``‖h − ĥ‖₂`` is computed per row;
2. the op sees ``[q, 64, −63]`` in row 0 and ``[q, 0, 0]`` in the others against the weight ``[Ŵ, 0, 0]`` (two zero
   columns), so the tensor's range is [−63, 64] and the op's own parameters are scale 1 and zero point 63
   (``reduce_range``: 127 levels, no ``vpmaddubsw`` saturation): it represents every value exactly, and its output
   is ``fl(s_w_j · Σ_i q_i·q̂w_ji)`` (integer sums below 2²⁴: exact in fp32), ``lo_j = fl(s · out_j)``; a start-up
   trial checks this bit for bit and refuses the screen where it does not hold;
3. ``Ŵ``: the head quantized per output row, symmetric int8 (``quantized_linear.quantize_int8_rows``: ``q̂w_j =
   round(w_j / s_w_j)``, ``s_w_j = max|w_j| / 127``), ``max_j ‖w_j − ŵ_j‖₂`` kept.

Two passes (``screen(h, passes=2)``): each row's residual ``h − ĥ`` goes through the same call as a second row on
its own grid (``ĥ = s₁q₁ + s₂q₂``): a ~60x smaller activation term for twice the op's rows. One pass is faster
where the op is compute-bound (8 rows and more) and the logits are peaked, but flat ones let thousands of
candidates per row through (docs/llm.md: 11,000 per row on the medium shape's random weights, a 141 ms head); the
greedy head screens such a pass again with two (``engine/greedy_head.py``).

Then ``|h·w_j − lo_j| ≤ ‖h − ĥ‖₂·‖w_j‖₂ + ‖ĥ‖₂·‖w_j − ŵ_j‖₂ + 3·2⁻²⁴·‖ĥ‖₂·‖ŵ_j‖₂`` (Cauchy–Schwarz twice; two
fp32 roundings of the scaling), bounded with the maxima over j and a factor 2 of slack. Each row's screen and
bound depend on that row only (the grid makes the op's per-tensor choice constant), so the pick stays batch
invariant. Rows that are not finite get a NaN screen (no candidates, as the bf16 screen gives them) and zeros on
the grid, so they cannot move another row's parameters.
"""

from __future__ import annotations

import functools
import warnings

import torch

from grserve.model.cpu_support import cpu_support
from grserve.model.quantized_linear import quantize_int8_rows

Q_MAX = 63          # |q| of the activations: with 64 as the grid's top the op's range is [-63, 64], 127 levels
U_FP32 = 2.0 ** -24
SLACK = 2.0
PASSES = 2  # the default: each row's residual as a second row of the same call (a ~60x smaller activation term)


@functools.cache
def _fbgemm_engine() -> bool:
    try:
        engines = torch.backends.quantized.supported_engines
    except RuntimeError:
        return False
    return "fbgemm" in engines and hasattr(torch.ops.quantized, "linear_dynamic")


def fbgemm_available() -> bool:
    """fbgemm's quantized engine is in this torch build and runs on this CPU (x86 with AVX2), and the fast paths
    are on (not under ``GRSERVE_CPU_ISA=reference``)."""
    return cpu_support().fast_paths and _fbgemm_engine()


def unit_rows(h: torch.Tensor) -> torch.Tensor:
    """Each row scaled by a power of two to a maximum in [0.5, 1) (exact: the argmax and the candidates do not
    change), so no scale or product of the screen is subnormal and the fp32 term of the bound holds."""
    return torch.ldexp(h, -torch.frexp(h.abs().amax(dim=1, keepdim=True)).exponent)


class Int8Screen:
    """``screen(h) -> (lo fp32 [B, V], bound fp32 [B])`` with ``|lo_j − h·w_j| ≤ bound`` for every finite row."""

    def __init__(self, weight: torch.Tensor, passes: int | None = None):
        """``passes``: what ``screen`` runs when not told (1 or 2; default ``PASSES``)."""
        self.passes = _passes(PASSES if passes is None else passes)
        w = weight.detach().float()
        n, self.k = w.shape
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensor constructors are deprecated (the op is not)
            q8, scale = quantize_int8_rows(w)  # the projections' int8 quantizer: symmetric per row, |q| <= 127
            qw, scale = q8.float(), scale.view(-1)
            dq = qw * scale[:, None]
            self.max_row_norm = float(w.norm(dim=1).max())
            self.max_dq_norm = float(dq.norm(dim=1).max())
            self.max_err_norm = float((w.double() - (qw.double() * scale.double()[:, None])).norm(dim=1).max())
            grid = torch.cat([dq, dq.new_zeros(n, 2)], dim=1)
            qt = torch.quantize_per_channel(grid, scale.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
            if not torch.equal(qt.int_repr()[:, :self.k], q8):
                raise RuntimeError("the per-channel quantizer did not reproduce the int8 head")
            self.packed = torch.ops.quantized.linear_prepack(qt, None)
            self.qw: torch.Tensor | None = q8  # the check's reference, dropped after it
            self.w_scale = qt.q_per_channel_scales().float()

    def _grid(self, h: torch.Tensor, passes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h's rows on the op's grid: (q [P·B, K] integers in [−63, 63]: the rows, then (two passes) their
        residuals; s [P·B] their scales; ĥ [B, K] = Σ s·q over the passes)."""
        tiny = torch.finfo(torch.float32).tiny
        qs, ss, hq, r = [], [], torch.zeros_like(h), h
        for _ in range(passes):
            s = r.abs().amax(dim=1).clamp_min(tiny) / Q_MAX
            q = torch.round(r / s[:, None]).clamp_(-Q_MAX, Q_MAX)
            part = q * s[:, None]
            hq += part
            r = r - part
            qs.append(q)
            ss.append(s)
        return torch.cat(qs), torch.cat(ss), hq

    def screen(self, h: torch.Tensor, passes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        passes = self.passes if passes is None else _passes(passes)
        b = h.shape[0]
        if b == 0:
            return h.new_empty((0, self.w_scale.shape[0])), h.new_empty((0,))
        finite = torch.isfinite(h).all(dim=1)
        all_finite = bool(finite.all())
        if not all_finite:
            h = h.masked_fill(~finite[:, None], 0.0)
        h = unit_rows(h)
        q, s, hq = self._grid(h, passes)
        x = torch.zeros(passes * b, self.k + 2)
        x[:, :self.k] = q
        x[0, self.k], x[0, self.k + 1] = Q_MAX + 1, -Q_MAX
        out = torch.ops.quantized.linear_dynamic(x, self.packed, True)
        out.mul_(s[:, None])
        lo = out[:b]
        parts = (q * s[:, None]).norm(dim=1)
        for p in range(1, passes):
            lo.add_(out[p * b:(p + 1) * b])
        err = (h - hq).norm(dim=1)
        bound = SLACK * (err * self.max_row_norm + hq.norm(dim=1) * self.max_err_norm
                         + 4 * U_FP32 * parts.view(passes, b).sum(dim=0) * self.max_dq_norm)
        if not all_finite:
            lo[~finite] = float("nan")
            bound[~finite] = float("nan")
        return lo, bound

    def check(self) -> str | None:
        """The op's output against the integer sums it must equal bit for bit, with one pass and with two; None
        when it does, else why not."""
        g = torch.Generator().manual_seed(0)
        h = torch.randn(5, self.k, generator=g) * 3
        assert self.qw is not None, "check() runs once"
        for passes in (1, 2):
            try:
                with torch.inference_mode():
                    lo, _ = self.screen(h, passes)
            except Exception as exc:  # noqa: BLE001 -- any failure: not on this CPU/build
                return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            q, sc, _ = self._grid(unit_rows(h), passes)
            sums = (q.double() @ self.qw.double().T).float()  # exact integers, exactly representable
            out = (sums * self.w_scale[None, :]) * sc[:, None]
            want = out[:5]
            for p in range(1, passes):
                want = want + out[5 * p:5 * (p + 1)]
            if not torch.equal(lo, want):
                return f"fbgemm's dynamic linear did not return the exact integer sums on the grid ({passes} pass)"
        self.qw = None  # only the check reads it
        return None


def _passes(passes: int) -> int:
    if passes not in (1, 2):
        raise ValueError(f"passes must be 1 or 2, not {passes}")
    return passes
