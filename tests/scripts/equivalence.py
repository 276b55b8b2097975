"""One small training script, run every way ddpctx lets it run: the equivalence matrix's job.

usage: equivalence.py OUT --cells MODE:PRECISION[:stream][,...] [--workers N] [--kill-after STEP]
                      [--async-save] [--metrics] [--shapes SHAPE[,...]] [--reference]

Each cell trains the same MLP on the same data (96 fixed samples, a global
batch of 12 split over the ranks, 3 epochs, SGD with momentum) inside its own
``distributed(seed=SEED, precision=PRECISION)`` block, with ``ctx.wrap``
(MODE ``wrap``) or ``ctx.shard`` (MODE ``shard``), or ``ctx.shard`` with tensor parallel over 2
ranks (MODE ``tp``: the first layer split by columns, the second by rows,
FSDP2 over the other ranks, each tensor-parallel pair reading one batch),
saving a checkpoint every
``SAVE_EVERY`` steps into ``OUT/<cell>/checkpoints`` and resuming from the
newest one on entry. With ``--kill-after`` the last rank SIGKILLs itself
right after that global step on the first attempt (run it under
``torchrun --max-restarts=1``). Rank 0 writes ``OUT/<cell>/result.pt``: the
whole model's weights right after wrapping/sharding (``start``) and at the
end (``final``), as ``ctx.full_state_dict`` gives them, the restart count and
the step it resumed from. A last checkpoint holds the final weights. ``--metrics`` also
calls ``ctx.log`` every step (the loss and the step timings, to
``OUT/<cell>/log/metrics.jsonl``), which must change nothing.

``--shapes`` writes the loop the way real scripts do (nanoGPT, Kronos), each
shape alone or several together; every one but ``accum`` trains the very
same model as the guides' idiom:

- ``raw``: the bare module (``raw_model = ctx.unwrap(model)``) goes to
  ``save_checkpoint`` and ``load_checkpoint``;
- ``logsavelog``: ``ctx.log`` every step, and at a checkpoint step an eval
  metric logged before the save and the train metric after it, at the same
  step (loggers jsonl, csv and tensorboard);
- ``ownbatch``: no ``ctx.dataloader``: the script's own batch function deals
  each rank its share of the epoch's order, as a DistributedSampler would, and
  finds its place after a resume from the checkpoint's step;
- ``accum``: gradient accumulation over 2 micro-batches under ``ctx.no_sync``,
  with ``ctx.log`` at every micro-step (another model: compare it with the
  same shape uninterrupted);
- ``config``: ``ctx.log_config`` right after ``load_checkpoint``, as the guide
  orders them;
- ``compile``: the model compiled by ``ctx.wrap``/``ctx.shard`` (``compile=``,
  AOTAutograd without inductor's code generation, which computes bit for bit
  what eager mode does), as nanoGPT compiles its model;
- ``rankzero``: at a checkpoint step, a ``@rank_zero_only`` function runs the
  bare module forward for a sample, as nanoGPT samples on its master process
  (the wrapped model's forward there is refused; the bare one runs no
  collective and must change nothing).

``--reference`` instead trains the same model in one plain process without
ddpctx or torch.distributed, in float64, reading each step's global batch
the way a DistributedSampler seeded with the base seed deals it out, and
writes ``OUT/reference.pt``.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

SEED = 11
SAMPLES = 96
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks: every world size reads the same batches
EPOCHS = 3
SAVE_EVERY = 5
LEARNING_RATE = 0.05
TP_SIZE = 2  # MODE tp: 2 ranks split each planned layer


def make_model() -> nn.Module:
    """Built after seeding: rank r's weights come from seed + r, rank 0's from SEED."""
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def make_data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(SAMPLES, 8, generator=generator)
    targets = torch.sin(inputs.sum(dim=1, keepdim=True)) + 0.1 * inputs[:, :1]
    return TensorDataset(inputs, targets)


class EpochStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """The samples of :func:`make_data`, streamed in the epoch's order (the reference's)."""

    def __init__(self) -> None:
        self.data = make_data()
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + self.epoch))
        for index in order.tolist():
            yield self.data[index]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9)


def reference(out: Path) -> None:
    """The float64 single-process run every cell is compared with."""
    torch.manual_seed(SEED)
    model = make_model()
    start = {name: value.detach().clone() for name, value in model.state_dict().items()}
    model = model.double()
    optimizer = make_optimizer(model)
    inputs, targets = make_data().tensors
    inputs, targets = inputs.double(), targets.double()
    for epoch in range(EPOCHS):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
        for first in range(0, SAMPLES, GLOBAL_BATCH):
            batch = order[first : first + GLOBAL_BATCH]
            loss = nn.functional.mse_loss(model(inputs[batch]), targets[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    final = {name: value.detach().clone() for name, value in model.state_dict().items()}
    torch.save({"start": start, "final": final}, out / "reference.pt")


STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH
SHAPES = ("raw", "logsavelog", "ownbatch", "accum", "config", "compile", "rankzero")
LOGGED_SHAPES = {"logsavelog", "accum", "config"}  # shapes that need the loggers


def own_batches(
    epoch: int, rank: int, world_size: int, skip: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches of ``epoch`` from the ``skip``-th on, dealt as a DistributedSampler."""
    inputs, targets = make_data().tensors
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(SEED + epoch))
    mine = order[rank::world_size]
    size = GLOBAL_BATCH // world_size
    for first in range(skip * size, len(mine), size):
        batch = mine[first : first + size]
        yield inputs[batch].to(device), targets[batch].to(device)


