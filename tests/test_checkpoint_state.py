"""Checkpoints of real training code: per-rank state, schedulers across world sizes, optimizer
mismatches, same-step saves, pruning after a stop, and one writer per directory."""

from __future__ import annotations

import os
import random
import re
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
from ddpctx.checkpoint.sums import sidecar
from tests.helpers import REPO, checkpoint_names, child_env


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
    sidecar(path).unlink()  # edited: its checksums no longer hold (loads as an unverified one)
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


@pytest.mark.slow  # over 2 s: out of the quick tier
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
        assert other.returncode != 0  # refused at its first save, naming this job
        assert f"another job is writing checkpoints to {str(tmp_path)!r}" in other.stderr
        assert f"pid {os.getpid()}" in other.stderr
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
    assert checkpoint_names(tmp_path) == ["checkpoint-000001-epoch0.pt"]


@pytest.mark.slow  # over 2 s: out of the quick tier
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


class Draws(torch.utils.data.Dataset[float]):
    """Each item a draw from the dataset's own generator (Kronos' windows), reseeded per epoch."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> float:
        return draw_from(self.generator)


def draw_from(generator: Any) -> float:
    if isinstance(generator, random.Random):
        return generator.random()
    if isinstance(generator, torch.Generator):
        return torch.rand(1, generator=generator).item()
    return float(generator.random())


def reseed(generator: Any, seed: int) -> None:
    if isinstance(generator, random.Random):
        generator.seed(seed)
    elif isinstance(generator, torch.Generator):
        generator.manual_seed(seed)
    elif isinstance(generator, np.random.RandomState):
        generator.seed(seed)
    else:
        generator.bit_generator.state = np.random.PCG64(seed).state


def epoch_draws(
    folder: Path, generator: Any, *, stop_at: int | None, reseed_when: str
) -> tuple[list[float], list[str]]:
    """Two epochs of 3 batches; save after each batch, stop after batch ``stop_at`` (a kill).

    Without ``stop_at`` it resumes from ``folder``. ``reseed_when``: "always" (every epoch,
    the resumed one too) or "fresh-epochs" (only when ``loader.start == 0``).
    """
    read: list[float] = []
    with warnings.catch_warnings(record=True) as caught, distributed(seed=3) as ctx:
        warnings.simplefilter("always")
        dataset = Draws(generator)
        loader = ctx.dataloader(dataset, batch_size=4, shuffle=True)
        model = nn.Linear(1, 1)
        state = {"rng": generator}
        meta = ctx.load_checkpoint(folder, model=model, rank_state=state)
        start, batch = (meta["epoch"], meta["batch"]) if meta else (0, 0)
        for epoch in ctx.epochs(2, start=start):
            if reseed_when == "always" or loader.start == 0:
                reseed(generator, 100 + epoch)
            for values in loader:
                read += values.tolist()
                batch += 1
                ctx.save_checkpoint(folder, model=model, rank_state=state, epoch=epoch, batch=batch)
                if batch == stop_at:
                    return read, [str(w.message) for w in caught]
    return read, [str(w.message) for w in caught]


GENERATORS = {
    "random.Random": lambda: random.Random(0),
    "numpy.random.Generator": lambda: np.random.default_rng(0),
    "numpy.random.RandomState": lambda: np.random.RandomState(0),
    "torch.Generator": lambda: torch.Generator().manual_seed(0),
}


@pytest.mark.parametrize("kind", sorted(GENERATORS))
@pytest.mark.parametrize("stop_at", [1, 2, 3, 5])
@pytest.mark.parametrize("reseed_when", ["always", "fresh-epochs"])
def test_a_restored_generator_reseeded_before_the_resumed_epoch_reads_on_is_named(
    tmp_path: Path, kind: str, stop_at: int, reseed_when: str
) -> None:
    whole, quiet = epoch_draws(
        tmp_path / "whole", GENERATORS[kind](), stop_at=None, reseed_when="always"
    )
    assert not [message for message in quiet if "rank_state[" in message]
    before, _ = epoch_draws(
        tmp_path / "cut", GENERATORS[kind](), stop_at=stop_at, reseed_when=reseed_when
    )
    after, caught = epoch_draws(
        tmp_path / "cut", GENERATORS[kind](), stop_at=None, reseed_when=reseed_when
    )
    named = [message for message in caught if "rank_state['rng']" in message]
    mid_epoch = stop_at % 3 != 0  # a stop at an epoch's end resumes at the next epoch's start
    if reseed_when == "always" and mid_epoch:
        assert before + after != whole  # the reseed undid the restore ...
        assert len(named) == 1  # ... and the warning says so, with the fix
        assert f"(a {kind})" in named[0]
        assert "if loader.start == 0: dataset.set_epoch_seed(epoch)" in named[0]
        if kind == "random.Random":
            assert "it was reseeded before" in named[0]
    else:  # the documented fix, or a reseed where the uninterrupted run reseeds too
        assert before + after == whole
        assert named == []


def one_cycle_mid_epoch(folder: str, save: bool) -> tuple[int, int]:
    """20 samples in batches of 3 with drop_last: 3 batches per epoch on 2 ranks, 2 on 3.

    Saving: 2 batches into epoch 0 (12 samples read). Resuming: the refusal's suggested
    total for 2 epochs (the rest of epoch 0 and epoch 1) builds the new OneCycleLR, which is
    stepped once per batch; returns (batches stepped, total_steps).
    """
    from ddpctx import current

    ctx = current()
    assert ctx is not None
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ctx.dataloader(list(range(20)), batch_size=3, shuffle=True, drop_last=True)
    cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=2 * len(loader))
    if save:
        for _ in ctx.epochs(1):
            for number, _batch in enumerate(loader, start=1):
                optimizer.step()
                cycle.step()
                if number == 2:
                    ctx.save_checkpoint(folder, model=model, optimizer=optimizer, scheduler=cycle)
                    return number, 0
    with pytest.raises(ValueError, match="OneCycleLR") as refused:
        ctx.load_checkpoint(
            folder, model=model, optimizer=optimizer, scheduler=cycle, allow_world_size_change=True
        )
    message = str(refused.value)
    found = re.search(r"total_steps = (\d+) \+ (\d+) x \(epochs after epoch 0\)", message)
    assert found is not None, message
    total = int(found[1]) + int(found[2]) * 1  # one epoch after the resumed one
    ctx.load_checkpoint(folder, model=model, optimizer=optimizer, allow_world_size_change=True)
    fresh = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
    stepped = 0
    for _ in ctx.epochs(2):
        for _batch in loader:
            optimizer.step()
            fresh.step()  # raises "Tried to step ... times" past total_steps
            stepped += 1
    return stepped, total


def test_a_one_cycle_refusal_suggests_the_total_the_resized_run_steps(
    run_distributed: Any, tmp_path: Path
) -> None:
    # Under drop_last the resumed epoch has 1 batch left on 3 ranks and later epochs 2; the
    # message suggested "remaining epochs x 3" (batches counted without drop_last).
    run_distributed(one_cycle_mid_epoch, str(tmp_path), True, world_size=2)
    for stepped, total in run_distributed(one_cycle_mid_epoch, str(tmp_path), False, world_size=3):
        assert stepped == total == 3
