"""Checkpoints of sharded models (DCP): resharding, exact resume after SIGKILL, atomicity, refusal.

Real ranks from the plugin's pool, a real gloo group, real directories on disk.
"""

from __future__ import annotations

import copy
import errno
import os
import random
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset

from ddpctx import DistContext, RankError, current
from ddpctx.checkpoint import sharded
from ddpctx.utils.atomic import _HOST
from tests.helpers import REPO, checkpoint_names, child_env, patience
from tests.test_checkpoint import the_same_on_every_rank


def context() -> DistContext:
    ctx = current()
    assert ctx is not None
    return ctx


def tiny_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 10), nn.Tanh(), nn.Dropout(0.2), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3)
    )


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return dict(get_optimizer_state_dict(model, optimizer, options=options))


def train_steps(ctx: DistContext, model: nn.Module, optimizer: Any, steps: int) -> None:
    generator = torch.Generator().manual_seed(100 + ctx.rank)
    for _ in range(steps):
        x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def save_sharded(folder: str) -> dict[str, Any]:
    ctx = context()
    model = ctx.shard(tiny_model(), blocks=[nn.Linear])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    train_steps(ctx, model, optimizer, 3)
    path = ctx.save_checkpoint(folder, model=model, optimizer=optimizer, epoch=1, step=3)
    return {
        "path": str(path),
        "weights": ctx.full_state_dict(model),
        "optimizer": full_optimizer_state(model, optimizer),
    }


def load_sharded(folder: str, shard: bool) -> dict[str, Any]:
    ctx = context()
    model = ctx.shard(tiny_model(seed=5), blocks=[nn.Linear]) if shard else tiny_model(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    meta = ctx.load_checkpoint(
        folder, model=model, optimizer=optimizer, allow_world_size_change=True
    )
    return {
        "meta": meta,
        "weights": ctx.full_state_dict(model),
        "optimizer": full_optimizer_state(model, optimizer),
    }


def assert_same_state(mine: Any, theirs: Any, where: str = "") -> None:
    if isinstance(mine, torch.Tensor):
        assert isinstance(theirs, torch.Tensor), where
        assert mine.dtype == theirs.dtype, where
        assert torch.equal(mine, theirs), where
    elif isinstance(mine, dict):
        assert mine.keys() == theirs.keys(), where
        for key in mine:
            assert_same_state(mine[key], theirs[key], f"{where}/{key}")
    elif isinstance(mine, (list, tuple)):
        assert len(mine) == len(theirs), where
        for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert_same_state(a, b, f"{where}[{index}]")
    else:
        assert mine == theirs, where


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2)], ids=["2-to-3", "3-to-2"])
@pytest.mark.slow  # over 2 s: out of the quick tier
def test_a_sharded_checkpoint_loads_at_another_world_size_with_identical_state(
    run_distributed: Any, tmp_path: Path, before: int, after: int
) -> None:
    saved = run_distributed(save_sharded, str(tmp_path), world_size=before)
    assert Path(saved[0]["path"]).name == "checkpoint-000001-epoch1-step3.dcp"
    assert (Path(saved[0]["path"]) / ".metadata").is_file()
    loaded = run_distributed(load_sharded, str(tmp_path), True, world_size=after)
    assert loaded[0]["meta"] == {"epoch": 1, "step": 3}
    assert loaded[0]["weights"].keys() == saved[0]["weights"].keys()
    assert_same_state(loaded[0]["weights"], saved[0]["weights"])
    assert saved[0]["optimizer"]["state"], "the optimizer state was saved"
    assert_same_state(loaded[0]["optimizer"], saved[0]["optimizer"])


def test_a_sharded_checkpoint_loads_into_an_unsharded_model(
    run_distributed: Any, tmp_path: Path
) -> None:
    saved = run_distributed(save_sharded, str(tmp_path), world_size=2)
    loaded = run_distributed(load_sharded, str(tmp_path), False, world_size=1)
    assert_same_state(loaded[0]["weights"], saved[0]["weights"])
    assert_same_state(loaded[0]["optimizer"], saved[0]["optimizer"])


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """Index, an input with random "augmentation" noise drawn where the item is read, a target."""

    def __len__(self) -> int:
        return 37

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        noise = torch.rand(6) * 0.1 + float(np.random.rand()) * 0.01 + random.random() * 0.01
        x = torch.full((6,), index / 37) + noise
        return torch.tensor(index), x, x[:3] * 2


