#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md, "Commands to run on a GPU") as one script with a time limit per step.
# Run from the repository root on a CUDA machine: bash scripts/gpu-check.sh [quick|full|chat|p2]
# p2 (issue 36, under 6 minutes): the GPU tests, the four NVIDIA SID-GR cells, the chat-beam shape, HF on the same
# GPU, `grserve serve --device cuda` under 200 concurrent requests, `bench serve --decode-only --device cuda`;
# one JSON line at the end (also $OUT/p2.json). DRY=1 runs the same steps on the CPU with tiny shapes.
# Logs go to $OUT (default /tmp/gpu-check); each step's last lines are printed. Packages the machine lacks
# (pydantic, fastapi, ...) can ride along as wheels in .whl/ (installed into /tmp/site, never into the system).
set -u
MODE=${1:-full}
PY=${PY:-python3}  # the interpreter (its own torch); DRY=1 runs on a CPU with e.g. PY=.venv/bin/python
SCALE=${SCALE:-1}  # multiplies every step's time limit (a loaded CPU in a dry run)
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=src:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/smi.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT/versions.txt"

step() {  # step NAME SECONDS CMD...: run CMD under a time limit, log to $OUT/NAME.log, print rc and the tail
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$((limit * SCALE))" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc $((SECONDS - t0))s"
    tail -n "${TAIL:-4}" "$OUT/$name.log"
}
DEV=${DEV:-cuda}
BENCH="$PY -m grserve_bench retrieval --device $DEV"
PYTEST="$PY -m pytest -q -p no:cacheprovider -rfEs"
case $MODE in
quick)
    TAIL=25 step gpu-tests 170 $PYTEST tests/grserve/engine/test_gpu_fast_path.py tests/grserve_bench/test_flex_bipartite.py
    TAIL=3 step p2-torch 150 $BENCH --grid-ctx 1000,5000 --grid-batch 1,8 --grid-bw 128,256 --hf-requests 1
    TAIL=3 step p2-triton 80 $BENCH --attention-backend triton --skip-hf --grid-ctx 5000 --grid-batch 8 --grid-bw 256
    ;;
full)
    TAIL=25 step gpu-tests 300 $PYTEST tests/grserve/engine/test_gpu_fast_path.py tests/grserve_bench/test_flex_bipartite.py
    TAIL=3 step p2-torch 300 $BENCH
    TAIL=3 step p2-triton 300 $BENCH --attention-backend triton
    TAIL=3 step p2-nographs 120 $BENCH --attention-backend triton --no-cuda-graphs --skip-hf \
        --grid-ctx 5000 --grid-batch 8 --grid-bw 256
    TAIL=6 step cpu-side-tests 300 $PYTEST tests/grserve/engine/test_device_runner.py tests/grserve/kernels/test_triton_kernels.py \
        tests/grserve/engine/test_retrieval_exact.py
    ;;
chat)  # issue 27: the OneRec-shaped chat-beam path (1.5 M items, 3 x 8,192 codes, ~2,500-token prompts) vs HF
    TAIL=25 step gpu-tests 170 $PYTEST tests/grserve/engine/test_gpu_fast_path.py tests/grserve_bench/test_flex_bipartite.py
    TAIL=3 step chat-beam 200 $BENCH --suite p2 --sid-layout onerec --num-items 1500000 --depth 3 \
        --codebook-size 8192 --p2-prompt-len 2500 --p2-batch 1 --p2-beam-width 256 --grid-ctx 2500 \
        --grid-batch 1,8 --grid-bw 128,256 --hf-requests 1 --attention-backend triton
    TAIL=3 step p2-triton 80 $BENCH --attention-backend triton --skip-hf --grid-ctx 5000 --grid-batch 8 --grid-bw 256
    ;;
