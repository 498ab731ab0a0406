#!/usr/bin/env bash
# The agent workload with the policy+edit arm on llama.cpp's CUDA build (docs/serving.md, "Edited in the
# engine's cache"): the four arms of the CPU run, every layer on the GPU, at the paper's 8k-token policy.
#
#   benchmarks/engine_agent_gpu.sh [OUT]
#
# Run it from kvprobe's own environment (.venv) on a machine with a GPU and CUDA's compiler (nvcc):
# it rebuilds llama-cpp-python==0.3.36 with CUDA into that environment (a few minutes; the CPU build is
# replaced), checks that the build offloads to the GPU, then runs serve-bench --engine llama.cpp with
# qwen2.5-1.5b's bundled GGUF and examples/policies/qwen2.5-1.5b-agent-refund.yaml. Exit 3 when there is
# no GPU or no nvcc (nothing is installed then). To go back to the CPU build afterwards:
#   CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" .venv/bin/pip install --force-reinstall --no-deps \
#     llama-cpp-python==0.3.36
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/agent-llamacpp-gpu-8k}
PY=${PYTHON:-.venv/bin/python}
KVPROBE=${KVPROBE:-.venv/bin/kvprobe}

command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 \
  || { echo "error: no GPU visible (nvidia-smi); this script is for a GPU machine" >&2; exit 3; }
command -v nvcc >/dev/null \
  || { echo "error: no nvcc (CUDA's compiler) on the PATH; llama-cpp-python's CUDA build needs it" >&2; exit 3; }
CMAKE_ARGS="-DGGML_CUDA=on -DLLAVA_BUILD=OFF" $PY -m pip install -q --force-reinstall --no-deps --no-cache-dir \
  llama-cpp-python==0.3.36
$PY -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 3)" \
  || { echo "error: the llama-cpp-python build does not offload to a GPU" >&2; exit 3; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
$KVPROBE serve-bench --workload agent --engine llama.cpp --model qwen2.5-1.5b \
  --spec examples/agent-refund.yaml --field-policy examples/policies/qwen2.5-1.5b-agent-refund.yaml \
  --policy-tokens 8000 --sessions 32 --turns 10 --rates 2,inf --gpu-layers -1 --out "$OUT"
