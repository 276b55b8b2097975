"""Rank-zero blocks and atomic directories on real ranks: one writer, everyone waits, a failure
reaches every rank, and a directory appears whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpctx import DistContext, RankZeroError, distributed

RANKS = pytest.mark.distributed(world_size=[2, 3], timeout=60)


@RANKS
def test_a_rank_zero_block_runs_once_and_every_rank_waits_for_it(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    with dist_ctx.rank_zero() as main:
        if main:
            (tmp_path / "written").write_text(str(dist_ctx.rank))
    assert main == (dist_ctx.rank == 0)
    assert (tmp_path / "written").read_text() == "0"  # visible to all once the block is left


@RANKS
def test_a_failure_in_a_rank_zero_block_is_raised_on_every_rank(dist_ctx: DistContext) -> None:
    def write() -> None:
        with dist_ctx.rank_zero() as main:
            if main:
                raise OSError("disk on fire")

    expected = OSError if dist_ctx.rank == 0 else RankZeroError
    with pytest.raises(expected, match="disk on fire"):
        write()
    dist_ctx.barrier()  # nobody is left waiting: the group still works


@RANKS
def test_atomic_dir_replaces_the_directory_whole(dist_ctx: DistContext, tmp_path: Path) -> None:
    target = tmp_path / "model"
    for version in (1, 2):
        with dist_ctx.atomic_dir(target) as tmp:
            assert (tmp is not None) == (dist_ctx.rank == 0)
            if tmp is not None:
                assert not target.exists() or json.loads((target / "config.json").read_text())
                (tmp / "config.json").write_text(json.dumps({"version": version}))
                (tmp / f"weights-{version}.bin").write_bytes(b"w")
        assert json.loads((target / "config.json").read_text()) == {"version": version}
        assert sorted(p.name for p in target.iterdir()) == ["config.json", f"weights-{version}.bin"]
        dist_ctx.barrier()  # every rank has read this version before rank 0 replaces it
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary left


@RANKS
def test_a_failed_atomic_dir_leaves_the_old_directory_and_reaches_every_rank(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    target = tmp_path / "model"
    with dist_ctx.atomic_dir(target) as tmp:
        if tmp is not None:
            (tmp / "good").write_text("1")

    def write_half() -> None:
        with dist_ctx.atomic_dir(target) as tmp:
            if tmp is not None:
                (tmp / "partial").write_text("x")
                raise ValueError("half written")

    expected = ValueError if dist_ctx.rank == 0 else RankZeroError
    with pytest.raises(expected, match="half written"):
        write_half()
    assert sorted(p.name for p in target.iterdir()) == ["good"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_atomic_dir_creates_missing_parents_and_refuses_to_replace_a_file(tmp_path: Path) -> None:
    with distributed() as ctx:
        with ctx.atomic_dir(tmp_path / "runs" / "model") as tmp:
            assert tmp is not None
            (tmp / "weights.bin").write_bytes(b"w")
        assert (tmp_path / "runs" / "model" / "weights.bin").exists()
        (tmp_path / "file").write_text("x")
        with pytest.raises(FileExistsError, match=r"exists and is not a directory"):
            ctx.atomic_dir(tmp_path / "file").__enter__()


def test_atomic_dir_through_a_symlink_replaces_the_directory_it_points_to(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "old").write_text("1")
    link = tmp_path / "latest"
    link.symlink_to(real, target_is_directory=True)
    with distributed() as ctx:
        with ctx.atomic_dir(link) as tmp:
            assert tmp is not None
            (tmp / "new").write_text("2")
        assert link.is_symlink()
        assert sorted(p.name for p in link.iterdir()) == ["new"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "real"]

        def write_then_fail() -> None:
            with ctx.atomic_dir(link) as tmp:
                assert tmp is not None
                (tmp / "partial").write_text("x")
                raise ValueError("failed")

        with pytest.raises(ValueError, match="failed"):
            write_then_fail()
        assert link.is_symlink()
        assert sorted(p.name for p in real.iterdir()) == ["new"]  # untouched on failure


@pytest.mark.parametrize("path", [".", "..", ""])
def test_atomic_dir_refuses_the_current_directory_and_its_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with (
        distributed() as ctx,
        pytest.raises(ValueError, match=r"the current directory or a parent of it"),
        ctx.atomic_dir(path),
    ):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
