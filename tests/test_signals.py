"""SIGTERM ends a rank within about a second, however it is blocked.

torchrun stops a job by sending SIGTERM to each rank's process group, then
SIGKILL after 30 s. A rank must not sit out either: not when its main thread
is blocked in a collective (Python would run the handler only when the
collective returns), nor while DataLoader workers are busy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpctx.session.signals import GRACE_S
from tests.helpers import (
    REPO,
    child_env,
    child_pids,
    patience,
    start_torchrun,
    still_running,
    wait_for_files,
)

# Starts its own processes (torchrun jobs, scripts, notebooks): the full tier only.
pytestmark = pytest.mark.slow

TARGET = REPO / "tests" / "scripts" / "sigterm_target.py"


def wait_gone(pid: int, limit: float) -> float:
    """Seconds until ``pid`` has exited (or is a zombie), at most ``limit``."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        time.sleep(0.01)
    return time.monotonic() - started


@pytest.mark.slow
def test_sigterm_ends_a_rank_blocked_in_a_collective_within_a_second(tmp_path: Path) -> None:
    job = start_torchrun(TARGET, str(tmp_path), "collective", nproc=2)
    ranks: list[int] = []
    try:
        wait_for_files(tmp_path, "ready0", 1, timeout=90)
        ranks = child_pids(job.pid)
        time.sleep(0.5)  # rank 0 is now inside the barrier
        pid = int((tmp_path / "ready0").read_text())
        os.killpg(os.getpgid(pid), signal.SIGTERM)  # what torchrun does
        took = wait_gone(pid, limit=30)
        _, stderr = job.communicate(timeout=patience(60))  # torchrun then stops rank 1 itself
    finally:
        for pid in [job.pid, *ranks]:
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
    # Before: the handler waited for the barrier, i.e. the 300 s collective timeout.
    assert took < patience(GRACE_S + 2.5), f"rank 0 took {took:.2f} s to exit after SIGTERM"
    assert "rank 0 received SIGTERM" in stderr
    assert "exitcode: 143" in stderr.replace("exitcode  :", "exitcode:"), stderr[-3000:]


def test_sigterm_with_busy_dataloader_workers_leaves_at_once(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, str(TARGET), str(tmp_path), "loader"],
        cwd=REPO,
        env=child_env(),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_files(tmp_path, "ready0", 1, timeout=90)
        workers = child_pids(process.pid)
        assert len(workers) >= 2, workers
        sent = time.time()
        os.killpg(process.pid, signal.SIGTERM)  # the rank and its workers, as torchrun does
        _, stderr = process.communicate(timeout=patience(60))
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    left = float((tmp_path / "left").read_text())
    assert process.returncode == 143, stderr
    # Before: the workers ran ddpctx's handler too and the loader waited for them (5 s).
    assert left - sent < 1.0, f"left the block {left - sent:.2f} s after SIGTERM"
    assert still_running(workers) == []
    assert stderr.count("received SIGTERM") == 1, stderr
