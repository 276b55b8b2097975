"""Injected faults: a writer killed mid-save, signals to a torchrun job, long-run leaks."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ddpctx import distributed
from ddpctx.checkpoint.files import atomic_save, checkpoint_paths
from ddpctx.launching.pool import RankPool
from ddpctx.launching.worker import Reaper
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

SCRIPTS = REPO / "tests" / "scripts"


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    writer = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "slow_save.py"), str(tmp_path)], cwd=REPO, env=child_env()
    )
    try:
        wait_for_files(tmp_path, "writing", 1)
        writer.kill()
        writer.wait(30)
    finally:
        writer.kill()
    assert [p.name for p in checkpoint_paths(tmp_path)] == ["checkpoint-000001-epoch1.pt"]
    leftovers = list(tmp_path.glob(".checkpoint-*.tmp"))
    assert leftovers, "the killed writer's temporary file should still be there"
    with distributed() as ctx:
        assert ctx.load_checkpoint(tmp_path, model=torch.nn.Linear(4, 1)) == {"epoch": 1}
    atomic_save({"x": 1}, tmp_path / "checkpoint-000002-epoch2.pt")  # the next save of that name
    assert not any(p.exists() for p in leftovers)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_a_torchrun_job_ends_every_rank(tmp_path: Path, signum: int) -> None:
    job = start_torchrun(SCRIPTS / "wait_forever.py", str(tmp_path), nproc=2)
    try:
        wait_for_files(tmp_path, "ready*", 2)
        workers = child_pids(job.pid)
        assert len(workers) == 2
        started = time.monotonic()
        job.send_signal(signum)
        job.communicate(timeout=patience(60))
        elapsed = time.monotonic() - started
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0  # the exit status says the job was stopped
    assert elapsed < patience(40)
    assert still_running(workers) == []


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.slow
def test_200_enter_exit_cycles_leak_no_fds_threads_or_memory() -> None:
    with distributed():
        pass  # warm: the first cycle loads what every later one reuses
    fds, threads, rss = open_fds(), threading.active_count(), rss_mb()
    for _ in range(200):
        with distributed(seed=1):
            pass
    assert open_fds() - fds <= 3
    assert threading.active_count() - threads <= 1
    assert rss_mb() - rss < 50


#: File descriptors a finished 2-rank gloo group holds until the reaper frees it.
FDS_PER_GROUP = 4


def ping() -> int:
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    return len(os.listdir("/proc/self/fd"))


def worker_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.slow
def test_300_tasks_through_one_pool_leak_no_fds_or_memory() -> None:
    with RankPool(2) as pool:
        for _ in range(Reaper.BACKLOG + 1):  # steady state: the reaper holds BACKLOG old groups
            pool.run(ping)
        rss = [worker_rss_mb(pid) for pid in pool.pids()]
        counts = [pool.run(ping) for _ in range(300)]
        grown = [worker_rss_mb(pid) - before for pid, before in zip(pool.pids(), rss, strict=True)]
    # Up to BACKLOG finished groups (their sockets) wait for the reaper at any moment, so a
    # count swings with the reaper's lag, by 4 fds a 2-rank gloo group (33, 37, 41, ... 51 on
    # one rank in a quiet run). A leak raises the floor, so compare the lowest count of the
    # first 50 tasks with that of the last 50, per rank. Since the reaper frees on BACKLOG
    # threads, a window's lowest count can sit a group or more above the true floor: 50 vs 54
    # failed CI under load with a tolerance of 2, and a quiet run gave 33 vs 37. So the floor
    # may rise by up to BACKLOG groups' fds; one fd per task would add 250.
    for rank in range(2):
        first, last = (min(c[rank] for c in window) for window in (counts[:50], counts[-50:]))
        assert last - first <= FDS_PER_GROUP * Reaper.BACKLOG, (rank, first, last)
    assert max(grown) < 50, grown
