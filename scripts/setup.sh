#!/usr/bin/env bash
# Set up a fresh machine for rlsys: a virtualenv in .venv with the CPU torch wheel and rlsys (+ test tools).
# Idempotent: a second run only checks what is there. GPU machines: see docs (pip install -e '.[gpu]').
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# (pip's "Location ... is ignored" lines about the local index are harmless noise: filtered out.)
pip() { .venv/bin/pip "$@" --disable-pip-version-check 2> >(grep -v "is ignored" >&2); }
# torch first, so that rlsys's `torch>=2.5` is already met. In order: the CPU wheel from the machines' local wheel
# folder (pip's find-links; seconds, no network), PyTorch's CPU index (~200 MB), PyPI's torch, which on Linux x86_64
# is the CUDA build: ~0.5 GB of torch plus ~2.5 GB of CUDA 13 libraries (cuDNN, cuBLAS, NCCL, triton, ...).
install_torch() {
  # --no-index --no-deps: only the local folder can answer; its dependencies (sympy, ...) come from the indexes next
  if pip install -q --no-index --no-deps "torch==2.13.0" 2>/dev/null; then
    pip install -q "torch==2.13.0"
    echo "setup: torch from the local wheel folder"
  elif pip install -q --timeout 15 --retries 1 --index-url https://download.pytorch.org/whl/cpu torch 2>/dev/null; then
    echo "setup: torch from PyTorch's CPU index (download.pytorch.org/whl/cpu)"
  else
    echo "setup: no local torch wheel and no PyTorch CPU index: PyPI's torch (the CUDA build on Linux x86_64: ~3 GB download)" >&2
    pip install -q torch
  fi
}
.venv/bin/python -c "import torch" 2>/dev/null || install_torch
# gsm: reasoning-gym, for scripts/make_gsm_data.py and the test that it reproduces rlsys/envs/gsm/data (it builds
# pycosat from source: a C compiler)
pip install -q -e '.[test,gsm]'
.venv/bin/python -c "import rlsys, torch, transformers, ray; print(f'rlsys {rlsys.__version__}: torch {torch.__version__} ({\"CUDA \" + torch.version.cuda if torch.version.cuda else \"CPU\"} build), transformers {transformers.__version__}, ray {ray.__version__}')"
