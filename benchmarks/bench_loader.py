"""Per-batch CPU cost of iterating ``ctx.dataloader`` vs a plain DataLoader (issue 23).

Run:  python benchmarks/bench_loader.py [--epochs 40] [--samples 8192] [--batch 64]

One process, no workers, CPU tensors (so moving a batch is a no-op): the
loader ``ctx.dataloader`` builds (``make_dataloader``, world size 1, device
cpu) against ``DataLoader(dataset, batch_size, sampler=DistributedSampler(
dataset, num_replicas=1, rank=0, seed=0))``. Epochs alternate between the
two, so drift of a busy machine hits both alike; printed are the best and the
median microseconds per batch of each and the median of the per-round
differences (ddpctx minus torch).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddpctx.data.dataloader import make_dataloader


def per_batch_us(loader: DataLoader[object], epoch: int) -> float:
    loader.sampler.set_epoch(epoch)  # type: ignore[union-attr]
    count = 0
    began = time.perf_counter()
    for _ in loader:
        count += 1
    return (time.perf_counter() - began) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    dataset = TensorDataset(torch.randn(args.samples, 32), torch.randn(args.samples, 1))
    plain = DataLoader(
        dataset, batch_size=args.batch, sampler=DistributedSampler(dataset, 1, 0, seed=0)
    )
    ours = make_dataloader(
        dataset, args.batch, shuffle=True, pad=True, base_seed=0, rank=0, world_size=1,
        loader_kwargs={}, device=torch.device("cpu"),
    )  # fmt: skip
    torch_us: list[float] = []
    ddpctx_us: list[float] = []
    for epoch in range(args.epochs):
        torch_us.append(per_batch_us(plain, epoch))
        ddpctx_us.append(per_batch_us(ours, epoch))
    differences = [ours - theirs for ours, theirs in zip(ddpctx_us, torch_us, strict=True)]
    for label, values in (("torch", torch_us), ("ddpctx", ddpctx_us)):
        print(f"{label:7} best {min(values):6.1f} us  median {statistics.median(values):6.1f} us")
    print(f"ddpctx - torch: median {statistics.median(differences):+.1f} us per batch")


if __name__ == "__main__":
    main()
