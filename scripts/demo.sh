#!/usr/bin/env bash
# Set up and run the main job: the CPU learning demo (SmolLM2-135M learns 2-digit addition).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
areal-async prepare-model smollm2
exec areal-async run "${1:-configs/arith_cpu.yaml}" "${@:2}"
