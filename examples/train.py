"""The smallest complete ddpctx training job: DDP, a sharded loader, a true mean loss.

Runs unchanged on any number of processes, with or without a GPU:

    torchrun --standalone --nproc_per_node=2 examples/train.py
    python examples/train.py

The data is generated from the seed (a noisy linear target through a tanh),
so the job needs no download and always learns the same thing.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddpctx import distributed, format_time, get_model_size, reduce_tensor


def make_dataset(seed: int, samples: int = 4096, features: int = 16) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, features, generator=generator)
    weights = torch.randn(features, 1, generator=generator)
    targets = torch.tanh(inputs @ weights) + 0.05 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(inputs, targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    started = time.monotonic()
    with distributed(seed=args.seed) as ctx:
        dataset = make_dataset(args.seed)
        # The sampler's seed is the base seed, the same on every rank, so the
        # shards are disjoint; the rank-offset seed only drives model init/dropout.
        sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
        loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
        model = ctx.wrap(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        ctx.print(
            f"training {get_model_size(model)} parameters on {ctx.world_size} rank(s), "
            f"backend={ctx.backend}, device={ctx.device}"
        )

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)  # a different shuffle every epoch
            loss_sum = torch.zeros((), device=ctx.device)
            count = torch.zeros((), device=ctx.device)
            for inputs, targets in loader:
                inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
                loss = nn.functional.mse_loss(model(inputs), targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                loss_sum += loss.detach() * len(inputs)
                count += len(inputs)
            # A mean over ranks must weigh each rank by its sample count.
            epoch_loss = reduce_tensor(loss_sum, op="sum") / reduce_tensor(count, op="sum")
            ctx.print(f"epoch {epoch}: train mse {epoch_loss.item():.4f}")
            ctx.barrier()

        ctx.print(
            f"done: final train mse {epoch_loss.item():.4f} after {args.epochs} epochs "
            f"in {format_time(time.monotonic() - started)}"
        )


if __name__ == "__main__":
    main()
