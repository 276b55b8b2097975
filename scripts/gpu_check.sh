#!/usr/bin/env bash
# Check ddpctx's NCCL/CUDA path on a machine with GPUs: NCCL init, device
# pinning, a DDP step, reductions of CUDA tensors, and FSDP2 + bf16, on every visible GPU.
# Usage: bash scripts/gpu_check.sh   (from a checkout, with ddpctx importable)
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=index,name,memory.total --format=csv || true
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 1 ]; then echo "no GPU visible" >&2; exit 1; fi
# One rank per GPU, and at least two ranks so a real collective happens
# (two ranks on one GPU are not allowed by NCCL, so a 1-GPU box runs one rank).
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 300 \
  python -m torch.distributed.run --standalone --nproc_per_node="$gpus" scripts/gpu_check.py

# Sharded training on NCCL: ctx.shard (FSDP2) + precision="bf16-mixed", clipping, a DCP checkpoint.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 300 \
  python -m torch.distributed.run --standalone --nproc_per_node="$gpus" scripts/gpu_check.py --shard

# The hang doctor on NCCL: rank 1 sleeps while rank 0's all-reduce waits on the GPU. The
# job must fail (on_hang="raise") with a report that names rank 1, well before NCCL's timeout.
if [ "$gpus" -ge 2 ]; then
  if hang_output=$(PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 120 \
      python -m torch.distributed.run --standalone --nproc_per_node=2 scripts/gpu_check.py --hang 2>&1); then
    echo "$hang_output" >&2; echo "hang case: the job should have ended with HangError" >&2; exit 1
  fi
  if ! grep -q "rank 1: not in a collective" <<<"$hang_output" \
      || ! grep -q "HangError: ddpctx hang report:" <<<"$hang_output"; then
    echo "$hang_output" >&2; echo "hang case: no hang report naming rank 1" >&2; exit 1
  fi
  grep -A4 "^ddpctx hang report:" <<<"$hang_output" | head -5
  echo "hang case ok"
fi

# Every python example in README.md and docs/ must be right on a GPU as written
# (batches arrive on the device): run each as a plain script there.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 900 \
  python -m pytest -q -p no:cacheprovider tests/test_docs.py -k example_runs

# Then the benchmark suite on NCCL, one rank per GPU (at least 2 GPUs needed).
if [ "$gpus" -ge 2 ]; then
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 600 \
    python benchmarks/run.py --quick --world-size "$gpus"
fi
