"""Kronos' training loop in miniature: a dataset that draws its windows from its own generator.

Kronos' ``QlibDataset`` (finetune/dataset.py at master 67b630e) keeps
``self.py_rng = random.Random(seed)``, reseeds it every epoch with
``set_epoch_seed(epoch)`` and ignores the index it is given: each item is a
random window. ``--draw private`` is that dataset unchanged; ``--draw global``
is it with the one-line fix ddpctx's warning names (``random.randint`` for
``self.py_rng.randint``). ``--draw rank-state`` keeps ``self.py_rng`` and saves
it through ``rank_state={'rng': dataset.py_rng}`` with the documented guard
(reseed only when ``loader.start == 0``); ``--draw rank-state-reseeded`` saves it
so but reseeds in every epoch, the resumed one too (what undoes the restore).

usage: kronos_resume.py OUT --draw {private,global,rank-state,rank-state-reseeded}
       --workers N [--kill-after STEP]

Every rank saves a checkpoint each ``SAVE_EVERY`` steps. With ``--kill-after``
the last rank SIGKILLs itself right after the checkpoint of that global step,
on the first attempt only; under ``torchrun --max-restarts=1`` the job then
restarts and resumes from it. Each rank writes ``OUT/rank{N}.json``: the
sha256 of the final weights, and every batch it trained on after the resume
point (or all of them), as (epoch, step, windows).
"""

import argparse
import hashlib
import json
import os
import random
import signal
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from ddpctx import distributed

SAVE_EVERY = 3
SERIES = torch.sin(torch.arange(2000, dtype=torch.float32) / 7.0)
WINDOW = 8


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """QlibDataset's sampling: a random window per item, from ``self.py_rng`` or ``random``."""

    def __init__(self, draw: str, seed: int = 100) -> None:
        self.draw = draw
        self.seed = seed
        self.py_rng = random.Random(seed)

    def set_epoch_seed(self, epoch: int) -> None:
        self.py_rng.seed(self.seed + epoch)

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        last = len(SERIES) - WINDOW - 1
        if self.draw != "global":  # Kronos, unchanged: the index is ignored
            return self.window(self.py_rng.randint(0, last))
        return self.window(random.randint(0, last))  # the one-line fix

    @staticmethod
    def window(start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        window = SERIES[start : start + WINDOW + 1]
        return torch.tensor(start), window[:-1], window[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--draw", choices=["private", "global", "rank-state", "rank-state-reseeded"], required=True
    )
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill-after", type=int, default=None)
    args = parser.parse_args()
    with distributed(seed=7) as ctx:
        dataset = Windows(args.draw)
        model = ctx.wrap(nn.Sequential(nn.Linear(WINDOW, 16), nn.Tanh(), nn.Linear(16, WINDOW)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = ctx.dataloader(dataset, batch_size=4, shuffle=True, num_workers=args.workers)
        folder = args.out / "checkpoints"
        saved = {"rng": dataset.py_rng} if args.draw.startswith("rank-state") else None
        meta = ctx.load_checkpoint(folder, model=model, optimizer=optimizer, rank_state=saved)
        start_epoch, step = (meta["epoch"], meta["step"]) if meta else (0, 0)
        if meta:
            ctx.print(f"resuming from epoch {start_epoch}, step {step}")
        trace = []
        for epoch in ctx.epochs(args.epochs, start=start_epoch):
            if args.draw != "rank-state" or loader.start == 0:  # rank-state: not mid-epoch
                dataset.set_epoch_seed(epoch)  # as Kronos does, also in the resumed epoch
            for starts, x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
                trace.append((epoch, step, starts.tolist()))
                if step % SAVE_EVERY == 0:
                    ctx.save_checkpoint(
                        folder,
                        model=model,
                        optimizer=optimizer,
                        rank_state=saved,
                        epoch=epoch,
                        step=step,
                    )
                last_rank = ctx.rank == ctx.world_size - 1
                if step == args.kill_after and ctx.restart_count == 0 and last_rank:
                    os.kill(os.getpid(), signal.SIGKILL)
        weights = b"".join(p.detach().numpy().tobytes() for p in ctx.unwrap(model).parameters())
        record = {
            "resumed_at": step - len(trace),
            "restart_count": ctx.restart_count,
            "sha256": hashlib.sha256(weights).hexdigest(),
            "trace": trace,
        }
        (args.out / f"rank{ctx.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
