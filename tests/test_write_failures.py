"""What a failed sharded write becomes: the cause named as it is (a full disk or a quota), only
the ranks that ran out of space named as such, and an interrupt left an interrupt. DCP's own
``CheckpointException`` and ``FileSystemWriter``, no process group needed."""

from __future__ import annotations

import errno
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from ddpctx.checkpoint.shardwriter import Writer
from ddpctx.checkpoint.writefailures import as_os_error

FINAL, TEMPORARY = Path("/data/checkpoint-000003.dcp"), Path("/data/.checkpoint-000003.tmp")


def dcp_failure(**by_rank: BaseException) -> CheckpointException:
    """DCP's report of failed ranks (``rank1=...``), as its collective write raises it."""
    stack = traceback.StackSummary.from_list([])
    failures = {int(name.removeprefix("rank")): (error, stack) for name, error in by_rank.items()}
    return CheckpointException("write failed", failures)


def test_a_quota_is_named_a_quota_not_a_full_disk() -> None:
    error = as_os_error(
        dcp_failure(rank1=OSError(errno.EDQUOT, "Disk quota exceeded")), FINAL, TEMPORARY
    )
    assert isinstance(error, OSError)
    assert error.errno == errno.EDQUOT
    assert str(error).startswith("[Errno 122] disk quota exceeded while saving"), error
    assert "no space left" not in str(error)
    assert "quota" in str(error).split("intact.")[1]  # the fix speaks of the quota


def test_only_the_ranks_that_ran_out_of_space_are_named_so_the_others_apart() -> None:
    error = as_os_error(
        dcp_failure(
            rank0=ValueError("a tensor this planner cannot write"),
            rank2=OSError(errno.ENOSPC, "No space left on device"),
            rank3=OSError(errno.ENOSPC, "No space left on device"),
        ),
        FINAL,
        TEMPORARY,
    )
    assert isinstance(error, OSError)
    assert error.errno == errno.ENOSPC
    text = str(error)
    assert "no space left on device while saving" in text
    assert "rank(s) 2, 3 could not write into" in text, text
    assert "rank 0 failed otherwise: ValueError: a tensor this planner cannot write" in text


class Interrupted(list[list[Any]]):
    """Write results whose reading is interrupted (Ctrl-C during DCP's finish)."""

    def __iter__(self) -> Iterator[list[Any]]:
        raise KeyboardInterrupt


def test_an_interrupt_after_a_recorded_write_failure_stays_an_interrupt(tmp_path: Path) -> None:
    writer = Writer(tmp_path)
    with pytest.raises(OSError, match="No space"), writer.fs.create_stream(tmp_path / "s", "wb"):
        raise OSError(errno.ENOSPC, "No space left on device")  # recorded, as a full disk is
    with pytest.raises(KeyboardInterrupt):
        writer.finish(SimpleNamespace(), Interrupted())
