"""Checkpoints of real training code: per-rank state, schedulers across world sizes, optimizer
mismatches, same-step saves, pruning after a stop, and one writer per directory."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ddpctx import DistContext, distributed
from ddpctx.checkpoint.files import checkpoint_paths
from tests.helpers import REPO, child_env


class Counter:
    """Per-rank state with state_dict/load_state_dict (e.g. samples seen by this rank)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def per_rank_objects(rank: int) -> dict[str, Any]:
    return {
        "counter": Counter(1000 + rank),
        "python": random.Random(rank),
        "numpy": np.random.default_rng(rank),
        "legacy": np.random.RandomState(rank),
        "torch": torch.Generator().manual_seed(rank),
    }


def draws(objects: dict[str, Any]) -> list[float]:
    return [
        objects["counter"].value,
        objects["python"].random(),
        float(objects["numpy"].random()),
        float(objects["legacy"].rand()),
        torch.rand(1, generator=objects["torch"]).item(),
    ]


@pytest.mark.distributed(world_size=[2, 3])
def test_rank_state_goes_back_to_the_rank_that_saved_it(
    dist_ctx: DistContext, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = dist_ctx.broadcast(str(tmp_path_factory.mktemp("ckpt")) if dist_ctx.is_main else None)
    saved = per_rank_objects(dist_ctx.rank)
    saved["counter"].value += 1  # 1001 on rank 1
    dist_ctx.save_checkpoint(folder, model=nn.Linear(1, 1), rank_state=saved)
    expected = draws(saved)
    restored = per_rank_objects(dist_ctx.world_size + dist_ctx.rank)  # start elsewhere
    dist_ctx.load_checkpoint(folder, model=nn.Linear(1, 1), rank_state=restored)
    assert draws(restored) == expected
    assert restored["counter"].value == 1001 + dist_ctx.rank
    with pytest.raises(ValueError, match=r"holds no rank_state 'other'"):
        dist_ctx.load_checkpoint(folder, model=nn.Linear(1, 1), rank_state={"other": Counter(0)})
    with pytest.raises(TypeError, match=r"rank_state\['python'\] is a torch.Generator here"):
        dist_ctx.load_checkpoint(
            folder, model=nn.Linear(1, 1), rank_state={"python": torch.Generator()}
        )


def save_rank_state(folder: str) -> None:
    from ddpctx import current

    ctx = current()
    assert ctx is not None
    objects = per_rank_objects(ctx.rank)
    ctx.save_checkpoint(folder, model=nn.Linear(1, 1), rank_state=objects, step=5)


def load_rank_state(folder: str, names: list[str]) -> list[float]:
    from ddpctx import current

    ctx = current()
    assert ctx is not None
    objects = {name: item for name, item in per_rank_objects(ctx.rank).items() if name in names}
    ctx.load_checkpoint(
        folder, model=nn.Linear(1, 1), rank_state=objects, allow_world_size_change=True
    )
    return [objects["python"].random(), torch.rand(1, generator=objects["torch"]).item()]


def test_rank_state_on_another_world_size_reseeds_generators_and_refuses_the_rest(
    run_distributed: Any, tmp_path: Path
) -> None:
    run_distributed(save_rank_state, str(tmp_path), world_size=2)
    fresh = run_distributed(load_rank_state, str(tmp_path), ["python", "torch"], world_size=3)
    assert len({tuple(rank) for rank in fresh}) == 3  # distinct per new rank
    again = run_distributed(load_rank_state, str(tmp_path), ["python", "torch"], world_size=3)
    assert again == fresh  # deterministic
    with pytest.raises(Exception, match=r"rank_state \['counter'\] .* saved per rank by 2 ranks"):
        run_distributed(load_rank_state, str(tmp_path), ["counter", "python"], world_size=3)


def one_cycle_run(folder: str, save: bool) -> float:
    """16 samples, batches of 2: 4 steps per epoch on 2 ranks, 3 on 3."""
    from ddpctx import current

    ctx = current()
    assert ctx is not None
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ctx.dataloader(list(range(16)), batch_size=2, shuffle=True, name="train")
    cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=2 * len(loader))
    if not save:
        ctx.load_checkpoint(
            folder,
            model=model,
            optimizer=optimizer,
            scheduler=cycle,
            allow_world_size_change=True,
        )
        return float(cycle.get_last_lr()[0])
    for _ in ctx.epochs(1):
        for _batch in loader:
            optimizer.step()
            cycle.step()
    ctx.save_checkpoint(folder, model=model, optimizer=optimizer, scheduler=cycle, epoch=0)
    return float(cycle.get_last_lr()[0])


