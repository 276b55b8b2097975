"""A tracking server outside the job: down at the start, killed mid-run, brought back.

Nothing it does may hold up a step or a checkpoint beyond the documented
bound (:data:`~ddpctx.watch.servers.TRACKER_WAIT_S`, with the test suite's
slack); the points it lacks at the end are counted exactly (read back from
the server itself), and the run is not left ``RUNNING`` when the server
answers at the end. Real ``mlflow server`` processes on loopback, started
and killed here; "unreachable" is a loopback port nobody listens on.
"""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpctx import distributed
from ddpctx.watch.servers import TRACKER_WAIT_S
from ddpctx.watch.trackers import MLflowLogger, read_record, record_path
from tests.helpers import patience
from tests.test_trackers import free_port, quiet
from tests.test_trackers import serving_mlflow as mlflow_server

__all__ = ["quiet"]  # the autouse fixture: no network, no telemetry

#: A save_checkpoint may wait this long for a tracker (the bound, with 3x slack for CI).
SAVE_BOUND_S = 3 * TRACKER_WAIT_S + 2


def wait_until(done: Any, what: str) -> None:
    """Wait (patiently: a busy runner) for ``done()``: the premise of a test, not its bound."""
    deadline = time.monotonic() + patience(120)
    while not done():
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.1)


def said(caught: list[warnings.WarningMessage], pattern: str) -> list[str]:
    return [str(w.message) for w in caught if re.search(pattern, str(w.message))]


@pytest.mark.distributed(world_size=1, init=False, isolated=True, timeout=240)
@pytest.mark.integration("mlflow")
def test_an_unreachable_mlflow_server_is_said_at_start_and_holds_up_no_checkpoint(
    tmp_path: Path,
) -> None:
    uri = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    model = torch.nn.Linear(2, 1)
    saves = []
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger = MLflowLogger(tmp_path / "log", tracking_uri=uri, experiment="down")
        with distributed(log_dir=tmp_path / "log", loggers=(logger,)) as ctx:
            wrapped = ctx.wrap(model)
            deadline = time.monotonic() + patience(10)
            while not said(caught, "does not serve at the start"):
                assert time.monotonic() < deadline, [str(w.message) for w in caught]
                time.sleep(0.05)
            for step in range(30):
                ctx.log({"loss": float(step)})
                if step % 10 == 9:
                    before = time.monotonic()
                    ctx.save_checkpoint(tmp_path / "checkpoints", model=wrapped, step=step)
                    saves.append(time.monotonic() - before)
    took = time.monotonic() - started
    # Before: the first save waited ~120 s (MLflow's own retries, then "stuck").
    assert max(saves) < SAVE_BOUND_S, saves
    assert took < 3 * SAVE_BOUND_S + 3 * 3 * TRACKER_WAIT_S, took
    (start,) = said(caught, "does not serve at the start")
    assert uri in start
    assert "MLFLOW_TRACKING_URI" in start
    (end,) = said(caught, r"points were never written")
    assert "30 of its 30 points" in end, end
    # Named as a user knows it (before: "<ddpctx.watch.mlflow_logger.MLflowLogger object at ..>")
    assert "the logger MLflowLogger behind" in end, end


@pytest.mark.slow
@pytest.mark.parametrize("back_before_the_end", [True, False])
@pytest.mark.distributed(world_size=1, init=False, isolated=True, timeout=600)
@pytest.mark.integration("mlflow")
def test_an_mlflow_server_killed_mid_run_costs_no_step_and_its_losses_are_counted_exactly(
    tmp_path: Path, back_before_the_end: bool
) -> None:
    from mlflow.tracking import MlflowClient

    folder, port = tmp_path / "server", free_port()
    folder.mkdir()
    log_dir, checkpoints = tmp_path / "log", tmp_path / "checkpoints"
    model = torch.nn.Linear(2, 1)
    saves = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        server = mlflow_server(folder, port)
        uri = server.__enter__()
        logger = MLflowLogger(log_dir, tracking_uri=uri, experiment="killed", send_every_s=0.2)
        try:
            with distributed(log_dir=log_dir, loggers=(logger,)) as ctx:
                wrapped = ctx.wrap(model)
                for step in range(40):
                    ctx.log({"loss": float(step)})
                    time.sleep(0.02)
                    if step == 13:
                        wait_until(lambda: record_path(log_dir, "mlflow").exists(), "the run")
                        server.__exit__(None, None, None)  # killed mid-run
                    if step % 10 == 9:
                        before = time.monotonic()
                        ctx.save_checkpoint(checkpoints, model=wrapped, step=step)
                        saves.append(time.monotonic() - before)
                    if step == 29 and back_before_the_end:
                        server = mlflow_server(folder, port)
                        server.__enter__()
                        # back before the end: the logger has seen it answer again
                        wait_until(lambda: logger.server.down_since is None, "the comeback")
        finally:
            server.__exit__(None, None, None)
    # Before: the save after the kill waited ~120 s.
    assert max(saves) < SAVE_BOUND_S, saves
    record = read_record(record_path(log_dir, "mlflow"))
    assert record is not None
    with mlflow_server(folder, port) as uri:
        client = MlflowClient(uri)
        held = {point.step for point in client.get_metric_history(record["run_id"], "loss")}
        status = client.get_run(record["run_id"]).info.status
    lost = said(caught, r"points were never written")
    if back_before_the_end:
        assert held == set(range(40))
        assert not lost, lost
        assert status == "FINISHED"
    else:
        (message,) = lost
        # Before: "23 of its 40 points were never written" while the server held 14.
        missing = int(re.search(r"(\d+) of its 40 points", message).group(1))  # type: ignore[union-attr]
        assert missing == 40 - len(held) > 0, (message, sorted(held))
        assert status == "RUNNING"
        (left,) = said(caught, "could not be marked FINISHED")
        assert f"set_terminated('{record['run_id']}', 'FINISHED')" in left


