#!/usr/bin/env bash
# Check ddpctx's NCCL/CUDA path on a machine with GPUs: NCCL init, device
# pinning, a DDP step, and reductions of CUDA tensors, on every visible GPU.
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

# Every python example in README.md and docs/ must be right on a GPU as written
# (batches arrive on the device): run each as a plain script there.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 900 \
  python -m pytest -q -p no:cacheprovider tests/test_docs.py -k example_runs

# Then the benchmark suite on NCCL, one rank per GPU (at least 2 GPUs needed).
if [ "$gpus" -ge 2 ]; then
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 600 \
    python benchmarks/run.py --quick --world-size "$gpus"
fi
