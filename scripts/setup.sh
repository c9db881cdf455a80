#!/usr/bin/env bash
# Set up a fresh machine for rlsys: a virtualenv in .venv with the CPU torch wheel and rlsys (+ test tools).
# Idempotent: a second run only checks what is there. GPU machines: see docs (pip install -e '.[gpu]').
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# The CPU wheel first (seconds from the machines' local wheel folder); PyPI's default torch is a multi-GB CUDA build.
# (pip's "Location ... is ignored" lines about the local index are harmless noise: filtered out.)
pip() { .venv/bin/pip "$@" --disable-pip-version-check 2> >(grep -v "is ignored" >&2); }
.venv/bin/python -c "import torch" 2>/dev/null || pip install -q "torch==2.13.0"
pip install -q -e '.[test]'
.venv/bin/python -c "import rlsys, torch, transformers, ray; print(f'rlsys {rlsys.__version__}: torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__}')"
