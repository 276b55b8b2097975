"""A small, honest version of a Kronos-style fine-tuning loop on ddpctx.

Next-step forecasting on generated OHLCV-like series: returns follow an AR(1)
process (phi=0.6) plus noise, so about a third of each next return is
predictable from the past and the rest is not; the "no change" forecast is
the baseline. Everything is generated from the seed -- no download.

    torchrun --standalone --nproc_per_node=2 examples/train_forecaster.py --epochs 4
    python examples/train_forecaster.py --epochs 4            # one process

    torchrun --standalone --nproc_per_node=2 examples/train_forecaster.py --accumulate 2 \
        --save-every 20                                   # accumulation, step checkpoints
    torchrun --standalone --nproc_per_node=2 examples/train_forecaster.py --shard \
        --precision bf16-mixed            # FSDP2: each rank holds half the weights

When ``--out`` already holds a checkpoint the run resumes from it -- mid-epoch
when the newest checkpoint is a step checkpoint -- which is also what lets
``torchrun --max-restarts=1`` recover from a killed rank and end with exactly
the weights of an uninterrupted run. A finished run is not trained again.
``<out>/summary.json`` holds the losses, the wall time and a sha256 of the
final weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ddpctx import DistContext, all_reduced, distributed, get_model_size, rank_zero_only

PHI = 0.6  # AR(1) coefficient of the returns
SIGMA = 0.01  # scale of the return shocks
FEATURES = 5  # open, high, low, close (as log returns against the previous close), volume


def make_series(seed: int, series: int, length: int) -> np.ndarray:
    """``[series, length, 5]`` features of OHLCV-like bars with AR(1) returns."""
    rng = np.random.default_rng(seed)
    shocks = rng.normal(0.0, SIGMA, size=(series, length))
    returns = np.zeros((series, length))
    for t in range(1, length):
        returns[:, t] = PHI * returns[:, t - 1] + shocks[:, t]
    gap = rng.normal(0.0, SIGMA / 4, size=(series, length))  # open vs previous close
    wick = np.abs(rng.normal(0.0, SIGMA / 2, size=(series, length, 2)))
    open_ = gap
    high = np.maximum(open_, returns) + wick[..., 0]
    low = np.minimum(open_, returns) - wick[..., 1]
    volume = rng.normal(0.0, 0.3, size=(series, length)) + 20 * np.abs(returns)
    return np.stack([open_, high, low, returns, volume], axis=-1) / SIGMA


def make_windows(bars: np.ndarray, window: int, start: int, stop: int) -> TensorDataset:
    """Inputs: ``window`` bars; target: the next bar's close return (scaled)."""
    inputs, targets = [], []
    for t in range(max(start, window), stop - 1):
        inputs.append(bars[:, t - window : t].reshape(bars.shape[0], -1))
        targets.append(bars[:, t, 3])
    x = torch.tensor(np.concatenate(inputs), dtype=torch.float32)
    y = torch.tensor(np.concatenate(targets), dtype=torch.float32).unsqueeze(1)
    return TensorDataset(x, y)