def sample_from(bare: nn.Module, inputs: torch.Tensor) -> None:
    """What scripts do at a checkpoint step: a sample from the bare module (on rank 0 alone)."""
    with torch.no_grad():
        print(f"sample: {float(bare(inputs).sum()):.4f}")


def train_cell(
    out: Path,
    cell: str,
    workers: int,
    kill_after: int | None,
    async_save: bool,
    log: bool = False,
    shapes: frozenset[str] = frozenset(),
) -> None:
    from ddpctx import distributed, rank_zero_only

    sample_on_rank_zero = rank_zero_only(sample_from)
    mode, precision, *data = cell.split(":")
    stream = data == ["stream"]
    folder = out / cell.replace(":", "-")
    log = log or bool(shapes & LOGGED_SHAPES)
    log_dir = folder / "log" if log else None
    loggers = ("jsonl", "csv", "tensorboard") if shapes & LOGGED_SHAPES else None
    with distributed(seed=SEED, precision=precision, log_dir=log_dir, loggers=loggers) as ctx:
        model = make_model()
        compile = {"backend": "aot_eager"} if "compile" in shapes else False
        tp_size = TP_SIZE if mode == "tp" else None
        if mode == "wrap":
            model = ctx.wrap(model, compile=compile)
        elif mode == "tp":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

            plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
            model = ctx.shard(model, blocks=[nn.Linear], tp_plan=plan, tp_size=TP_SIZE)
        else:
            model = ctx.shard(model, blocks=[nn.Linear], compile=compile)
        data_ranks = ctx.world_size // (tp_size or 1)
        start = ctx.full_state_dict(model)
        optimizer = make_optimizer(model)
        if stream:
            loader = ctx.dataloader(
                EpochStream(), batch_size=GLOBAL_BATCH // data_ranks, num_workers=workers
            )
        else:
            loader = ctx.dataloader(
                make_data(),
                batch_size=GLOBAL_BATCH // data_ranks,
                shuffle=True,
                num_workers=workers,
                persistent_workers=workers > 0,
                tp_size=tp_size,
            )
        saved = ctx.unwrap(model) if "raw" in shapes else model
        meta = ctx.load_checkpoint(folder / "checkpoints", model=saved, optimizer=optimizer)
        if "config" in shapes:
            ctx.log_config({"cell": cell, "lr": LEARNING_RATE, "shapes": sorted(shapes)})
        start_epoch, step = (meta["epoch"], meta["step"]) if meta else (0, 0)
        resumed_step = step
        for epoch in ctx.epochs(EPOCHS, start=start_epoch):
            if "ownbatch" in shapes:
                skip = step - epoch * STEPS_PER_EPOCH if epoch == start_epoch else 0
                batches = own_batches(epoch, ctx.rank, ctx.world_size, skip, ctx.device)
            else:
                batches = iter(loader)
            for inputs, targets in batches:
                optimizer.zero_grad()
                if "accum" in shapes:
                    halves = list(zip(inputs.chunk(2), targets.chunk(2), strict=True))
                    for micro, (part, part_targets) in enumerate(halves):
                        with ctx.no_sync(model, enabled=micro < len(halves) - 1):
                            loss = nn.functional.mse_loss(model(part), part_targets)
                            (loss / len(halves)).backward()
                        ctx.log({f"loss/micro{micro}": loss.detach()}, step=step + 1)
                else:
                    loss = nn.functional.mse_loss(model(inputs), targets)
                    loss.backward()
                optimizer.step()
                step += 1
                checkpoint_step = step % SAVE_EVERY == 0
                if log and "logsavelog" not in shapes:  # log, then save
                    ctx.log({"loss": loss.detach()}, step=step, timings=True)
                elif "logsavelog" in shapes and checkpoint_step:  # log, save, log again
                    ctx.log({"eval/loss": loss.detach() * 2}, step=step)
                if checkpoint_step and "rankzero" in shapes:
                    sample_on_rank_zero(ctx.unwrap(model), inputs[:2])
                if checkpoint_step:
                    ctx.save_checkpoint(
                        folder / "checkpoints",
                        model=saved,
                        optimizer=optimizer,
                        async_save=async_save,
                        epoch=epoch,
                        step=step,
                    )
                if "logsavelog" in shapes:
                    ctx.log({"loss": loss.detach()}, step=step, timings=True)
                last_rank = ctx.rank == ctx.world_size - 1
                if step == kill_after and ctx.restart_count == 0 and last_rank:
                    os.kill(os.getpid(), signal.SIGKILL)
        ctx.finish_checkpoint()
        final = ctx.full_state_dict(model)
        # the final weights as a checkpoint too: load_weights of it must give `final`
        ctx.save_checkpoint(
            folder / "checkpoints", model=saved, optimizer=optimizer, epoch=EPOCHS - 1, step=step
        )
        if ctx.is_main:
            record = {
                "start": start,
                "final": final,
                "restart_count": ctx.restart_count,
                "world_size": ctx.world_size,
                "steps": step,
                "resumed_step": resumed_step,
            }
            torch.save(record, folder / "result.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--cells", default="")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--metrics", action="store_true")
    parser.add_argument("--shapes", default="")
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    shapes = frozenset(filter(None, args.shapes.split(",")))
    unknown = shapes - set(SHAPES)
    if unknown:
        parser.error(f"unknown --shapes {sorted(unknown)}: choose from {', '.join(SHAPES)}")
    if args.reference:
        reference(args.out)
        return
    for cell in filter(None, args.cells.split(",")):
        train_cell(
            args.out, cell, args.workers, args.kill_after, args.async_save, args.metrics, shapes
        )


if __name__ == "__main__":
    main()
