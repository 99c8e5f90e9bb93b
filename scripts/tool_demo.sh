#!/usr/bin/env bash
# Tool-use demo from a warm start (configs/agent_tool_words_cpu.yaml): write 32 correct calculator
# transcripts of word problems, fine-tune SmolLM2-135M-Instruct on them (areal-async sft, 4 steps),
# then train the tool_use workflow with RL from the fine-tuned model.
# Extra arguments go to the RL run (e.g. --set trainer.total_steps=12).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
CONFIG=configs/agent_tool_words_cpu.yaml
RUN_DIR=runs/agent-tool-words-cpu
areal-async prepare-model smollm2
python -m areal_async.data.tool_transcripts --config "$CONFIG" --out "$RUN_DIR/tool_transcripts.jsonl" \
    --count 32 --seed 1
areal-async sft "$CONFIG" --set trainer.optimizer.lr=1.0e-4
exec areal-async run "$CONFIG" --set model.path="$RUN_DIR/sft/model" "$@"
