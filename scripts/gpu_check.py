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

With --shard it checks sharded training instead: ``ctx.shard`` (FSDP2) under
``precision="bf16-mixed"`` on NCCL: parameters are float32 DTensor shards on
the rank's GPU, the Linear layers compute in bfloat16, the loss falls,
``ctx.clip_grad_norm_`` equals the norm of the full gradients, and a sharded
checkpoint (DCP) loads into a fresh sharded model with identical weights.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

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
    parser.add_argument("--shard", action="store_true", help="check ctx.shard + bf16-mixed")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        sys.exit("no CUDA device visible; run on a GPU machine (or pass --allow-cpu)")
    if args.hang:
        hang()
        return
    if args.shard:
        shard()
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


def sharded_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )


def shard() -> None:
    with distributed(seed=0, precision="bf16-mixed") as ctx:
        rank, on_gpu = ctx.rank, ctx.device.type == "cuda"
        if on_gpu:
            check(ctx.backend == "nccl", f"backend is nccl (got {ctx.backend})", rank)
        model = ctx.shard(sharded_model(), blocks=[nn.Linear])
        params = list(model.parameters())
        check(all(type(p).__name__ == "DTensor" for p in params), "parameters are DTensors", rank)
        check(all(p.device == ctx.device for p in params), f"shards on {ctx.device}", rank)
        check(all(p.dtype == torch.float32 for p in params), "weights stay float32", rank)
        seen: list[torch.dtype] = []
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(64, 16, generator=generator).to(ctx.device)
        y = x[:, :1].clone()
        losses, norms = [], []
        for _ in range(20):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            full = torch.cat([p.grad.full_tensor().flatten().double() for p in params])  # type: ignore[union-attr]
            norms.append((ctx.clip_grad_norm_(model, 1e9), float(full.norm())))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        check(set(seen) == {torch.bfloat16}, f"Linear outputs in bfloat16 (saw {set(seen)})", rank)
        check(
            losses[-1] < 0.5 * losses[0], f"loss falls ({losses[0]:.4f} -> {losses[-1]:.4f})", rank
        )
        check(
            all(abs(mine - full) <= 1e-4 * full for mine, full in norms),
            f"clip_grad_norm_ equals the full-gradient norm ({norms[-1][0]:.6f})",
            rank,
        )
        folder = Path(ctx.broadcast(tempfile.mkdtemp() if rank == 0 else ""))
        ctx.save_checkpoint(folder, model=model, optimizer=optimizer, epoch=0)
        fresh = ctx.shard(sharded_model(), blocks=[nn.Linear])
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        meta = ctx.load_checkpoint(folder, model=fresh, optimizer=fresh_optimizer)
        saved, loaded = ctx.full_state_dict(model), ctx.full_state_dict(fresh)
        check(meta == {"epoch": 0}, f"checkpoint meta {meta}", rank)
        same = saved.keys() == loaded.keys() and all(
            torch.equal(saved[k], loaded[k]) for k in saved
        )
        check(same, "sharded checkpoint reloads identical weights", rank)
        ctx.barrier()
        ctx.print(f"gpu_check --shard passed on {ctx.world_size} rank(s), backend={ctx.backend}")


if __name__ == "__main__":
    main()
