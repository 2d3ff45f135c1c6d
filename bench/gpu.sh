#!/usr/bin/env bash
# The single-GPU benchmark: one script, under 8 minutes, every result in one JSON file, no network needed
# (random-weight models built from configs, an offline tokenizer). What is missing is printed as SKIPPED.
#
#   bash bench/gpu.sh [OUT.json] [--peak-tflops 989]          # default OUT: bench/results/gpu.json
#   bash bench/gpu.sh OUT.json --device cpu --tiny --no-vllm  # the CPU smoke run of the same code paths
#
# Parts (each its own process, with a time limit, so one failure or hang cannot take the others down):
#   bench/gpu_train.py    training-step MFU of a Qwen3-1.7B-shaped model (bf16 compute, sequence 2,048,
#                         FSDP2 over one rank, flash-attn when importable else sdpa) and the memory of a
#                         logprob pass (chunked vs naive at V = 151,936)
#   bench/gpu_rollout.py  transformers-engine rollout tokens/s; with vLLM installed, vLLM rollout tokens/s
#                         and the weight-sync time from the FSDP2 policy into vLLM
#   bench/gpu_rl.py       three RL steps of launch.train (bf16 compute, fp32 master weights, truncated IS) on a
#                         Qwen3-0.6B-shaped model: one process, then torchrun with one rank (NCCL), then with
#                         the vLLM engine where vLLM imports
# Environment: PYTHON (default: .venv/bin/python if present, else python3), TRAIN_LIMIT_S (130),
# ROLLOUT_LIMIT_S (150), RL_LIMIT_S (190): 7 min 50 s in all at most.
set -u
cd "$(dirname "$0")/.."

OUT=bench/results/gpu.json
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then OUT=$1; shift; fi
PEAK=989
DEVICE=cuda
TINY=()
NO_VLLM=()
while [ $# -gt 0 ]; do
  case "$1" in
    --peak-tflops) PEAK=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --tiny) TINY=(--tiny); shift ;;
    --no-vllm) NO_VLLM=(--no-vllm); shift ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
if [ "$DEVICE" = cpu ]; then
  # CPU peaks are resident-memory peaks: a fixed mmap threshold makes freed tensors leave the resident set
  # at once (glibc otherwise raises the threshold and keeps them), so one pass's peak does not hide inside
  # memory an earlier pass left behind (measured: chunked/naive ratio 0.0-0.71 without, 0.20 in 3 of 3 with).
  export MALLOC_MMAP_THRESHOLD_=65536
fi
PARTS=$(mktemp -d)
trap 'rm -rf "$PARTS"' EXIT
STARTED=$(date +%s)

if [ "$DEVICE" = cuda ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "SKIPPED everything: no CUDA device visible to $PYTHON (use --device cpu --tiny for a CPU smoke run)"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true

run_part() {  # name limit_seconds args...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s)"
  # The part's whole process tree ends at the limit (torchrun's workers live in sessions of their own).
  "$PYTHON" -m bench.gpu_common run "$limit" -- "$PYTHON" -m "bench.gpu_$name" --out "$PARTS/$name.json" \
    --device "$DEVICE" ${TINY[@]+"${TINY[@]}"} "$@"
  local status=$?
  if [ $status -eq 124 ]; then
    echo "FAILED $name: stopped after ${limit} s; the JSON keeps what it measured before"
  elif [ $status -ne 0 ]; then
    echo "FAILED $name: exit status $status (see above); the JSON keeps what it measured"
  fi
}

RL_LIMIT=${RL_LIMIT_S:-190}
run_part train "${TRAIN_LIMIT_S:-130}" --peak-tflops "$PEAK"
run_part rollout "${ROLLOUT_LIMIT_S:-150}" ${NO_VLLM[@]+"${NO_VLLM[@]}"}
run_part rl "$RL_LIMIT" --limit-s $(( RL_LIMIT - 15 )) ${NO_VLLM[@]+"${NO_VLLM[@]}"}
"$PYTHON" -m bench.gpu_common merge "$PARTS/train.json" "$PARTS/rollout.json" "$PARTS/rl.json" --out "$OUT"
echo "total $(( $(date +%s) - STARTED )) s"
