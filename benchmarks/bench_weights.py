"""Checkpoints beyond the run: what load_weights and keep's verification cost.

Run:  python benchmarks/bench_weights.py [--mib 256] [--rounds 3]

Prints markdown rows for BENCHMARKS.md. A model of 16 ``Linear`` layers
holding ``--mib`` MiB of float32 weights, one AdamW step (so a ``.pt`` holds
the weights and two moments, 3x), saved:

- as a DDP ``.pt`` at world size 1, and as a sharded ``.dcp`` by 2 local
  ranks (``ddpctx.launch``, gloo, CPU);
- ``load_weights`` of each, in a fresh plain process: its wall time and its
  peak RSS above the process's RSS before the call (``VmHWM - VmRSS``), as a
  multiple of the weights' size (every tensor is summed, so each byte of a
  memory-mapped ``.pt`` is read);
- a ``save_checkpoint(keep=2)`` of the ``.pt`` (median of ``--rounds``) beside
  the time pruning now spends verifying the previous checkpoint
  (:func:`ddpctx.checkpoint.files.loads`: CRC-32 of the file, then a
  memory-mapped ``torch.load``), which ``keep=2`` does once per save.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from ddpctx import current, distributed, launch
from ddpctx.checkpoint.files import checkpoint_paths, loads

LAYERS = 16

PEAK = """
import json, re, sys, time
import torch
import torch.distributed.checkpoint.state_dict_loader
from ddpctx import load_weights

def kib(field):
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))

before = kib("VmRSS")
began = time.perf_counter()
weights = load_weights(sys.argv[1])
touched = sum(float(t.sum()) for t in weights.values())
seconds = time.perf_counter() - began
size = sum(t.numel() * t.element_size() for t in weights.values())
print(json.dumps({"seconds": seconds, "peak": (kib("VmHWM") - before) * 1024, "weights": size}))
"""


def model_of(mib: int) -> nn.Module:
    width = int((mib * 2**20 / 4 / LAYERS) ** 0.5)
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(LAYERS)))


def trained(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters())
    width = next(model.parameters()).shape[1]
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return optimizer


def save_sharded(folder: str, mib: int) -> None:
    ctx = current()
    assert ctx is not None
    torch.manual_seed(0)
    model = ctx.shard(model_of(mib), blocks=[nn.Linear])
    ctx.save_checkpoint(folder, model=model, optimizer=trained(model))


def peak(folder: Path) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, "-c", PEAK, str(folder)], capture_output=True, text=True, check=True
    )
    measured: dict[str, float] = json.loads(result.stdout.splitlines()[-1])
    return measured


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        files, shards = Path(root) / "ddp", Path(root) / "sharded"
        saves, verifications = [], []
        with distributed(seed=0) as ctx:
            model = ctx.wrap(model_of(args.mib))
            optimizer = trained(model)
            for _ in range(args.rounds + 1):
                began = time.perf_counter()
                ctx.save_checkpoint(files, model=model, optimizer=optimizer, keep=2)
                saves.append(time.perf_counter() - began)
                previous = checkpoint_paths(files)[1:2]
                if previous:
                    began = time.perf_counter()
                    assert loads(previous[0])
                    verifications.append(time.perf_counter() - began)
        launch(save_sharded, str(shards), args.mib, world_size=2, timeout=600)
        file_size = checkpoint_paths(files)[0].stat().st_size
        print(f"| `.pt` of {args.mib} MiB of weights ({file_size / 2**20:.0f} MiB file) |", end="")
        ddp = peak(files)
        print(f" {ddp['seconds']:.2f} s | {ddp['peak'] / ddp['weights']:.2f}x |")
        sharded = peak(shards)
        print(f"| `.dcp` of {args.mib} MiB of weights, 2 ranks |", end="")
        print(f" {sharded['seconds']:.2f} s | {sharded['peak'] / sharded['weights']:.2f}x |")
        print()
        print(f"| save_checkpoint(keep=2), median | {statistics.median(saves[1:]):.2f} s |")
        print(f"| verifying the previous checkpoint | {statistics.median(verifications):.2f} s |")


if __name__ == "__main__":
    main()
