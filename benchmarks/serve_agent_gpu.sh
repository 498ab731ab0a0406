#!/usr/bin/env bash
# The agent workload on vLLM's CUDA build, at the paper's 8k-token policy, with the arms of the CPU
# run (docs/serving.md): run it on a machine with a GPU, vLLM and the model's weights on disk.
#
#   benchmarks/serve_agent_gpu.sh MODEL_DIR [OUT]
#
# MODEL_DIR: a Hugging Face folder of qwen2.5-1.5b (on this project's machines: the folder
# `kvprobe models fetch qwen2.5-1.5b` writes under $KVPROBE_HOME/models; a GPU machine without a
# network needs it copied there). The policy arm uses examples/policies/qwen2.5-1.5b-refund-clear.yaml,
# calibrated on the CPU for the same weights; kvprobe checks only a bundled alias's name against it,
# so with a folder the caller vouches that the folder holds those weights.
#
# It starts `vllm serve` on 127.0.0.1 (prefix caching on, cached-token counts on, block size 32 as on
# the CPU), runs one moderate rate and saturation, prints the table, and stops the server. Exit 3
# when vLLM or CUDA is missing (nothing is installed: the machine may have no network).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_DIR=${1:?usage: benchmarks/serve_agent_gpu.sh MODEL_DIR [OUT]}
OUT=${2:-results/agent-gpu-8k}
PY=${PYTHON:-python3}
PORT=${PORT:-8765}

$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" \
  || { echo "error: no CUDA device visible to torch; this script is for a GPU machine" >&2; exit 3; }
$PY -c "import vllm" 2>/dev/null \
  || { echo "error: vLLM is not installed here (pip install vllm, then rerun); nothing was started" >&2; exit 3; }
[ -f "$MODEL_DIR/config.json" ] || { echo "error: $MODEL_DIR has no config.json; give a Hugging Face folder" >&2; exit 2; }

LOG=$(mktemp /tmp/vllm-gpu-XXXX.log)
$PY -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" --served-model-name qwen2.5-1.5b \
  --host 127.0.0.1 --port "$PORT" --enable-prefix-caching --enable-prompt-tokens-details --block-size 32 \
  --max-model-len 16384 >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "error: vLLM exited during start-up; log $LOG: $(tail -3 "$LOG")" >&2; exit 4; }
  sleep 1
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
${KVPROBE:-kvprobe} serve-bench --workload agent --model "$MODEL_DIR" --url "http://127.0.0.1:$PORT" \
  --spec examples/calibrate-refund-clear.yaml --field-policy examples/policies/qwen2.5-1.5b-refund-clear.yaml \
  --policy-tokens 8000 --rates 2,inf --sessions 32 --turns 6 --out "$OUT"
