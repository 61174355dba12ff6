"""The greedy head's GEMM choices on this CPU (docs/llm.md, "Every CPU"): run it as is, and again with oneDNN,
ATen and MKL held to AVX2 to see a CPU without fast bf16:

    .venv/bin/python scripts/greedy_head_bench.py lm-head
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python scripts/greedy_head_bench.py engine tiny

``lm-head``: ms per call (median of 30, one thread) of the LM head alone: fp32 ``F.linear`` + argmax, the oneDNN-packed
fp32 matmul + argmax, the bf16 screen's GEMM + top-8 on ``F.linear`` and oneDNN-packed (where this CPU has it).
``engine SHAPE`` (tiny | medium): greedy output tokens/s of ``LLMEngine.generate`` with each head (the default
choice, exact fp32 only, the bf16 screen at every row count, no head), 3 interleaved rounds; the tokens must agree.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from grserve.engine.greedy_head import ALL_ROWS, ScreenedGreedyHead
from grserve.engine.llm import build_model_engine
from grserve.engine.sampling import SamplingParams
from grserve.model import Decoder, ModelSpec, load_model
from grserve.model.cpu_support import cpu_support
from grserve.scheduler.fcfs import FCFSScheduler


def _median_ms(fn, reps: int = 30) -> float:
    fn()
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def _packed(w: torch.Tensor):
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w, 32)
    except Exception:  # noqa: BLE001 -- not on this CPU / build
        return None


def lm_head() -> None:
    for vocab, hidden in [(32000, 256), (32000, 1024)]:
        w = torch.randn(vocab, hidden) * 0.02
        wb = w.bfloat16()
        wp, wbp = _packed(w), _packed(wb)
        for rows in (1, 2, 4, 8, 16, 32):
            h = torch.randn(rows, hidden)
            r = {"fp32": _median_ms(lambda: F.linear(h, w).argmax(1))}
            if wp is not None:
                r["fp32-packed"] = _median_ms(
                    lambda: torch.ops.mkldnn._linear_pointwise(h, wp, None, "none", [], "").argmax(1))
            r["bf16"] = _median_ms(lambda: F.linear(h.bfloat16(), wb).topk(8, dim=1), reps=10)
            if wbp is not None:
                r["bf16-packed"] = _median_ms(
                    lambda: torch.ops.mkldnn._linear_pointwise(h.bfloat16(), wbp, None, "none", [], "").topk(8, dim=1))
            print(f"vocab {vocab} x hidden {hidden}, {rows} rows: "
                  + ", ".join(f"{k} {v:.2f} ms" for k, v in r.items()), flush=True)


def _model(shape: str):
    if shape == "tiny":
        return load_model("tiny-mha", seed=0)
    spec = ModelSpec(family="qwen3", vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                     tie_word_embeddings=True, attention_bias=False, qk_norm=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = Decoder(spec).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.02)
    return model


def engine(shape: str) -> None:
    model = _model(shape)
    w = model.lm_head.weight
    modes = {"default": None, "exact-fp32": 0, "screen-all": ALL_ROWS, "no-head": "none"}
    res: dict = {m: {} for m in modes}
    want: dict = {}
    for _ in range(3):
        for batch in (1, 8, 32):
            for mode, rows in modes.items():
                eng = build_model_engine(model, FCFSScheduler(), num_blocks=1024, block_size=16)
                if rows == "none":
                    eng.executor.greedy_head = None
                elif rows is not None:
                    eng.executor.greedy_head = ScreenedGreedyHead(w, screen_max_rows=rows)
                g = torch.Generator().manual_seed(batch)
                prompts = [torch.randint(3, 30000, (32,), generator=g).tolist() for _ in range(batch)]
                t = time.perf_counter()
                out = eng.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
                dt = time.perf_counter() - t
                assert out == want.setdefault(batch, out), (mode, batch)
                res[mode].setdefault(batch, []).append(batch * 24 / dt)
    for mode in modes:
        print(mode, {b: round(statistics.median(v), 1) for b, v in res[mode].items()}, "tok/s", flush=True)


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)
    print(cpu_support().label(), flush=True)
    if argv[:1] == ["lm-head"]:
        lm_head()
    elif argv[:1] == ["engine"] and len(argv) == 2 and argv[1] in ("tiny", "medium"):
        engine(argv[1])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