class Forecaster(nn.Module):
    def __init__(self, window: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(window * FEATURES, hidden),
            nn.GELU(),
            nn.Dropout(0.1),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def lockstep(ctx: DistContext, loader: Any) -> Any:
    """The loader's batches, then empty ones until every rank is done.

    A sharded model's forward is a collective (it gathers the weights), so
    every rank must run as many as the others, also when its shard of the
    validation set (``pad=False``) is shorter.
    """
    x, y = loader.dataset.tensors
    empty = (x.new_empty((0, *x.shape[1:])).to(ctx.device), y.new_empty((0, *y.shape[1:])))
    batches = iter(loader)
    while True:
        batch = next(batches, None)
        if not ctx.any(batch is not None):
            return
        yield batch if batch is not None else (empty[0], empty[1].to(ctx.device))


@all_reduced(weight="count")
def evaluate(ctx: DistContext, model: nn.Module, loader: Any, sharded: bool) -> dict[str, Any]:
    """Count-weighted mean squared error of the model and of the "no change" forecast."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    baseline_sum = torch.zeros((), dtype=torch.float64)
    count = 0
    with torch.no_grad():
        for inputs, targets in lockstep(ctx, loader) if sharded else loader:  # on ctx.device
            loss_sum += ((model(inputs) - targets) ** 2).sum().double().cpu()
            baseline_sum += (targets**2).sum().double().cpu()
            count += len(targets)
    model.train()
    denominator = max(count, 1)  # an empty shard contributes count 0, not a fake loss
    return {"loss": loss_sum / denominator, "baseline": baseline_sum / denominator, "count": count}


@rank_zero_only
def log(message: str) -> None:
    print(message, flush=True)


@rank_zero_only
def write_summary(path: Path, summary: dict[str, Any]) -> None:
    path.write_text(json.dumps(summary, indent=2) + "\n")


def weights_sha256(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name, tensor in state.items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def refusal(meta: dict[str, Any], args: argparse.Namespace, checkpoints: Path) -> str | None:
    """Why this checkpoint cannot be continued with these arguments, or None."""
    for option, key in (("--epochs", "epochs"), ("--accumulate", "accumulate")):
        if meta[key] != getattr(args, key):
            return (
                f"{checkpoints} holds a run of {option} {meta[key]}, and its learning-rate "
                f"schedule spans exactly that; continue it with {option} {meta[key]}, or start "
                "a new run with another --out."
            )
    return None


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    with distributed(seed=args.seed, deterministic=True, precision=args.precision) as ctx:
        args.out.mkdir(parents=True, exist_ok=True)
        bars = make_series(args.seed, args.series, args.length)
        split = int(0.8 * args.length)
        train_set = make_windows(bars, args.window, 0, split)
        val_set = make_windows(bars, args.window, split, args.length)
        train = ctx.dataloader(
            train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers
        )
        val = ctx.dataloader(
            val_set, batch_size=1024, shuffle=False, pad=False, num_workers=args.workers
        )

        model = (
            ctx.shard(Forecaster(args.window)) if args.shard else ctx.wrap(Forecaster(args.window))
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
        steps_per_epoch = math.ceil(len(train) / args.accumulate)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch
        )
        checkpoints = args.out / "checkpoints"
        meta = ctx.load_checkpoint(
            checkpoints, model=model, optimizer=optimizer, scheduler=scheduler
        )
        if meta is not None and (problem := refusal(meta, args, checkpoints)) is not None:
            ctx.print(problem, file=sys.stderr)
            ctx.barrier()  # every rank leaves at once, with the same status
            return 2
        if meta is not None and meta["epoch_done"] and meta["epoch"] + 1 == args.epochs:
            ctx.print(
                f"{args.out}: already complete ({args.epochs} of {args.epochs} epochs); "
                f"nothing to do. Summary: {args.out / 'summary.json'}"
            )
            return 0
        start, step = 0, 0
        best, earlier_time = float("inf"), 0.0
        if meta is not None:  # continue after the last finished epoch, or mid-epoch
            start = meta["epoch"] + 1 if meta["epoch_done"] else meta["epoch"]
            step, best, earlier_time = meta["step"], meta["best_val_loss"], meta["wall_time_s"]
            where = "" if meta["epoch_done"] else f", step {step} (mid-epoch)"
            log(
                f"resuming from epoch {start}{where} (checkpoint in {checkpoints}, "
                f"best val loss so far {best:.4f})"
            )
        log(
            f"{get_model_size(model)} parameters, {len(train_set)} train / {len(val_set)} val "
            f"windows, {ctx.world_size} rank(s), {ctx.backend} on {ctx.device}"
        )

        def save(epoch: int, epoch_done: bool, baseline: float) -> None:
            ctx.save_checkpoint(
                checkpoints,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                step=step,
                epoch=epoch,
                epoch_done=epoch_done,
                epochs=args.epochs,
                accumulate=args.accumulate,
                best_val_loss=best,
                baseline_val_loss=baseline,
                wall_time_s=earlier_time + time.monotonic() - started,
            )

        accumulation = ctx.accumulate(model, every=args.accumulate, loader=train)
        metrics = {"baseline": float("nan")}
        for epoch in ctx.epochs(args.epochs, start=start):
            for inputs, targets in ctx.progress(train, desc=f"epoch {epoch}", leave=False):
                with accumulation as sync:  # the all-reduce runs on the last micro-batch only
                    loss = nn.functional.mse_loss(model(inputs), targets) / args.accumulate
                    loss.backward()
                if not sync:
                    continue
                ctx.clip_grad_norm_(model, max_norm=1.0)  # the whole model's norm, also sharded
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                if args.save_every and step % args.save_every == 0:
                    save(epoch, epoch_done=False, baseline=float("nan"))
            metrics = evaluate(ctx, model, val, args.shard)
            val_loss, baseline = float(metrics["loss"]), float(metrics["baseline"])
            log(
                f"epoch {epoch}: val loss {val_loss:.4f} (no-change baseline {baseline:.4f}, "
                f"ratio {val_loss / baseline:.3f})"
            )
            if val_loss < best:
                best = val_loss
                ctx.save(ctx.full_state_dict(model), args.out / "best.pt")  # whole, from rank 0
            save(epoch, epoch_done=True, baseline=baseline)

        weights = ctx.full_state_dict(model)  # every rank takes part; rank 0 gets them
        summary = {
            "best_val_loss": best,
            "baseline_val_loss": float(metrics["baseline"]),
            "epochs_completed": args.epochs,
            "world_size": ctx.world_size,
            "wall_time_s": round(earlier_time + time.monotonic() - started, 3),
            "model_sha256": weights_sha256(weights) if ctx.rank == 0 else "",
            "resumed_from_epoch": start if meta is not None else None,
        }
        write_summary(args.out / "summary.json", summary)
        log(json.dumps(summary))
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=128, help="per rank, per micro-batch")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    parser.add_argument(
        "--save-every", type=int, default=0, help="also checkpoint every N optimizer steps"
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--series", type=int, default=16)
    parser.add_argument("--length", type=int, default=1200)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument("--out", type=Path, default=Path("runs/forecaster"))
    parser.add_argument("--shard", action="store_true", help="FSDP2 (ctx.shard) instead of DDP")
    parser.add_argument("--precision", default="32", help="32, bf16-mixed, 16-mixed, bf16-true")
    args = parser.parse_args()
    raise SystemExit(run(args))


if __name__ == "__main__":
    main()
