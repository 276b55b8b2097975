"""ctx.save / ctx.load and training checkpoints, on real ranks where it matters."""

from __future__ import annotations

import argparse
import errno
import fractions
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ddpctx import DistContext, distributed
from ddpctx.checkpoint.files import atomic_save, training_state
from ddpctx.utils.atomic import _FileSink
from tests.helpers import REPO, checkpoint_names, child_env, patience, wait_for_files

RANKS = pytest.mark.distributed(world_size=[2, 3], timeout=60)


@RANKS
def test_save_writes_once_and_every_rank_loads_it(dist_ctx: DistContext, tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    dist_ctx.save({"weights": torch.arange(4.0), "step": 7}, path)
    assert path.exists()  # every rank waited for rank 0's write
    loaded = dist_ctx.load(path)
    assert loaded["step"] == 7
    assert loaded["weights"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert loaded["weights"].device == dist_ctx.device
    assert list(tmp_path.glob(".*.tmp")) == []  # no temporary file left


def the_same_on_every_rank(ctx: DistContext, error: BaseException) -> None:
    """``error`` is one OSError on every rank: its type, errno, file name and message."""
    assert isinstance(error, OSError)
    mine = (type(error), error.errno, error.filename, str(error))
    assert ctx.all_gather(mine) == [mine] * ctx.world_size


@RANKS
def test_a_failed_write_raises_the_same_oserror_on_every_rank(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    # Every rank's `except OSError:` runs: rank 1 got a RankZeroError (a RuntimeError).
    target = tmp_path / "missing-directory" / "state.pt"
    with pytest.raises(FileNotFoundError, match=r"does not exist\. Create it first") as caught:
        dist_ctx.save({"x": 1}, target)
    assert str(target) in str(caught.value)
    the_same_on_every_rank(dist_ctx, caught.value)
    dist_ctx.barrier()  # nobody is left waiting: the group still works


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_temporary_file_left_by_a_killed_writer_is_removed_by_the_next_save(
    tmp_path: Path,
) -> None:
    stale = tmp_path / f".state.pt.{socket.gethostname()}.{dead_pid()}.deadbeef.tmp"
    stale.write_bytes(b"half a checkpoint")
    atomic_save({"x": torch.ones(1)}, tmp_path / "state.pt")
    assert not stale.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]


@pytest.mark.slow
def test_a_temporary_file_another_live_writer_is_writing_is_left_alone(tmp_path: Path) -> None:
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as writer:
        try:
            busy = tmp_path / f".state.pt.{socket.gethostname()}.{writer.pid}.0badcafe.tmp"
            foreign = tmp_path / ".state.pt.otherhost.1234.0badcafe.tmp"  # can't tell: keep
            for path in (busy, foreign):
                path.write_bytes(b"being written")
            atomic_save({"x": 1}, tmp_path / "state.pt")
            assert busy.exists()
            assert foreign.exists()
            week_ago = time.time() - 7 * 24 * 3600
            os.utime(foreign, (week_ago, week_ago))  # untouched for a week: abandoned
            atomic_save({"x": 2}, tmp_path / "state.pt")
            assert busy.exists()
            assert not foreign.exists()
        finally:
            writer.kill()


SLOW_WRITER = """
import sys, time
from pathlib import Path
from ddpctx.utils.atomic import atomic_save

class Slow:
    def __reduce__(self):
        Path(sys.argv[1], "writing").write_text("now")
        while not Path(sys.argv[1], "go").exists():
            time.sleep(0.02)
        return (int, (7,))

atomic_save({"slow": Slow()}, Path(sys.argv[1], "state.pt"))
print("first writer done")
"""


@pytest.mark.slow
def test_two_writers_of_one_path_both_succeed_and_the_last_rename_wins(tmp_path: Path) -> None:
    first = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITER, str(tmp_path)],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_files(tmp_path, "writing", 1, timeout=60)
        atomic_save({"fast": 1}, tmp_path / "state.pt")  # must not remove the first's file
        (tmp_path / "go").write_text("go")
        out, err = first.communicate(timeout=patience(60))
    finally:
        first.kill()
    assert first.returncode == 0, err[-2000:]
    assert "first writer done" in out
    assert torch.load(tmp_path / "state.pt", weights_only=False) == {"slow": 7}
    assert list(tmp_path.glob(".*.tmp")) == []


def fill_disk_after(limit: int) -> Any:
    """An ``os.write`` failing with ENOSPC after ``limit`` bytes, as a full disk does."""
    real_write = os.write
    written = 0

    def write(descriptor: int, data: Any) -> int:
        nonlocal written
        if written + len(data) > limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written += len(data)
        return real_write(descriptor, data)

    return write


def test_the_byte_sink_reports_a_real_full_device() -> None:
    descriptor = os.open("/dev/full", os.O_WRONLY)
    try:
        sink = _FileSink(descriptor)
        with pytest.raises(OSError, match="No space left on device") as caught:
            sink.write(b"x" * 10)
    finally:
        os.close(descriptor)
    assert caught.value.errno == errno.ENOSPC
    assert sink.error is caught.value


def test_a_full_disk_says_so_and_keeps_the_old_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Net()
    with distributed() as ctx:
        ctx.save_checkpoint(tmp_path, model=model, keep=1, epoch=0)
        monkeypatch.setattr(os, "write", fill_disk_after(300))
        with pytest.raises(OSError, match=r"no space left on device while saving '.*checkpoint-"):
            ctx.save_checkpoint(tmp_path, model=model, keep=1, epoch=1)
        with pytest.raises(OSError, match=r"no space left on device while saving '.*w\.pt'"):
            ctx.save({"w": torch.ones(1000)}, tmp_path / "w.pt")
        monkeypatch.undo()
        assert checkpoint_names(tmp_path) == ["checkpoint-000001-epoch0.pt"]
        assert ctx.load_checkpoint(tmp_path, model=model) == {"epoch": 0}


@pytest.mark.distributed(world_size=2, timeout=60)
def test_a_full_disk_on_rank_zero_is_named_on_every_rank(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    real_write = os.write
    model = dist_ctx.wrap(Net())
    if dist_ctx.rank == 0:  # in the rank itself (a fixture's monkeypatch is not undone there)
        os.write = fill_disk_after(100)
    try:
        with pytest.raises(OSError, match=r"no space left on device while saving") as caught:
            dist_ctx.save_checkpoint(tmp_path, model=model, epoch=0)
    finally:
        os.write = real_write
    assert caught.value.errno == errno.ENOSPC
    the_same_on_every_rank(dist_ctx, caught.value)


@RANKS
def test_a_checkpoint_directory_that_cannot_be_made_is_the_same_oserror_on_every_rank(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    directory = tmp_path / "a-file" / "checkpoints"
    with pytest.raises(NotADirectoryError) as caught:
        dist_ctx.save_checkpoint(directory, model=dist_ctx.wrap(Net()), epoch=0)
    assert caught.value.errno == errno.ENOTDIR
    assert "a-file" in str(caught.value)
    the_same_on_every_rank(dist_ctx, caught.value)
    if dist_ctx.rank:
        assert any("raised on rank 0" in note for note in caught.value.__notes__)


def test_saved_files_follow_the_process_umask(tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        atomic_save({"x": 1}, tmp_path / "state.pt")
    finally:
        os.umask(previous)
    assert (tmp_path / "state.pt").stat().st_mode & 0o777 == 0o640


def test_load_refuses_pickled_code_unless_asked(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"run": os.system}, path)
    with distributed() as ctx:
        with pytest.raises(RuntimeError, match=r"weights_only=True refuses to run"):
            ctx.load(path)
        assert ctx.load(path, weights_only=False)["run"] is os.system


def test_load_names_a_missing_file(tmp_path: Path) -> None:
    with (
        distributed() as ctx,
        pytest.raises(FileNotFoundError, match=r"nothing\.pt' does not exist"),
    ):
        ctx.load(tmp_path / "nothing.pt")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layers(x)
        return out


def train_steps(ctx: DistContext, model: nn.Module, optimizer: Any, scheduler: Any, n: int) -> None:
    for _ in range(n):
        inputs = torch.randn(16, 4)  # global RNG: must continue exactly after a resume
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def fresh(ctx: DistContext) -> tuple[nn.Module, Any, Any]:
    model = ctx.wrap(Net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return model, optimizer, scheduler


def snapshot(model: nn.Module) -> tuple[list[list[float]], float, float, float]:
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    return params, random.random(), float(np.random.rand()), torch.rand(1).item()


@RANKS
def test_a_resumed_run_continues_exactly_like_an_uninterrupted_one(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    model, optimizer, scheduler = fresh(dist_ctx)
    train_steps(dist_ctx, model, optimizer, scheduler, 3)
    path = dist_ctx.save_checkpoint(
        tmp_path, model=model, optimizer=optimizer, scheduler=scheduler, epoch=3
    )
    assert path.name == "checkpoint-000001-epoch3.pt"
    train_steps(dist_ctx, model, optimizer, scheduler, 3)
    uninterrupted = snapshot(model)

    torch.manual_seed(12345 + dist_ctx.rank)  # a restarted process starts elsewhere
    random.seed(999)
    model, optimizer, scheduler = fresh(dist_ctx)
    meta = dist_ctx.load_checkpoint(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert meta == {"epoch": 3}
    train_steps(dist_ctx, model, optimizer, scheduler, 3)
    assert snapshot(model) == uninterrupted
    assert scheduler.last_epoch == 6


@RANKS
def test_only_the_newest_checkpoints_are_kept(dist_ctx: DistContext, tmp_path: Path) -> None:
    model = dist_ctx.wrap(Net())
    for epoch in range(4):
        dist_ctx.save_checkpoint(tmp_path, model=model, keep=2, epoch=epoch)
    names = checkpoint_names(tmp_path)
    assert names == ["checkpoint-000003-epoch2.pt", "checkpoint-000004-epoch3.pt"]
    assert dist_ctx.load_checkpoint(tmp_path, model=model) == {"epoch": 3}


@RANKS
def test_a_torn_newest_checkpoint_is_skipped_with_a_warning(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    model = dist_ctx.wrap(Net())
    dist_ctx.save_checkpoint(tmp_path, model=model, epoch=1)
    if dist_ctx.rank == 0:
        (tmp_path / "checkpoint-000002-epoch2.pt").write_bytes(b"PK\x03\x04 torn")
    dist_ctx.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = dist_ctx.load_checkpoint(tmp_path, model=model)
    assert meta == {"epoch": 1}
    if dist_ctx.rank == 0:  # rank 0 chooses; it is the one that warns
        assert any("checkpoint-000002-epoch2.pt" in str(w.message) for w in caught)


def test_no_checkpoint_means_none(tmp_path: Path) -> None:
    with distributed() as ctx:
        assert ctx.load_checkpoint(tmp_path / "never-written", model=Net()) is None


def test_a_checkpoint_from_another_world_size_is_refused(tmp_path: Path) -> None:
    model = Net()
    atomic_save(
        training_state(model, None, None, {"epoch": 1}, 2, [{}, {}]),
        tmp_path / "checkpoint-000001.pt",
    )
    with (
        distributed() as ctx,
        pytest.raises(ValueError, match=r"world size 2, and this run has world size 1"),
    ):
        ctx.load_checkpoint(tmp_path, model=model)


@pytest.mark.parametrize("keep", [0, -1, 1.5])
def test_keep_must_be_positive(tmp_path: Path, keep: object) -> None:
    with distributed() as ctx, pytest.raises(ValueError, match=r"keep=.* must be a positive int"):
        ctx.save_checkpoint(tmp_path, model=Net(), keep=keep)  # type: ignore[arg-type]


def test_checkpoints_are_named_by_epoch_and_step(tmp_path: Path) -> None:
    with distributed() as ctx:
        names = [
            ctx.save_checkpoint(tmp_path, model=Net(), keep=5, **kwargs).name
            for kwargs in ({"epoch": 0}, {"epoch": 1, "step": 250}, {"step": 300}, {})
        ]
        assert names == [
            "checkpoint-000001-epoch0.pt",
            "checkpoint-000002-epoch1-step250.pt",
            "checkpoint-000003-step300.pt",
            "checkpoint-000004.pt",
        ]
        assert ctx.load_checkpoint(tmp_path, model=Net()) == {}
        (tmp_path / names[-1]).unlink()
        assert ctx.load_checkpoint(tmp_path, model=Net()) == {"step": 300}


# Meta that pickles but weights_only refuses: converted, or refused at save (never "torn").

awkward_meta = st.fixed_dictionaries(
    {
        "best": st.floats(allow_nan=False).map(np.float64),
        "count": st.integers(-(2**31), 2**31 - 1).map(np.int32),
        "flag": st.booleans().map(np.bool_),
        "out": st.text(alphabet="abc/", min_size=1, max_size=8).map(Path),
        "curve": st.lists(st.floats(-1e6, 1e6), max_size=5).map(np.array),
        "args": st.builds(argparse.Namespace, lr=st.floats(0, 1).map(np.float32)),
    }
)


@settings(max_examples=15, deadline=None)
@given(meta=awkward_meta)
@pytest.mark.slow
def test_numpy_paths_and_namespaces_in_meta_round_trip(meta: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as folder, distributed() as ctx:
        ctx.save_checkpoint(folder, model=Net(), **meta)
        loaded = ctx.load_checkpoint(folder, model=Net())
    assert loaded is not None
    assert loaded["best"] == float(meta["best"])
    assert type(loaded["best"]) is float
    assert loaded["count"] == int(meta["count"])
    assert type(loaded["count"]) is int
    assert loaded["flag"] is bool(meta["flag"])
    assert loaded["out"] == str(meta["out"])
    assert loaded["curve"].tolist() == meta["curve"].tolist()
    assert loaded["args"] == {"lr": float(meta["args"].lr)}


def test_meta_that_would_not_load_is_refused_at_save_naming_key_and_type(tmp_path: Path) -> None:
    with distributed() as ctx:
        with pytest.raises(TypeError, match=r"meta history\[1\] is a .*Fraction.*Store plain"):
            ctx.save_checkpoint(tmp_path, model=Net(), history=[1, fractions.Fraction(1, 3)])
        assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def write_refused_checkpoint(path: Path) -> None:
    """A checkpoint as an older ddpctx wrote it: NumPy meta, which weights_only refuses."""
    state = training_state(Net(), None, None, {"best": np.float64(0.5)}, 1, [{}])
    atomic_save(state, path)


def test_a_checkpoint_that_loads_but_is_refused_is_an_error_not_torn(tmp_path: Path) -> None:
    with distributed() as ctx:
        ctx.save_checkpoint(tmp_path, model=Net(), epoch=0)
        write_refused_checkpoint(tmp_path / "checkpoint-000002.pt")
        with pytest.raises(RuntimeError, match=r"000002.pt' reads as a torch file but"):
            ctx.load_checkpoint(tmp_path, model=Net())


def test_checkpoints_that_exist_but_none_loads_are_an_error_not_a_fresh_start(
    tmp_path: Path,
) -> None:
    (tmp_path / "checkpoint-000001.pt").write_bytes(b"PK\x03\x04 torn")
    with distributed() as ctx, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match=r"holds 1 checkpoint file.*none of them loads"):
            ctx.load_checkpoint(tmp_path, model=Net())


class Tracker:
    """Something with state_dict/load_state_dict, like an EMA helper."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def test_a_checkpoint_that_would_not_load_is_removed_and_prunes_nothing(tmp_path: Path) -> None:
    with distributed() as ctx:
        ctx.save_checkpoint(tmp_path, model=Net(), keep=1, epoch=0)
        with pytest.raises(TypeError, match=r"would not load, so it was removed"):
            ctx.save_checkpoint(
                tmp_path, model=Net(), keep=1, extra={"ema": Tracker(np.float64(1))}, epoch=1
            )
        assert checkpoint_names(tmp_path) == ["checkpoint-000001-epoch0.pt"]
        assert ctx.load_checkpoint(tmp_path, model=Net()) == {"epoch": 0}


@RANKS
def test_scaler_and_extra_states_are_saved_and_restored(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ema = dist_ctx.wrap(Net())
    dist_ctx.save_checkpoint(
        tmp_path, model=Net(), scaler=scaler, extra={"ema": ema, "t": Tracker(3)}, step=9
    )
    fresh_scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    fresh_ema, tracker = Net(), Tracker(0)
    meta = dist_ctx.load_checkpoint(
        tmp_path, model=Net(), scaler=fresh_scaler, extra={"ema": fresh_ema, "t": tracker}
    )
    assert meta == {"step": 9}
    assert fresh_scaler.state_dict()["scale"] == 1024.0
    assert tracker.value == 3
    for mine, theirs in zip(fresh_ema.parameters(), ema.parameters(), strict=True):
        assert torch.equal(mine.cpu(), theirs.cpu())
    with pytest.raises(ValueError, match=r"holds no extra state 'other'"):
        dist_ctx.load_checkpoint(tmp_path, model=Net(), extra={"other": Tracker(0)})
