"""Health check of ddpctx's CUDA path, run by scripts/gpu_check.sh under torchrun.

Checks, on every rank: NCCL is chosen, the device is pinned to cuda:<local_rank>,
a DDP step leaves identical gradients on every rank, and reductions of CUDA
tensors give the right numbers and stay on the GPU. With --allow-cpu it runs
the same checks on gloo/CPU (so CI can keep this script from rotting).

With --hang it checks the hang doctor instead: rank 1 sleeps outside any
collective while rank 0's NCCL all-reduce waits on the GPU (its host thread
blocks later, in ``.item()``); the report must name rank 1 within a few
seconds, long before NCCL's own watchdog, and ``on_hang="raise"`` must end the
job (so it exits non-zero by design).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from ddpctx import distributed, reduce_tensor


def check(condition: bool, what: str, rank: int) -> None:
    print(f"[rank {rank}] {'ok  ' if condition else 'FAIL'} {what}", flush=True)
    if not condition:
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--allow-cpu", action="store_true")
    parser.add_argument("--hang", action="store_true", help="check the hang doctor")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        sys.exit("no CUDA device visible; run on a GPU machine (or pass --allow-cpu)")
    if args.hang:
        hang()
        return

    with distributed(seed=0) as ctx:
        on_gpu = ctx.device.type == "cuda"
        rank = ctx.rank
        if on_gpu:
            check(ctx.backend == "nccl", f"backend is nccl (got {ctx.backend})", rank)
            check(ctx.device == torch.device("cuda", ctx.local_rank), f"device {ctx.device}", rank)
            check(torch.cuda.current_device() == ctx.local_rank, "current device pinned", rank)
        model = ctx.wrap(nn.Linear(8, 1))
        inputs = torch.full((4, 8), float(rank + 1), device=ctx.device)
        model(inputs).sum().backward()
        grad = ctx.unwrap(model).weight.grad
        assert grad is not None
        gathered = [torch.zeros_like(grad) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, grad)
        check(all(torch.equal(g, gathered[0]) for g in gathered), "DDP grads agree", rank)
        value = torch.tensor([float(rank + 1)], device=ctx.device)
        mean = reduce_tensor(value)
        expected = (ctx.world_size + 1) / 2
        check(mean.item() == expected, f"reduce_tensor mean {mean.item()} == {expected}", rank)
        check(mean.device == ctx.device, f"result stays on {ctx.device}", rank)
        check(value.item() == rank + 1, "input not mutated", rank)
        data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
        loader = ctx.dataloader(data, batch_size=8, shuffle=True)
        x, y = next(iter(loader))
        check(x.device == ctx.device and y.device == ctx.device, "batches on the device", rank)
        check(loader.pin_memory == on_gpu, "pin_memory only with CUDA", rank)
        accumulation = ctx.accumulate(model, every=2, loader=loader)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in ctx.epochs(1):
            for x, y in loader:
                with accumulation as sync:
                    (nn.functional.mse_loss(model(x), y) / 2).backward()
                if sync:
                    optimizer.step()
                    optimizer.zero_grad()
        weights = ctx.unwrap(model).weight.detach()
        everyone = [torch.zeros_like(weights) for _ in range(ctx.world_size)]
        dist.all_gather(everyone, weights)
        check(all(torch.equal(w, everyone[0]) for w in everyone), "accumulated steps agree", rank)
        ctx.barrier()
        ctx.print(f"gpu_check passed on {ctx.world_size} rank(s), backend={ctx.backend}")


def hang() -> None:
    """Rank 1 sleeps; rank 0 waits in an all-reduce. Ends with HangError on every rank."""
    with distributed(hang_timeout=3, on_hang="raise", timeout=120) as ctx:
        ctx.barrier()
        if ctx.rank == 1:
            time.sleep(60)  # outside any collective: the report must say so
        value = torch.ones(1, device=ctx.device)
        dist.all_reduce(value)
        print(f"[rank {ctx.rank}] all_reduce returned {value.item()}: not expected", flush=True)


if __name__ == "__main__":
    main()