def train_sharded_run(folder: str, save_at: int | None, kill_at: int | None) -> dict[str, Any]:
    """Three epochs of a sharded model with dropout; save at ``save_at``; SIGKILL at ``kill_at``.

    With ``save_at=None`` it resumes from ``folder`` first. Returns every (epoch, step,
    indices, loss) after step 5 and the final full weights.
    """
    ctx = context()
    torch.manual_seed(1000 + ctx.rank if save_at is None else ctx.rank)  # a restart: elsewhere
    model = ctx.shard(tiny_model(), blocks=[nn.Linear])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    loader = ctx.dataloader(Augmented(), batch_size=4, shuffle=True)
    start, step = 0, 0
    if save_at is None:
        meta = ctx.load_checkpoint(folder, model=model, optimizer=optimizer)
        assert meta is not None
        start, step = meta["epoch"], meta["step"]
    trace = []
    for epoch in ctx.epochs(3, start=start):
        for index, x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == save_at:
                ctx.save_checkpoint(
                    folder, model=model, optimizer=optimizer, epoch=epoch, step=step
                )
            if step == kill_at and ctx.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if step > 7:
                trace.append((epoch, step, index.tolist(), loss.item()))
    return {"trace": trace, "weights": ctx.full_state_dict(model)}


@pytest.mark.slow  # over 2 s: out of the quick tier
def test_a_sigkill_mid_epoch_then_resume_ends_bit_identical(
    run_distributed: Any, tmp_path: Path
) -> None:
    steps_per_epoch = -(-37 // (4 * 2))  # 5 steps of 4 per rank
    save_at = steps_per_epoch + 2  # the middle of epoch 1
    whole = run_distributed(train_sharded_run, str(tmp_path / "whole"), save_at, None, world_size=2)
    folder = str(tmp_path / "killed")
    with pytest.raises(RankError, match=r"rank 1.*SIGKILL"):
        run_distributed(train_sharded_run, folder, save_at, save_at + 3, world_size=2, timeout=60)
    resumed = run_distributed(train_sharded_run, folder, None, None, world_size=2)
    for uninterrupted, again in zip(whole, resumed, strict=True):
        assert again["trace"][0][:2] == (1, save_at + 1)  # picked up at the next batch
        assert again["trace"] == uninterrupted["trace"]
    assert_same_state(resumed[0]["weights"], whole[0]["weights"])
    assert resumed[0]["weights"], "rank 0 holds the full weights"


def user_sharded_round_trip(folder: str) -> dict[str, Any]:
    """fully_shard applied by hand (root only), saved, loaded into a fresh one."""
    ctx = context()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_model()
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_steps(ctx, model, optimizer, 2)
    ctx.save_checkpoint(folder, model=model, optimizer=optimizer, epoch=0)
    again = tiny_model(seed=9)
    fully_shard(again, mesh=mesh)
    again_optimizer = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
    ctx.load_checkpoint(folder, model=again, optimizer=again_optimizer)
    return {
        "saved": (ctx.full_state_dict(model), full_optimizer_state(model, optimizer)),
        "loaded": (ctx.full_state_dict(again), full_optimizer_state(again, again_optimizer)),
    }


def test_a_user_sharded_model_round_trips_exactly(run_distributed: Any, tmp_path: Path) -> None:
    results = run_distributed(user_sharded_round_trip, str(tmp_path), world_size=2)
    saved, loaded = results[0]["saved"], results[0]["loaded"]
    assert saved[0]
    assert saved[1]["state"]
    assert_same_state(loaded, saved)
    assert not torch.equal(saved[0]["0.weight"], tiny_model(seed=9).state_dict()["0.weight"])


@pytest.mark.distributed(world_size=2, timeout=90)
def test_a_half_written_sharded_checkpoint_is_never_chosen(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    model = dist_ctx.shard(tiny_model(), blocks=[nn.Linear])
    good = dist_ctx.save_checkpoint(tmp_path, model=model, epoch=0)
    before = dist_ctx.full_state_dict(model)
    if dist_ctx.rank == 0:  # what a crash leaves: a newer directory without ddpctx.pt
        torn = tmp_path / "checkpoint-000002-epoch1.dcp"
        torn.mkdir()
        (torn / "__0_0.distcp").write_bytes(b"half")
    dist_ctx.barrier()
    fresh = dist_ctx.shard(tiny_model(seed=3), blocks=[nn.Linear])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = dist_ctx.load_checkpoint(tmp_path, model=fresh)
    if dist_ctx.rank == 0:  # rank 0 chooses the checkpoint, and says why it skipped one
        said = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert any("checkpoint-000002-epoch1.dcp" in m and "lacks" in m for m in said), said
    assert meta == {"epoch": 0}
    assert_same_state(dist_ctx.full_state_dict(fresh), before)
    assert good.name == "checkpoint-000001-epoch0.dcp"


@pytest.mark.distributed(world_size=2, timeout=90)
def test_keep_prunes_older_sharded_checkpoints(dist_ctx: DistContext, tmp_path: Path) -> None:
    model = dist_ctx.shard(tiny_model(), blocks=[nn.Linear])
    if dist_ctx.rank == 0:  # a killed save's leftovers: its writer's pid is gone
        dead = subprocess.Popen(["true"])
        dead.wait()
        (tmp_path / f".checkpoint-000001.dcp.{_HOST}.{dead.pid}.0a1b2c3d.tmp").mkdir()
    dist_ctx.barrier()
    paths = [dist_ctx.save_checkpoint(tmp_path, model=model, keep=2, epoch=e) for e in range(4)]
    dist_ctx.barrier()
    assert checkpoint_names(tmp_path) == [p.name for p in paths[2:]]
    temporaries = [p for p in tmp_path.iterdir() if p.name.startswith(".checkpoint-")]
    assert not temporaries


@pytest.mark.distributed(world_size=2, timeout=90)
@pytest.mark.parametrize("how", ["shard", "wrap"])
def test_a_save_of_the_same_epoch_and_step_replaces_the_older_one(
    dist_ctx: DistContext, tmp_path: Path, how: str
) -> None:
    # Found by attacking the merged whole: sharded directories kept both saves of epoch 0
    # step 10 and pruned step 5 (the DDP files did it right).
    if how == "shard":
        model = dist_ctx.shard(tiny_model(), blocks=[nn.Linear])
    else:
        model = dist_ctx.wrap(tiny_model())
    for step in (5, 10, 10):
        dist_ctx.save_checkpoint(tmp_path, model=model, step=step, epoch=0, keep=2)
    dist_ctx.barrier()
    suffix = ".dcp" if how == "shard" else ".pt"
    assert checkpoint_names(tmp_path) == [
        f"checkpoint-000001-epoch0-step5{suffix}",
        f"checkpoint-000003-epoch0-step10{suffix}",
    ]


@pytest.mark.distributed(world_size=2, timeout=90)
def test_a_sharded_module_in_extra_is_refused_before_anything_is_written(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    model = dist_ctx.shard(tiny_model(), blocks=[nn.Linear])
    ema = dist_ctx.shard(tiny_model(), blocks=[nn.Linear])
    with pytest.raises(TypeError, match=r"extra\['ema'\] is a sharded module.*model="):
        dist_ctx.save_checkpoint(tmp_path, model=model, extra={"ema": ema}, epoch=0)
    dist_ctx.barrier()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.distributed(world_size=2, timeout=90)
def test_a_sharded_model_refuses_a_single_file_checkpoint_naming_the_fix(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    dist_ctx.save_checkpoint(tmp_path, model=dist_ctx.wrap(tiny_model()), epoch=0)
    model = dist_ctx.shard(tiny_model(), blocks=[nn.Linear])
    with pytest.raises(Exception, match=r"only single-file checkpoints .*unsharded model first"):
        dist_ctx.load_checkpoint(tmp_path, model=model)


@pytest.mark.distributed(world_size=2, timeout=90)
def test_a_run_that_switches_between_sharded_and_ddp_numbers_one_sequence_and_never_goes_back(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    # Before: the DDP save after a sharded one was numbered 000001 again, and a sharded
    # model then loaded the older sharded checkpoint (epoch 0) without a word.
    dist_ctx.save_checkpoint(
        tmp_path, model=dist_ctx.shard(tiny_model(), blocks=[nn.Linear]), epoch=0
    )
    dist_ctx.save_checkpoint(tmp_path, model=dist_ctx.wrap(tiny_model(1)), epoch=1)
    assert checkpoint_names(tmp_path) == [
        "checkpoint-000001-epoch0.dcp",
        "checkpoint-000002-epoch1.pt",
    ]
    with pytest.raises(
        Exception, match=r"checkpoint-000002-epoch1\.pt, is a single-file"
    ) as raised:
        dist_ctx.load_checkpoint(tmp_path, model=dist_ctx.shard(tiny_model(), blocks=[nn.Linear]))
    assert "move the newer files away" in str(raised.value)
    ddp = dist_ctx.wrap(tiny_model())
    assert dist_ctx.load_checkpoint(tmp_path, model=ddp) == {"epoch": 1}
    assert_same_state(ddp.module.state_dict(), tiny_model(1).state_dict())
    dist_ctx.save_checkpoint(
        tmp_path, model=dist_ctx.shard(tiny_model(), blocks=[nn.Linear]), epoch=2
    )
    assert (tmp_path / "checkpoint-000003-epoch2.dcp").is_dir()


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.distributed(world_size=2, timeout=90)
def test_load_checkpoint_given_a_checkpoint_file_is_an_error_on_every_rank(
    dist_ctx: DistContext, tmp_path: Path, shard: bool
) -> None:
    # Before: it returned None, as for an empty directory, and the run started over.
    model = (
        dist_ctx.shard(tiny_model(), blocks=[nn.Linear]) if shard else dist_ctx.wrap(tiny_model())
    )
    saved = dist_ctx.save_checkpoint(tmp_path, model=model, epoch=3)
    for given in (saved, tmp_path / "notes.txt"):
        if dist_ctx.rank == 0:
            (tmp_path / "notes.txt").write_text("x")
        dist_ctx.barrier()
        with pytest.raises(
            Exception, match=r"that is (a file|one sharded checkpoint), and load_checkpoint takes"
        ):
            dist_ctx.load_checkpoint(given, model=model)
    assert dist_ctx.load_checkpoint(tmp_path, model=model) == {"epoch": 3}


def die_mid_write(folder: str) -> None:
    """Save once; then rank 1 writes half a shard of the second save and is SIGKILLed."""
    ctx = context()
    model = ctx.shard(tiny_model(), blocks=[nn.Linear])
    ctx.save_checkpoint(folder, model=model, epoch=0)
    original = sharded.dcp_save

    def dying(state: Any, checkpoint_id: Path, *rest: Any) -> Any:
        if ctx.rank == 1:
            (checkpoint_id / "__1_0.distcp").write_bytes(b"half a shard")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(state, checkpoint_id, *rest)

    sharded.dcp_save = dying  # this rank process only
    ctx.save_checkpoint(folder, model=model, epoch=1)


def load_and_save_again(folder: str) -> dict[str, Any]:
    ctx = context()
    model = ctx.shard(tiny_model(seed=4), blocks=[nn.Linear])
    meta = ctx.load_checkpoint(folder, model=model)
    path = ctx.save_checkpoint(folder, model=model, epoch=2)
    return {"meta": meta, "path": path.name, "weights": ctx.full_state_dict(model)}


def test_a_rank_killed_mid_write_leaves_the_previous_checkpoint_the_newest(
    run_distributed: Any, tmp_path: Path
) -> None:
    with pytest.raises(RankError, match=r"rank 1.*SIGKILL"):
        run_distributed(die_mid_write, str(tmp_path), world_size=2, timeout=60)
    # no checkpoint-000002 was ever named; its temporary is gone too (rank 0 saw DCP fail and
    # removed it) or is left for the next save to remove once its writer is provably dead
    left = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert left == ["checkpoint-000001-epoch0.dcp"]
    again = run_distributed(load_and_save_again, str(tmp_path), world_size=2)
    assert again[0]["meta"] == {"epoch": 0}
    assert_same_state(again[0]["weights"], dict(tiny_model().state_dict()))
    assert again[0]["path"] == "checkpoint-000002-epoch2.dcp"
    assert checkpoint_names(tmp_path) == [  # the dead writer's temporary is gone
        "checkpoint-000001-epoch0.dcp",
        "checkpoint-000002-epoch2.dcp",
    ]


def save_async_while_training(folder: str) -> dict[str, Any]:
    """An async save, then more training: the checkpoint holds the weights of the save call."""
    ctx = context()
    model = ctx.shard(tiny_model(), blocks=[nn.Linear])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    train_steps(ctx, model, optimizer, 2)
    # a copy: the optimizer state dict shares its scalar "step" tensors with the optimizer
    at_save = copy.deepcopy((ctx.full_state_dict(model), full_optimizer_state(model, optimizer)))
    path = ctx.save_checkpoint(folder, model=model, optimizer=optimizer, async_save=True, epoch=0)
    visible_before = sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith("."))
    train_steps(ctx, model, optimizer, 2)  # overlaps the write
    published = ctx.finish_checkpoint()
    fresh = ctx.shard(tiny_model(seed=8), blocks=[nn.Linear])
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    ctx.load_checkpoint(folder, model=fresh, optimizer=fresh_optimizer)
    later = ctx.save_checkpoint(folder, model=model, async_save=True, epoch=1)  # left in flight
    return {
        "path": path.name,
        "published": None if published is None else published.name,
        "visible_before": visible_before,
        "later": later.name,
        "at_save": at_save,
        "loaded": (ctx.full_state_dict(fresh), full_optimizer_state(fresh, fresh_optimizer)),
        "after": ctx.full_state_dict(model),
    }


def test_an_async_save_holds_the_state_of_the_call_and_is_published_when_finished(
    run_distributed: Any, tmp_path: Path
) -> None:
    result = run_distributed(save_async_while_training, str(tmp_path), world_size=2)[0]
    assert result["path"] == result["published"] == "checkpoint-000001-epoch0.dcp"
    assert result["visible_before"] == []  # not published before it is finished
    assert_same_state(result["loaded"], result["at_save"])
    assert not torch.equal(result["after"]["0.weight"], result["at_save"][0]["0.weight"])
    # the one left in flight was published when the distributed() block ended
    assert checkpoint_names(tmp_path) == [result["path"], result["later"]]


@pytest.mark.distributed(world_size=2, timeout=90)
def test_async_save_of_an_unsharded_model_is_refused_naming_the_fix(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"async_save=True\) got an unsharded .*ctx\.shard"):
        dist_ctx.save_checkpoint(tmp_path, model=dist_ctx.wrap(tiny_model()), async_save=True)


def die_during_async_write(folder: str) -> None:
    ctx = context()
    model = ctx.shard(tiny_model(), blocks=[nn.Linear])
    ctx.save_checkpoint(folder, model=model, epoch=0)
    ctx.save_checkpoint(folder, model=model, async_save=True, epoch=1)
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    train_steps(ctx, model, torch.optim.SGD(model.parameters(), lr=0.1), 3)


def test_a_rank_dying_during_an_async_write_leaves_the_previous_checkpoint_the_newest(
    run_distributed: Any, tmp_path: Path
) -> None:
    with pytest.raises(RankError, match=r"rank 1.*SIGKILL"):
        run_distributed(die_during_async_write, str(tmp_path), world_size=2, timeout=60)
    left = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert left == ["checkpoint-000001-epoch0.dcp"]
    again = run_distributed(load_and_save_again, str(tmp_path), world_size=2)
    assert again[0]["meta"] == {"epoch": 0}
    assert_same_state(again[0]["weights"], dict(tiny_model().state_dict()))


def _rank_state_round_trip(folder: str) -> list[int]:
    ctx = context()
    model = ctx.shard(tiny_model(), blocks=[nn.Linear])
    mine = random.Random(1000 + ctx.rank)  # a per-rank generator, e.g. a dataset's
    mine.random()
    ctx.save_checkpoint(folder, model=model, rank_state={"draws": mine}, epoch=0)
    expected = [mine.randrange(10**6) for _ in range(3)]
    fresh = random.Random(0)
    ctx.load_checkpoint(folder, model=model, rank_state={"draws": fresh})
    assert [fresh.randrange(10**6) for _ in range(3)] == expected
    return expected


@pytest.mark.distributed(world_size=2)
def test_rank_state_comes_back_to_its_rank_from_a_sharded_checkpoint(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    folder = dist_ctx.broadcast(str(tmp_path)) + "/run"
    draws = dist_ctx.all_gather(_rank_state_round_trip(folder))
    assert draws[0] != draws[1]  # each rank got its own generator back, not rank 0's


@pytest.mark.distributed(world_size=2, timeout=60)
def test_a_sharded_checkpoint_directory_that_cannot_be_made_is_the_same_oserror_on_every_rank(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    # Found in use: OSError on rank 0 but RankZeroError on rank 1, so the documented
    # `except OSError:` fallback failed there. A parent that is a regular file stops root too
    # (CI runs as root, where a directory's mode 0o555 stops nothing).
    (tmp_path / "a-file").write_text("not a directory")
    directory = tmp_path / "a-file" / "checkpoints"
    model = dist_ctx.shard(tiny_model())
    with pytest.raises(NotADirectoryError) as caught:
        dist_ctx.save_checkpoint(directory, model=model, step=1)
    assert caught.value.errno == errno.ENOTDIR
    assert "a-file" in str(caught.value)
    the_same_on_every_rank(dist_ctx, caught.value)
    if dist_ctx.rank:
        assert any("raised on rank 0" in note for note in caught.value.__notes__)
    assert dist_ctx.save_checkpoint(tmp_path / "fallback", model=model, step=1).is_dir()


@pytest.mark.distributed(world_size=2, timeout=60)
def test_a_sharded_checkpoint_rank_0_cannot_publish_is_the_same_oserror_on_every_rank(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    # Publishing is rank 0's alone (ddpctx.pt, the manifest, the rename): a file system gone
    # read-only by then raised OSError on rank 0 and RankZeroError on rank 1.
    model = dist_ctx.shard(tiny_model())
    real_rename = os.rename

    def read_only(source: Any, target: Any) -> None:
        if not Path(target).name.startswith("checkpoint-"):  # DCP's own renames go on
            return real_rename(source, target)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(target))

    os.rename = read_only  # the publishing rename, rank 0's alone
    try:
        with pytest.raises(OSError, match="Read-only file system") as caught:
            dist_ctx.save_checkpoint(tmp_path / "run", model=model, step=1)
    finally:
        os.rename = real_rename
    assert caught.value.errno == errno.EROFS
    the_same_on_every_rank(dist_ctx, caught.value)
    assert checkpoint_names(tmp_path / "run") == []  # nothing published, no temporary kept


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow  # starts its own rank processes
@pytest.mark.parametrize(("how", "world"), [("kill", 2), ("kill", 3), ("interrupt", 2)])
def test_a_rank_that_leaves_mid_sharded_load_is_named_by_the_others(
    tmp_path: Path, how: str, world: int
) -> None:
    # Found in use: the survivor ended within 0.6-3.2 s with gloo's "Connection closed by peer
    # [127.0.0.1]:41203" and no rank named. And rank 1's own Ctrl-C became "DCP could not read
    # the shards ... (rank 0: KeyboardInterrupt)", blaming its files.
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, str(LEFT_MID_LOAD), str(tmp_path), how],
            cwd=REPO,
            env=child_env(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world),
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        errors = [rank.communicate(timeout=patience(120))[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert ranks[1].returncode == -(signal.SIGKILL if how == "kill" else signal.SIGINT)
    if how == "interrupt":
        assert "KeyboardInterrupt" in errors[1], errors[1][-2000:]
        assert "could not read the shards" not in errors[1]  # an interrupt, not its files
    for rank in [0, *range(2, world)]:
        assert ranks[rank].returncode == 1, errors[rank][-2000:]
        took, said = (tmp_path / f"rank{rank}.txt").read_text().split("\n", 1)
        assert said.startswith("RuntimeError: rank 1 left the job while the ranks loaded '"), said
        assert "checkpoint-000001-step1.dcp" in said
        assert "the checkpoint itself is intact" in said
        assert float(took) < patience(30)  # the roll call's wait, far under the timeout


LEFT_MID_LOAD = REPO / "tests" / "scripts" / "left_mid_load.py"
