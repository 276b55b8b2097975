"""Sharded training (``ctx.shard``, FSDP2) measured: memory per rank, step time, checkpoint save.

Run:  python benchmarks/bench_shard.py [--rounds R] [--world-sizes 2 3]

Prints markdown rows for BENCHMARKS.md. Each world size runs in its own
``ddpctx.launch`` job (gloo, CPU):

- bytes per rank of parameters + AdamW state after one step, ``ctx.shard`` vs
  ``ctx.wrap`` (DDP keeps a whole copy on every rank; expect about 1/N);
- median time per training step, ``ctx.shard`` vs raw ``fully_shard`` (the
  same blocks, on ``init_device_mesh``), interleaved round by round, with the
  median of the per-round ratios (paired, so drift of the machine cancels);
- median time of one ``ctx.save_checkpoint`` vs one raw ``dcp.save`` of
  ``get_state_dict(model, optimizer)``, interleaved the same way.

Both contenders run in the same processes, inside ``distributed()`` with its
defaults (the hang doctor on), so the ratios are ddpctx's own cost.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a file: the repository, not benchmarks/, heads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from benchmarks.stats import paired_ratio
from benchmarks.workload import active
from ddpctx import launch

WIDTH, BLOCKS, BATCH = 512, 6, 64


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)]
    )


def local_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    def size(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return int(local.numel() * local.element_size())

    total = sum(size(p) for p in module.parameters())
    for state in optimizer.state.values():
        total += sum(size(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def step(module: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    module(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def bench_rank(rounds: int, steps: int) -> dict[str, Any]:
    ctx = active()
    x = torch.randn(BATCH, WIDTH)
    sharded = ctx.shard(model(), blocks=[nn.Linear])
    raw = model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in raw.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(raw, mesh=mesh)
    ddp = ctx.wrap(model())
    optimizers = {
        name: torch.optim.AdamW(m.parameters(), lr=1e-4)
        for name, m in (("shard", sharded), ("raw", raw), ("wrap", ddp))
    }
    for name, m in (("shard", sharded), ("raw", raw), ("wrap", ddp)):
        step(m, optimizers[name], x)  # warm-up; creates the optimizer state
    memory = {
        name: local_bytes(m, optimizers[name]) for name, m in (("shard", sharded), ("wrap", ddp))
    }
    times: dict[str, list[float]] = {"shard": [], "raw": [], "save": [], "dcp": []}
    root = Path(ctx.broadcast(tempfile.mkdtemp(prefix="bench-shard-") if ctx.rank == 0 else ""))
    for round_index in range(rounds):
        for name, m in (("shard", sharded), ("raw", raw)):
            ctx.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step(m, optimizers[name], x)
            times[name].append((time.perf_counter() - start) / steps)
        ctx.barrier()
        start = time.perf_counter()
        ctx.save_checkpoint(root / "ddpctx", model=sharded, optimizer=optimizers["shard"], keep=1)
        times["save"].append(time.perf_counter() - start)
        ctx.barrier()
        start = time.perf_counter()
        state = dict(
            zip(("model", "optimizer"), get_state_dict(raw, [optimizers["raw"]]), strict=True)
        )
        dcp.save(state, checkpoint_id=root / f"raw-{round_index}")
        times["dcp"].append(time.perf_counter() - start)
    ctx.barrier()
    if ctx.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"memory": memory, "times": times}


def paired(times: dict[str, list[float]], mine: str, floor: str) -> tuple[float, float, float]:
    """The medians of ``mine`` and ``floor``, and the median of their per-round ratios."""
    return (
        statistics.median(times[mine]),
        statistics.median(times[floor]),
        paired_ratio(times[mine], times[floor]),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    params = sum(p.numel() for p in model().parameters())
    print(f"model: {BLOCKS} x Linear({WIDTH}, {WIDTH}), {params / 1e6:.2f}M parameters, AdamW")
    memory_rows, step_rows, save_rows = [], [], []
    for world_size in args.world_sizes:
        result = launch(bench_rank, args.rounds, args.steps, world_size=world_size, timeout=600)
        worst = max(r["memory"]["shard"] for r in result)
        wrap = result[0]["memory"]["wrap"]
        memory_rows.append(
            f"| {world_size} | {wrap / 2**20:.2f} MiB | {worst / 2**20:.2f} MiB | "
            f"{worst / wrap:.3f} (1/N = {1 / world_size:.3f}) |"
        )
        shard, raw, ratio = paired(result[0]["times"], "shard", "raw")
        step_rows.append(
            f"| {world_size} | {raw * 1e3:.2f} ms | {shard * 1e3:.2f} ms | {ratio:.3f}x |"
        )
        save, floor, ratio = paired(result[0]["times"], "save", "dcp")
        save_rows.append(
            f"| {world_size} | {floor * 1e3:.1f} ms | {save * 1e3:.1f} ms | {ratio:.3f}x |"
        )
    print(
        "\n| ranks | ctx.wrap (DDP) | ctx.shard (largest rank) | shard / wrap |"
        "\n|---|---:|---:|---:|"
    )
    print("\n".join(memory_rows))
    print(
        "\n| ranks | raw fully_shard | ctx.shard | ctx.shard / raw (paired) |\n|---|---:|---:|---:|"
    )
    print("\n".join(step_rows))
    print("\n| ranks | raw dcp.save | ctx.save_checkpoint | ratio (paired) |\n|---|---:|---:|---:|")
    print("\n".join(save_rows))


if __name__ == "__main__":
    main()
