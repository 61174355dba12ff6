#!/usr/bin/env bash
# The prepared GPU check (docs/gpu.md, "Commands to run on a GPU") as one script with a time limit per step.
# Run from the repository root on a CUDA machine: bash scripts/gpu-check.sh [quick|full|chat]
# Logs go to $OUT (default /tmp/gpu-check); each step's last lines are printed. Packages the machine lacks
# (pydantic, fastapi, ...) can ride along as wheels in .whl/ (installed into /tmp/site, never into the system).
set -u
MODE=${1:-full}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=src:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/smi.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT/versions.txt"

step() {  # step NAME SECONDS CMD...: run CMD under a time limit, log to $OUT/NAME.log, print rc and the tail
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc $((SECONDS - t0))s"
    tail -n "${TAIL:-4}" "$OUT/$name.log"
}
BENCH="python3 -m grserve_bench retrieval --device cuda"
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfEs"
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
*) echo "usage: $0 [quick|full|chat]"; exit 2 ;;
esac
