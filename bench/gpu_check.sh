#!/usr/bin/env bash
# The one-call GPU check. On a machine with an NVIDIA GPU and nothing installed (Python 3.11+
# and redis-server aside): makes .venv-gpu with CUDA torch and vLLM from the registries and
# this project, runs the `gpu`-marked tests, then bench/system_check.py: a 60-step run of
# the whole system on a small locally built model, the learner on the GPU in bfloat16
# (under torchrun) and one vLLM actor on the same GPU (--gpu-memory-utilization 0.3), and
# the scaling benchmark (1 process; 2 when there are 2 GPUs). It prints learner tokens/s,
# peak memory, the learner's wait fraction, announce -> loaded latency and the mean
# |Δ log-prob| between vLLM's sampled log-probabilities and the learner's (bf16 vs bf16).
# Aims at under 8 minutes on an H100/H200 once the wheels are cached.
#
#   bash bench/gpu_check.sh          # on the GPU machine
#   bash bench/gpu_check.sh --cpu    # here: the same run on the CPU in .venv (no install,
#                                    # learner float32, transformers actor), so none of it is dead code
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
if [ "${1:-}" = "--cpu" ]; then
  PY=${PYTHON:-.venv/bin/python}
  "$PY" -m pytest -q -m gpu tests/test_distributed.py -p no:cacheprovider   # they skip here, and say so
  "$PY" bench/system_check.py --device cpu --dtype float32 --engine transformers --steps "${STEPS:-30}"
  echo "gpu_check --cpu: $(( $(date +%s) - started ))s"
  exit 0
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
VENV=${VENV:-.venv-gpu}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # vLLM pins the CUDA torch it was built with: installing it first brings the matching one
  "$VENV/bin/python" -m pip install -q vllm
  "$VENV/bin/python" -m pip install -q -e '.[dev]'
fi
PY=$VENV/bin/python
"$PY" -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__, torch.cuda.get_device_name())"
echo "== gpu-marked tests ($(( $(date +%s) - started ))s)"
"$PY" -m pytest -q -m gpu -p no:cacheprovider
echo "== 60 steps: learner on the GPU (bf16) + one vLLM actor sharing it ($(( $(date +%s) - started ))s)"
"$PY" bench/system_check.py --device cuda --dtype bfloat16 --engine vllm --steps 60 --gpu-memory-utilization 0.3
echo "== learner scaling ($(( $(date +%s) - started ))s)"
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
WORLDS="1"; [ "$GPUS" -ge 2 ] && WORLDS="1 2"
"$PY" bench/learner.py --scaling --device cuda --dtype bfloat16 --worlds $WORLDS --groups 16 --group-size 8 \
    --prompt-len 256 --completion-len 256 --steps 5
echo "== one vLLM engine serving 2 and 4 runs, against one engine each ($(( $(date +%s) - started ))s)"
"$PY" bench/multirun.py --engine vllm --runs 2,4 --seconds 20
echo "gpu_check: $(( $(date +%s) - started ))s"