def test_the_guide_says_how_soon_a_line_reaches_the_files_as_the_writer_does_it() -> None:
    from ddpctx.watch.trail import DISPATCH_S
    from tests.helpers import REPO

    guide = (REPO / "docs" / "guides" / "watching-a-run.md").read_text()
    paragraph = guide[guide.index("**What the files hold, and when.**") :].split("\n\n")[0]
    # Before: "within milliseconds of `ctx.log` returning" (measured: p50 78 ms, max 118 ms).
    assert "milliseconds" not in paragraph
    assert f"about {DISPATCH_S:g} s" in " ".join(paragraph.split())
    assert f"every {DISPATCH_S:g} s" in " ".join(paragraph.split())
    bound = f"at most {TRACKER_WAIT_S:g} s"
    assert bound in " ".join(guide.split()), "the guide states the trackers' bound"


class HeldServer:
    """A tracker whose server holds every request ``hold`` seconds (slow, not stuck).

    Its ``unsent`` counts the points it took that the server has not confirmed,
    as MLflowLogger's does; ``wait_s`` is the bound a checkpoint waits for it.
    """

    stuck_after_s = 600.0

    def __init__(self, wait_s: float, hold: float) -> None:
        self.wait_s = wait_s
        self.hold = hold
        self.unsent = 0

    def write_points(self, points: list[tuple[int, dict[str, float]]]) -> None:
        self.unsent += len(points)
        time.sleep(self.hold)
        self.unsent -= len(points)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.write_points([(step, metrics)])

    def flush(self) -> None:
        time.sleep(self.hold)


@pytest.mark.distributed(world_size=1, init=False, isolated=True, timeout=300)
def test_trackers_that_hold_up_a_checkpoint_share_one_bound_and_a_full_queue_is_counted(
    tmp_path: Path,
) -> None:
    # Five trackers whose servers hold each request 60 s: a save waits for all of them
    # together at most wait_s, the end of the block 3 * wait_s, and ctx.log never waits --
    # past QUEUE_LIMIT points the rest are counted, each logger's count exact.
    from ddpctx.watch.lanes import QUEUE_LIMIT

    wait_s, calls = 2.0, QUEUE_LIMIT + 2_000
    trackers = [HeldServer(wait_s, hold=60.0) for _ in range(5)]
    model = torch.nn.Linear(2, 1)
    slowest_log = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distributed(log_dir=tmp_path / "log", loggers=tuple(trackers)) as ctx:
            wrapped = ctx.wrap(model)
            ctx.log({"loss": 0.0})
            time.sleep(0.5)  # the writer hands it over: every tracker is now in a request
            before = time.monotonic()
            ctx.save_checkpoint(tmp_path / "checkpoints", model=wrapped, step=0)
            save = time.monotonic() - before
            for step in range(1, calls):
                before = time.monotonic()
                ctx.log({"loss": float(step)})
                slowest_log = max(slowest_log, time.monotonic() - before)
            ending = time.monotonic()
        end = time.monotonic() - ending
    messages = [str(w.message) for w in caught]
    # Before: the save waited wait_s for each tracker in turn (5 * 2 s), the end 5 * 6 s.
    assert save < 3 * wait_s, (save, messages)
    assert end < 3 * (3 * wait_s), (end, messages)
    assert slowest_log < 3 * wait_s, slowest_log  # a step never waits for a tracker
    lost = said(caught, r"points were never written")
    assert len(lost) == len(trackers), messages
    for message in lost:  # none confirmed one point: the server held each request
        assert f"{calls} of its {calls} points" in message, message


@pytest.mark.integration("mlflow")
def test_a_tracker_wait_other_than_the_default_is_read_and_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDPCTX_TRACKER_WAIT", "30")
    assert MLflowLogger(tmp_path, tracking_uri="sqlite:///x.db").wait_s == 30.0
    for bad in ("soon", "0", "-5", "inf"):
        monkeypatch.setenv("DDPCTX_TRACKER_WAIT", bad)
        with pytest.raises(ValueError, match=rf"DDPCTX_TRACKER_WAIT='{bad}' is not a positive"):
            MLflowLogger(tmp_path, tracking_uri="sqlite:///x.db")
