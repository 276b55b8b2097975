"""progress bars and logging that speak once for the job."""

from __future__ import annotations

import io

import pytest

from ddpctx import DistContext, distributed, get_logger, progress


def test_progress_is_a_tqdm_bar_on_rank_zero() -> None:
    tqdm = pytest.importorskip("tqdm")
    with distributed() as ctx:
        bar = ctx.progress(range(3), disable=True)
        assert isinstance(bar, tqdm.tqdm)
        assert list(bar) == [0, 1, 2]


def test_progress_is_the_plain_iterable_on_other_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    items = [1, 2]
    assert progress(items) is items


@pytest.mark.distributed(world_size=2)
def test_logger_speaks_once_and_other_ranks_only_warn(dist_ctx: DistContext) -> None:
    log = get_logger("ddpctx.test.job")
    stream = io.StringIO()
    log.handlers[0].setStream(stream)  # type: ignore[attr-defined]
    log.info("epoch done")
    log.warning("slow disk")
    err = stream.getvalue()
    if dist_ctx.rank == 0:
        assert "INFO" in err
        assert "epoch done" in err
        assert "slow disk" in err
    else:
        assert "epoch done" not in err
        assert "[rank 1] slow disk" in err
