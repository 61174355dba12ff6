"""Which int8 GEMM is fastest on this CPU (issue 42 item 4, step 1): a measurement, not part of grserve.

For M rows in {8, 64, 512} and K = N in {1024, 2048}, one thread, times y = x @ W.T through
fp32 F.linear, fp32 and bf16 oneDNN-packed weights, and the int8 candidates: W8A8 (per-token dynamic activation
scales, per-output-channel weight scales) through torch._int_mm and through oneDNN's qlinear (prepacked int8
weights; signed and unsigned activations), weight-only int8 through aten._weight_int8pack_mm (fp32 and bf16
activations), and dequantize + F.linear (the reference). The W8A8 times include quantizing the activations; the
quantization alone is printed too. Rounds are interleaved; the median of the rounds' best times is printed.

    PYTHONPATH=src python scripts/int8_gemm_probe.py [--threads 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import warnings
import os
import statistics
import time

import torch
import torch.nn.functional as F


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: (int8 [M, K], fp32 scale [M, 1])."""
    s = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / 127.0
    return torch.round(x / s).clamp_(-127, 127).to(torch.int8), s


def quant_rows_fused(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same through torch's per-channel quantize kernel (one pass after the max)."""
    s = x.abs().amax(dim=1).float().clamp_min(1e-12) / 127.0
    q = torch.quantize_per_channel(x.float(), s, torch.zeros_like(s, dtype=torch.int64), 0, torch.qint8)
    return q.int_repr(), s[:, None]


def candidates(m: int, k: int, n: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.03
    ws = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    wq = torch.round(w / ws[:, None]).clamp(-127, 127).to(torch.int8)
    wq_t = wq.t().contiguous()
    zeros = torch.zeros(n, dtype=torch.int64)
    xb = x.to(torch.bfloat16)
    out = {}
    out["fp32 F.linear"] = lambda: F.linear(x, w)
    pw = torch.ops.mkldnn._reorder_linear_weight(w, m)
    out["fp32 packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")
    try:
        wb = w.to(torch.bfloat16)
        pwb = torch.ops.mkldnn._reorder_linear_weight(wb, m)
        out["bf16 packed"] = lambda: torch.ops.mkldnn._linear_pointwise(xb, pwb, None, "none", [], "")
    except RuntimeError:
        pass
    out["quantize x only"] = lambda: quant_rows(x)
    out["quantize x only (fused)"] = lambda: quant_rows_fused(x)

    def int_mm():
        xq, xs = quant_rows(x)
        return torch._int_mm(xq, wq_t).float().mul_(xs).mul_(ws)
    out["w8a8 _int_mm"] = int_mm

    def int_mm_bf16():
        xq, xs = quant_rows(xb)
        return torch._int_mm(xq, wq_t).float().mul_(xs).mul_(ws).to(torch.bfloat16)
    out["w8a8 _int_mm (bf16 x, bf16 out)"] = int_mm_bf16
    pq = torch.ops.onednn.qlinear_prepack(wq, [m, k])

    def qlinear_s8():
        xq, xs = quant_rows(x)
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, pq, ws, zeros, None, 1.0, 0, torch.float32, "none", [], "")
        return y.mul_(xs)
    if m <= 8:  # a reference kernel here (0.4 s at M=8 on a 2-core EPYC): measured at the smallest M only
        out["w8a8 onednn qlinear s8"] = qlinear_s8

    def qlinear_u8():
        s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
        xq = torch.round(x / s).add_(128).clamp_(1, 255).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 128, pq, ws, zeros, None, 1.0, 0, torch.float32, "none", [], "")
        return y.mul_(s)
    out["w8a8 onednn qlinear u8"] = qlinear_u8

    def qlinear_bf16():
        xq, xs = quant_rows(xb)
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, pq, ws, zeros, None, 1.0, 0, torch.bfloat16, "none", [], "")
        return y.mul_(xs.to(torch.bfloat16))
    if m <= 8:
        out["w8a8 onednn qlinear s8 (bf16 in/out)"] = qlinear_bf16
        out["w8 _weight_int8pack_mm fp32"] = lambda: torch.ops.aten._weight_int8pack_mm(x, wq, ws)
    wsb = ws.to(torch.bfloat16)
    out["w8 _weight_int8pack_mm bf16"] = lambda: torch.ops.aten._weight_int8pack_mm(xb, wq, wsb)
    out["w8 dequantize + F.linear (reference)"] = lambda: F.linear(x, wq.float() * ws[:, None])
    return out


SLOW = ("qlinear s8", "(bf16 in/out)", "_weight_int8pack_mm fp32")  # reference kernels here: one call a round


def best(fn, reps: int) -> float:
    t_best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        t_best = min(t_best, time.perf_counter() - t)
    return t_best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.quantize_per_tensor")
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, threads {a.threads}, "
          f"loadavg {os.getloadavg()[0]:.2f}")
    with torch.inference_mode():
        for k in (1024, 2048):
            for m in (8, 64, 512):
                fns = candidates(m, k, k)
                for fn in fns.values():
                    fn()  # warm: kernel selection, caches
                times: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(a.rounds):
                    for name, fn in fns.items():
                        slow = name.endswith(SLOW)
                        times[name].append(best(fn, 1 if slow else a.reps))
                base = statistics.median(times["fp32 packed"])
                print(f"\nM={m} K=N={k} (median of {a.rounds} rounds' best of {a.reps})")
                for name, ts in times.items():
                    t = statistics.median(ts)
                    gf = 2 * m * k * k / t / 1e9
                    print(f"  {name:40s} {t * 1e3:8.3f} ms  {gf:7.1f} GFLOP/s  {base / t:5.2f}x fp32 packed")
    print(f"\nloadavg at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