def test_a_one_cycle_schedule_is_refused_when_steps_per_epoch_change(
    run_distributed: Any, tmp_path: Path
) -> None:
    run_distributed(one_cycle_run, str(tmp_path), True, world_size=2)
    with pytest.raises(Exception, match=r"2 ranks reading 4 batches per epoch") as caught:
        run_distributed(one_cycle_run, str(tmp_path), False, world_size=3)
    message = str(caught.value)
    assert "on 3 ranks they read 3" in message
    assert "OneCycleLR (total_steps=8, at step 4 when saved)" in message
    assert "build a new OneCycleLR for the steps left" in message


def test_a_step_counted_scheduler_with_another_horizon_is_named_in_a_warning(
    tmp_path: Path,
) -> None:
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=16)
    with distributed() as ctx:
        loader = ctx.dataloader(list(range(16)), batch_size=2)
        path = ctx.save_checkpoint(tmp_path, model=model, scheduler=cosine)
        del loader
    state = torch.load(path, weights_only=True)
    state["world_size"] = state["loaders"][0]["world_size"] = 2  # as if saved by 2 ranks
    state["rng"] = state["rng"] * 2
    torch.save(state, path)
    with distributed() as ctx, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx.load_checkpoint(tmp_path, model=model, allow_world_size_change=True, scheduler=None)
        ctx.load_checkpoint(tmp_path, model=model, allow_world_size_change=True, scheduler=cosine)
    named = [str(w.message) for w in caught if "CosineAnnealingLR (T_max=16" in str(w.message)]
    assert len(named) == 1
    assert "reading 4 batches per epoch" in named[0]
    assert "on 1 ranks they read 8" in named[0]


def test_an_optimizer_or_scheduler_the_checkpoint_lacks_or_of_another_type_is_named(
    tmp_path: Path,
) -> None:
    model = nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2)).sum().backward()
    sgd.step()
    with distributed() as ctx:
        ctx.save_checkpoint(tmp_path, model=model, optimizer=sgd)
        adam = torch.optim.Adam(model.parameters())
        with pytest.raises(TypeError, match=r"state of a SGD optimizer.*given a Adam"):
            ctx.load_checkpoint(tmp_path, model=model, optimizer=adam)
        step = torch.optim.lr_scheduler.StepLR(sgd, step_size=1)
        with pytest.raises(ValueError, match=r"holds no scheduler state: it was saved without"):
            ctx.load_checkpoint(tmp_path, model=model, optimizer=sgd, scheduler=step)
        ctx.save_checkpoint(tmp_path, model=model)
        with pytest.raises(ValueError, match=r"holds no optimizer state"):
            ctx.load_checkpoint(tmp_path, model=model, optimizer=sgd)


def test_a_second_save_of_the_same_epoch_and_step_replaces_the_first(tmp_path: Path) -> None:
    with distributed() as ctx:
        for label in ({"epoch": 0, "step": 4}, {"epoch": 0, "step": 4}, {"epoch": 1, "step": 8}):
            ctx.save_checkpoint(tmp_path, model=nn.Linear(1, 1), keep=3, **label)
        ctx.save_checkpoint(tmp_path, model=nn.Linear(1, 1), keep=3, epoch=1, step=8)
    names = [path.name for path in checkpoint_paths(tmp_path)]
    assert names == ["checkpoint-000004-epoch1-step8.pt", "checkpoint-000002-epoch0-step4.pt"]


