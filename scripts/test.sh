#!/usr/bin/env bash
# Set up and run the whole test suite (unit, integration with a real nats-server, learning tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
bash scripts/check