p2)  # issue 36: the prefill as one varlen pass, the last layer on the last rows; everything else as before
    if [ "${DRY:-0}" = 1 ]; then  # the CPU dry run: the same steps, tiny shapes (checks the script, not the GPU)
        DEV=cpu; BENCH="$PY -m grserve_bench retrieval --device cpu"
        MODEL="--p2-model tiny --p2-dtype float32"; SRV_MODEL="--model tiny --device cpu --beam-width 16"
        CELLS="--p2-prompt-len 64 --p2-batch 2 --p2-beam-width 16 --grid-ctx 32,64 --grid-batch 1,2 --grid-bw 16"
        CHAT="--num-items 20000 --codebook-size 256 --p2-prompt-len 48 --p2-batch 2 --p2-beam-width 16 --grid-ctx 48 --grid-batch 1 --grid-bw 16"
        LOAD="--requests 8 --concurrency 8 --beam-width 16 --history 10"; TESTS="tests/grserve/attention/test_varlen_prefill.py"
        P2CELL="--p2-prompt-len 64 --p2-batch 2 --p2-beam-width 16 --grid-ctx 64 --grid-batch 2 --grid-bw 16"
        HFCTX=32; ITERS="--iters 2 --warmup 1"; DEC="--decode-only --quick --device cpu"; BACKEND=torch
    else
        MODEL=""; SRV_MODEL="--model qwen3-1.7b --device cuda --dtype bfloat16 --attention-backend triton --beam-width 256"
        CELLS="--grid-ctx 1000,5000 --grid-batch 1,8 --grid-bw 256"  # the P2 cell (5000 x 8, BW 256) is one of them
        CHAT="--num-items 1500000 --codebook-size 8192 --p2-prompt-len 2500 --p2-batch 8 --p2-beam-width 256 --grid-ctx 2500 --grid-batch 1,8 --grid-bw 128,256"
        LOAD="--requests 200 --concurrency 200 --beam-width 256 --history 300"
        TESTS="tests/grserve/engine/test_gpu_fast_path.py"
        P2CELL="--grid-ctx 5000 --grid-batch 8 --grid-bw 256"
        HFCTX=1000; ITERS=""; DEC="--decode-only --quick --device cuda"; BACKEND=triton
    fi
    TAIL=25 step gpu-tests 90 $PYTEST $TESTS
    TAIL=8 step nvidia-cells 90 $BENCH --suite p2 $MODEL $CELLS --attention-backend $BACKEND --hf-requests 1 --hf-ctx $HFCTX $ITERS
    TAIL=6 step chat-beam 100 $BENCH --suite p2 $MODEL --sid-layout onerec --depth 3 $CHAT --hf-requests 1 \
        --attention-backend $BACKEND $ITERS
    # the compiled prefill (off by default: no gain on CPU) on the P2 cell alone; its compile lands in first_batch_ms
    TAIL=4 step prefill-compiled 80 $BENCH --suite p2 $MODEL $P2CELL --attention-backend $BACKEND --skip-hf \
        --prefill-compile $ITERS
    PORT=${PORT:-8765}
    timeout $((130 * SCALE)) $PY -m grserve.cli serve $SRV_MODEL --port $PORT > "$OUT/server.log" 2>&1 &
    SRV=$!
    TAIL=3 step serve-load 110 $PY scripts/serve_load.py --url http://127.0.0.1:$PORT $LOAD --ready-timeout $((100 * SCALE))
    kill "$SRV" 2>/dev/null; wait "$SRV" 2>/dev/null
    TAIL=2 step decode-only 40 $PY -m grserve_bench serve $DEC
    $PY - "$OUT" <<'PY' | tee "$OUT/p2.json"
import json, sys
out = sys.argv[1]
def last_json(name):
    try:
        lines = [l for l in open(f"{out}/{name}.log", encoding="utf-8", errors="replace") if l.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None
cells, chat, load, dec, comp = (last_json(n) for n in ("nvidia-cells", "chat-beam", "serve-load", "decode-only",
                                                        "prefill-compiled"))
pick = lambda d, keys: None if d is None else {k: d.get(k) for k in keys}
cols = ("ctx", "batch", "beam_width", "ms_per_batch", "prefill_ms", "decode_ms", "capture_ms", "nvidia_ms",
        "nvidia_ms_over_ours", "eager_topk_overlap", "eager_top1_agreement", "speedup_vs_hf", "hf_oom")
print(json.dumps({"check": "gpu-check p2", "device": (cells or {}).get("device"), "prefill": (cells or {}).get("prefill"),
                  "nvidia_cells": [pick(r, cols) for r in (cells or {}).get("grid", []) if r.get("nvidia_ms")],
                  "speedup_vs_hf_gpu": (cells or {}).get("speedup_vs_hf_gpu"),
                  "speedup_vs_hf_gpu_cell": (cells or {}).get("speedup_vs_hf_gpu_cell"),
                  "chat_beam": [pick(r, cols) for r in (chat or {}).get("grid", [])],
                  "p2_prefill_compiled": pick(comp, ("ms_per_batch_p2", "prefill_ms_p2", "decode_ms_p2",
                                                     "first_batch_ms_p2", "prefill", "eager_topk_overlap_min")),
                  "serve_200": load, "decode_only": pick(dec, ("ours_tok_s", "hf_tok_s", "speedup", "same_tokens", "device"))}))
PY
    ;;
*) echo "usage: $0 [quick|full|chat|p2]"; exit 2 ;;
esac
