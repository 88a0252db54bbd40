#!/usr/bin/env bash
# Creates .venv (once) and installs moescale into it, editable, with the test extras.
# Without an NVIDIA GPU it installs the CPU build of torch (pinned: a bare `pip install torch`
# pulls a multi-GB CUDA build); with one, the normal CUDA build. Override with TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    spec=${TORCH_SPEC:-"torch>=2.4"}
  else
    spec=${TORCH_SPEC:-"torch==2.13.0"}
  fi
  "$VPY" -m pip install -q "$spec"
fi
if ! "$VPY" -c "import moescale, pytest, pytest_timeout, xdist, transformers, tokenizers, datasets" \
    >/dev/null 2>&1 \
    || [ pyproject.toml -nt .venv/.moescale-installed ]; then
  "$VPY" -m pip install -q -e ".[dev]"
  touch .venv/.moescale-installed
fi