def test_checkpoints_left_past_keep_by_a_stop_are_pruned_at_load(tmp_path: Path) -> None:
    with distributed() as ctx:
        for epoch in range(3):
            ctx.save_checkpoint(tmp_path, model=nn.Linear(1, 1), keep=2, epoch=epoch)
    survivor = checkpoint_paths(tmp_path)[0]
    (tmp_path / "checkpoint-000001-epoch0.pt").write_bytes(survivor.read_bytes())  # not pruned
    with distributed() as ctx:
        assert ctx.load_checkpoint(tmp_path, model=nn.Linear(1, 1)) == {"epoch": 2}
    assert [path.name for path in checkpoint_paths(tmp_path)] == [
        "checkpoint-000003-epoch2.pt",
        "checkpoint-000002-epoch1.pt",
    ]


def test_a_second_job_writing_the_same_directory_is_refused(tmp_path: Path) -> None:
    with distributed() as ctx:
        ctx.save_checkpoint(tmp_path, model=nn.Linear(1, 1), epoch=0)
        other = subprocess.run(  # another job saves into the same directory meanwhile
            [
                sys.executable,
                "-c",
                "import sys, torch; from ddpctx import distributed\n"
                "with distributed() as ctx:\n"
                "    ctx.save_checkpoint(sys.argv[1], model=torch.nn.Linear(1, 1), epoch=5)\n",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert other.returncode == 0, other.stderr[-2000:]
        with pytest.raises(RuntimeError, match=r"holds 'checkpoint-000002-epoch5.pt', which this"):
            ctx.save_checkpoint(tmp_path, model=nn.Linear(1, 1), epoch=1)
    assert len(checkpoint_paths(tmp_path)) == 2


def test_a_killed_saves_temporary_is_removed_by_the_next_checkpoint_of_any_name(
    tmp_path: Path,
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname().replace(".", "_")
    stale = tmp_path / f".checkpoint-000007-epoch3.pt.{host}.{dead.pid}.deadbeef.tmp"
    stale.write_bytes(b"half of a large checkpoint")
    with distributed() as ctx:
        ctx.save_checkpoint(tmp_path, model=nn.Linear(1, 1), epoch=0)
    assert not stale.exists()


def test_a_killed_saves_temporary_is_removed_at_the_next_load(tmp_path: Path) -> None:
    with distributed() as ctx:
        ctx.save_checkpoint(tmp_path, model=nn.Linear(1, 1), epoch=0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname().replace(".", "_")
    stale = tmp_path / f".checkpoint-000002-epoch1.pt.{host}.{dead.pid}.deadbeef.tmp"
    stale.write_bytes(b"half of a large checkpoint")
    with distributed() as ctx:
        assert ctx.load_checkpoint(tmp_path, model=nn.Linear(1, 1)) == {"epoch": 0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-000001-epoch0.pt"]


def test_a_read_only_checkpoint_directory_loads_and_refuses_a_save_by_name(
    tmp_path: Path,
) -> None:
    mount = tmp_path / "mount"
    mount.mkdir()
    script = REPO / "tests" / "scripts" / "read_only_checkpoints.py"
    folder = mount / "checkpoints"
    steps = (
        f"mount -t tmpfs tmpfs {mount} && {sys.executable} {script} save {folder} && "
        f"mount -o remount,ro {mount} && {sys.executable} {script} probe {folder}"
    )
    try:
        result = subprocess.run(
            ["unshare", "-m", "sh", "-c", steps],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(),
            cwd=REPO,
        )
    except FileNotFoundError:
        pytest.skip("no unshare here to mount a read-only file system")
    unavailable = "unshare" in result.stderr or "mount" in result.stderr  # not root, say
    if unavailable and "loaded" not in result.stdout:
        pytest.skip(f"cannot mount a read-only file system here: {result.stderr[-200:]}")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "loaded {'epoch': 2}"
    assert lines[1].startswith("refused [Errno 30] cannot save to ")
    assert "is on a read-only file system. Nothing was written; save to a writable" in lines[1]
