"""Rank-zero work that cannot leave the other ranks waiting: nesting, unpicklable
results, no group, and which rank a failure is blamed on."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ddpctx import (
    RankZeroError,
    ReductionError,
    all_reduced,
    distributed,
    rank_zero_first,
    rank_zero_only,
)
from ddpctx.session.context import DistContext
from ddpctx.utils.errors import (
    describe,
    is_follow_on,
    is_follow_on_exit,
    record_for_torchrun,
    should_record,
)
from tests.helpers import patience
from tests.test_collectives import expect_error_everywhere as raises_everywhere

RANKS = pytest.mark.distributed(world_size=[2, 3], timeout=30)


@RANKS
def test_a_barrier_function_called_inside_a_broadcast_function_is_correct(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    @rank_zero_only(barrier=True)
    def write(path: Path) -> str:
        path.write_text("written")
        return "inner"

    @rank_zero_only(broadcast=True)
    def save_and_name() -> str:
        write(tmp_path / "model.txt")
        return "run-7"

    # Before: the others took the inner barrier's message as the outer result
    # (None), then the job deadlocked.
    assert save_and_name() == "run-7"
    assert (tmp_path / "model.txt").read_text() == "written"
    dist_ctx.barrier()  # everyone is still in step


@RANKS
def test_a_broadcast_function_called_inside_a_plain_rank_zero_function_runs(
    dist_ctx: DistContext,
) -> None:
    @rank_zero_only(broadcast=True)
    def inner() -> int:
        return 5

    @rank_zero_only
    def outer() -> int:
        return inner() + 1

    assert outer() == (6 if dist_ctx.rank == 0 else None)
    assert rank_zero_only(broadcast=True)(lambda: "after")() == "after"


@RANKS
def test_a_barrier_function_inside_a_rank_zero_block_keeps_the_ranks_in_step(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    @rank_zero_only(barrier=True)
    def write(path: Path) -> None:
        path.write_text("written")

    with dist_ctx.rank_zero() as main:
        if main:
            write(tmp_path / "log.txt")
    # Before: the others took the inner barrier's Outcome as this broadcast's value.
    assert dist_ctx.broadcast(f"from rank {dist_ctx.rank}") == "from rank 0"
    assert (tmp_path / "log.txt").read_text() == "written"


@RANKS
def test_a_barrier_function_inside_atomic_dir_keeps_the_ranks_in_step(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    @rank_zero_only(barrier=True)
    def save(directory: Path) -> None:
        (directory / "config.json").write_text("{}")

    with dist_ctx.atomic_dir(tmp_path / "model") as tmp:
        if tmp is not None:
            save(tmp)
    assert dist_ctx.broadcast(dist_ctx.rank) == 0
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json"]


STOPS = [KeyboardInterrupt(), SystemExit(2)]
FORMS = ["barrier", "broadcast", "rank_zero_first", "rank_zero", "atomic_dir", "all_reduced"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("stop", STOPS, ids=["KeyboardInterrupt", "SystemExit"])
@pytest.mark.distributed(world_size=2, timeout=30)
def test_ctrl_c_or_sys_exit_on_rank_zero_reaches_every_rank_at_once(
    dist_ctx: DistContext, tmp_path: Path, form: str, stop: BaseException
) -> None:
    # Before: rank 0 re-raised but never sent its outcome, so the others waited in the
    # broadcast -- and took rank 0's next rank-zero message (a "save on Ctrl-C" handler's)
    # as this one's, or hung until the timeout.
    def stop_on_zero() -> None:
        if dist_ctx.rank == 0:
            raise stop

    def run() -> None:
        if form in ("barrier", "broadcast"):
            rank_zero_only(**{form: True})(stop_on_zero)()
        elif form == "rank_zero_first":
            with dist_ctx.rank_zero_first():
                stop_on_zero()
        elif form == "rank_zero":
            with dist_ctx.rank_zero():
                stop_on_zero()
        elif form == "atomic_dir":
            with dist_ctx.atomic_dir(tmp_path / "out"):
                stop_on_zero()
        else:

            @all_reduced
            def metrics() -> float:
                stop_on_zero()
                return 1.0

            metrics()

    started = time.monotonic()
    with pytest.raises((type(stop), RankZeroError, ReductionError)) as raised:
        run()
    assert time.monotonic() - started < patience(10)
    if dist_ctx.rank == 0:
        assert type(raised.value) is type(stop)
    else:
        assert type(stop).__name__ in str(raised.value)
    # the "save on Ctrl-C" handler that follows: every rank in step
    rank_zero_only(barrier=True)(lambda: (tmp_path / "saved").write_text("x"))()
    assert dist_ctx.broadcast(dist_ctx.rank) == 0
    assert (tmp_path / "saved").read_text() == "x"


@RANKS
def test_a_rank_zero_block_inside_a_rank_zero_function_runs_where_it_is(
    dist_ctx: DistContext,
) -> None:
    @rank_zero_only(broadcast=True)
    def outer() -> str:
        with dist_ctx.rank_zero() as main:
            assert main
        return "done"

    assert outer() == "done"
    assert dist_ctx.broadcast(dist_ctx.rank) == 0


@RANKS
def test_a_rank_zero_block_inside_rank_zero_first_is_refused_on_every_rank(
    dist_ctx: DistContext,
) -> None:
    def block() -> None:
        with rank_zero_first(), dist_ctx.rank_zero():
            pass

    expected = RuntimeError if dist_ctx.rank == 0 else RankZeroError
    error = raises_everywhere(block, expected)
    assert "inside a rank_zero_first block" in str(error)


@RANKS
def test_a_wait_inside_rank_zero_first_is_refused_on_every_rank(dist_ctx: DistContext) -> None:
    @rank_zero_only(barrier=True)
    def write() -> None:
        pass

    def block() -> None:
        with rank_zero_first():
            write()

    if dist_ctx.rank == 0:
        error = raises_everywhere(block, RuntimeError)
        assert "inside a rank_zero_first block" in str(error)
    else:
        error = raises_everywhere(block, RankZeroError)
        assert "inside a rank_zero_first block" in str(error)


@RANKS
def test_a_result_rank_zero_cannot_send_is_an_error_on_every_rank(
    dist_ctx: DistContext,
) -> None:
    @rank_zero_only(broadcast=True)
    def make_callback() -> Any:
        return lambda: "local functions do not pickle"

    if dist_ctx.rank == 0:
        raises_everywhere(make_callback, Exception)
    else:  # before: a wait for the whole collective timeout
        error = raises_everywhere(make_callback, RankZeroError)
        assert "pickle" in str(error)
    assert rank_zero_only(broadcast=True)(lambda: 1)() == 1  # the group still works


@pytest.mark.parametrize("options", [{"barrier": True}, {"broadcast": True}])
def test_waiting_for_rank_zero_without_a_group_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, bool]
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    work = rank_zero_only(**options)(lambda: "ran")
    with pytest.raises(RuntimeError, match="rank 1 cannot wait for rank 0: no process group"):
        work()  # before: a bare AssertionError


@pytest.mark.parametrize(
    "error",
    [
        RankZeroError(0, "OSError", "disk full", "Traceback ..."),
        RuntimeError("rank 1 could not reduce its result, so no rank can (rank 1: KeyError: 'x')"),
        RuntimeError("rank 1 could not pickle its object, so nothing was sent (rank 1: ...)"),
        RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5"),
        SystemExit(143),
    ],
    ids=["rank-zero", "reduction", "pickle", "peer-gone", "sigterm"],
)
def test_errors_caused_by_another_rank_are_follow_ons(error: BaseException) -> None:
    assert is_follow_on_exit(error)


@pytest.mark.parametrize(
    "error", [ValueError("bad shard"), OSError("disk full"), SystemExit(1), KeyboardInterrupt()]
)
def test_a_ranks_own_errors_are_not_follow_ons(error: BaseException) -> None:
    assert not is_follow_on_exit(error)
    assert not is_follow_on(describe(error))


def read_record(path: Path) -> dict[str, Any]:
    message: dict[str, Any] = json.loads(path.read_text())["message"]
    return message


def test_a_follow_on_is_dated_after_the_failure_that_caused_it(tmp_path: Path) -> None:
    own, follow_on = tmp_path / "rank1.json", tmp_path / "rank0.json"
    record_for_torchrun(OSError("disk full"), {"TORCHELASTIC_ERROR_FILE": str(own)})
    record_for_torchrun(
        RankZeroError(1, "OSError", "disk full", ""), {"TORCHELASTIC_ERROR_FILE": str(follow_on)}
    )
    own_time = int(read_record(own)["extraInfo"]["timestamp"])
    assert int(read_record(follow_on)["extraInfo"]["timestamp"]) > own_time


def test_an_error_file_write_stopped_halfway_leaves_no_half_written_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torchrun's agent json-loads the error file of every rank that exited non-zero and
    # crashed (ending a --max-restarts job) on an empty one, left by a rank its SIGTERM
    # stopped in the middle of this write (seen in a 3-rank SIGKILL-and-resume run).
    error_file = tmp_path / "error.json"

    def stopped_halfway(data: object, handle: Any) -> None:
        handle.write('{"message": ')
        raise SystemExit(143)  # as ddpctx's SIGTERM handler raises

    monkeypatch.setattr(json, "dump", stopped_halfway)
    with pytest.raises(SystemExit):
        record_for_torchrun(OSError("disk full"), {"TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert list(tmp_path.iterdir()) == []  # neither the file nor its partial copy
    monkeypatch.undo()
    record_for_torchrun(OSError("disk full"), {"TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert "disk full" in read_record(error_file)["message"]
    assert list(tmp_path.iterdir()) == [error_file]


@pytest.mark.parametrize(
    ("raise_it", "expected"),
    [
        (lambda: sys.exit(3), "SystemExit: 3"),
        (lambda: sys.exit("config not found"), "SystemExit: config not found"),
        (lambda: (_ for _ in ()).throw(KeyboardInterrupt()), "KeyboardInterrupt"),
    ],
    ids=["exit-3", "exit-message", "ctrl-c"],
)
def test_a_failing_exit_is_written_to_torchruns_error_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, raise_it: Any, expected: str
) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises((SystemExit, KeyboardInterrupt)), distributed():
        raise_it()
    assert read_record(error_file)["message"].startswith(expected)  # before: no file


@pytest.mark.parametrize("code", [0, None])
def test_a_successful_exit_writes_no_error_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, code: int | None
) -> None:
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(SystemExit), distributed():
        sys.exit(code)
    assert not error_file.exists()
    assert not should_record(SystemExit(code))


class Lines:
    """A callable that returns a generator without being a generator function."""

    __qualname__ = "Lines"

    def __call__(self) -> Any:
        return (line for line in ["a", "b"])


@RANKS
@pytest.mark.parametrize("option", ["barrier", "broadcast"])
def test_a_callable_returning_a_generator_with_a_wait_is_refused_on_every_rank(
    dist_ctx: DistContext, option: str
) -> None:
    # Not a generator function, so not refused when decorating: rank 0's call is refused,
    # and the others hear of it instead of going on before rank 0's body ran.
    wrapped = rank_zero_only(**{option: True})(Lines())
    expected = TypeError if dist_ctx.rank == 0 else RankZeroError
    error = raises_everywhere(wrapped, expected)
    assert "a function that returned a generator" in str(error)
    assert dist_ctx.all_reduce(1.0, op="sum") == float(dist_ctx.world_size)
