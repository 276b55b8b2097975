"""One ddpctx training function, run unchanged by Ray Train and by torchrun.

    python ray_train_job.py ray OUT  # a local Ray cluster, TorchTrainer, 2 CPU workers
    python ray_train_job.py ray+kill OUT  # then a second run on it, rank 1 killed
    torchrun --nproc_per_node=2 ray_train_job.py torchrun OUT

Under Ray the function runs in ``OUT/run``; with ``ray+kill`` a second run on
the same cluster, in ``OUT/kill``, has rank 1 SIGKILLed inside its block. Each rank writes
``<folder>/rank<r>.json`` with what it saw; tests/test_ray.py checks them.
Ray is started on loopback only (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
makes Ray take 127.0.0.1 as the node address, and so as ``MASTER_ADDR``),
with no dashboard and no usage statistics.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ddpctx
from ddpctx import distributed

SEED = 7


def body(out: str, kill: bool = False, report: Any = None) -> None:
    """The user's training function: nothing in it knows which launcher runs it.

    ``report(ctx, path)``, given under Ray only, hands the checkpoint to Ray.
    """
    folder = Path(out)
    seen: dict[str, Any] = {}
    with distributed(seed=SEED, log_dir=folder / "logs") as ctx:
        seen.update(
            rank=ctx.rank,
            world_size=ctx.world_size,
            local_rank=ctx.local_rank,
            local_world_size=ctx.local_world_size,
            node_rank=ctx.node_rank,
            launcher=ctx.launcher,
            seed=ctx.seed,
            device=str(ctx.device),
            draws=[random.random(), float(np.random.rand()), float(torch.rand(()))],
        )
        loader = ctx.dataloader(list(range(10)), batch_size=2, shuffle=True)
        seen["shard"] = [int(i) for batch in loader for i in batch]
        seen["total"] = ctx.all_reduce({"x": ctx.rank + 1}, op="sum")["x"]
        if kill and ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # rank 0 waits in the next collective
        model = torch.nn.Linear(3, 2)
        path = ctx.save_checkpoint(folder / "checkpoints", model=model, epoch=0)
        if report is not None:
            report(ctx, path)
        seen["weights"] = model.weight.detach().flatten().tolist()
        seen["logged"] = ctx.log({"loss": float(ctx.rank)}, step=0)
    seen["group_after_block"] = dist.is_initialized()
    if dist.is_initialized():  # Ray's group, left alive: a collective still works
        value = torch.tensor([1.0])
        dist.all_reduce(value)
        seen["after_block_sum"] = float(value.item())
    with distributed() as again:  # a second block in the same function, no seed
        resumed = torch.nn.Linear(3, 2)
        seen["resumed_meta"] = again.load_checkpoint(folder / "checkpoints", model=resumed)
        seen["resumed_weights"] = resumed.weight.detach().flatten().tolist()
        seen["second_seed"] = again.seed
        seen["second_launcher"] = again.launcher
        seen["second_total"] = again.all_reduce({"x": 1}, op="sum")["x"]
    with distributed(hang_timeout=1) as late:  # the hang doctor watches this thread
        if late.rank == 1:
            time.sleep(4)  # LATE: rank 0's report names this line
        late.barrier()
    (folder / f"rank{seen['rank']}.json").write_text(json.dumps(seen))


GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "launching.md"


def guide_train() -> Any:
    """The training function of the Launching guide's Ray Train example, as printed."""
    blocks = re.findall(r"^```python\n(.*?)^```$", GUIDE.read_text(), re.S | re.M)
    (block,) = [block for block in blocks if "TorchTrainer" in block]
    namespace: dict[str, Any] = {"__name__": "launching_guide"}  # not its __main__ part
    exec(compile(block, str(GUIDE), "exec"), namespace)
    return namespace["train"]


def train_and_report(config: dict[str, Any]) -> None:
    """Ray's training function: the guide's, then the body, which reports as the guide does."""
    import ray.train

    if not config["kill"]:
        guide_train()({"runs": str(Path(config["out"]) / "guide")})

    def report(ctx: Any, path: Path) -> None:
        checkpoint = None
        if ctx.is_main:
            checkpoint = ray.train.Checkpoint.from_directory(str(path.parent))
        ray.train.report({"epoch": 0}, checkpoint=checkpoint)  # every worker reports

    body(config["out"], config["kill"], report)


def load_reported(checkpoint: Any, folder: Path) -> None:
    """In the driver: ddpctx reads the checkpoint Ray kept (from Ray's own storage).

    One plain process, not the job's two ranks: ``checkpoint_meta`` and
    ``load_weights``, which need no process group (``ctx.load_checkpoint`` at
    world size 1 would refuse two ranks' random states).
    """
    with checkpoint.as_directory() as directory, distributed() as ctx:
        seen = {
            "launcher": ctx.launcher,
            "meta": ddpctx.checkpoint_meta(directory),
            "weights": ddpctx.load_weights(directory)["weight"].flatten().tolist(),
            "path": checkpoint.path,
        }
    (folder / "reported.json").write_text(json.dumps(seen))


def run_on_ray(out: str, with_kill: bool) -> int:
    """TorchTrainer runs on one local cluster: ``OUT/run`` whole, then ``OUT/kill`` killed."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # node address 127.0.0.1
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    started = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    try:
        runs = [("run", False), ("kill", True)][: 2 if with_kill else 1]
        for name, kill in runs:
            folder = Path(out) / name
            folder.mkdir(parents=True)
            trainer = TorchTrainer(
                train_and_report,
                train_loop_config={"out": str(folder), "kill": kill},
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                run_config=RunConfig(storage_path=str(folder / "ray"), name=name),
            )
            began = time.monotonic()
            try:
                result = trainer.fit()
                outcome = "FIT OK"
                load_reported(result.checkpoint, folder)
            except Exception as error:  # the killed run: Ray reports the lost worker
                outcome = f"FIT FAILED {type(error).__name__}: {error}"
            print(f"{name}: {outcome} after {time.monotonic() - began:.1f} s", flush=True)
            (folder / "outcome.txt").write_text(outcome)
    finally:
        ray.shutdown()
        print(f"RAY SECONDS {time.monotonic() - started:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "torchrun":
        body(out)
    else:
        sys.exit(run_on_ray(out, with_kill=mode == "ray+kill"))
