"""The end of a block waits for gloo's worker threads to sleep (so the process exits cleanly).

A gloo worker still releasing a finished collective's tensors when the
interpreter shuts down aborts the process ("terminate called without an
active exception"); ``distributed()`` therefore waits, bounded, for every
worker to sleep before it leaves the group. These tests read thread states
from a fake ``/proc/<pid>/task`` and from real threads named as gloo's are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpctx.session import quiesce
from ddpctx.session.quiesce import WORKER_NAME, quiesce_gloo_workers, worker_states

STATES = st.sampled_from(["R", "S", "D", "I", "T", "Z"])
NAMES = st.sampled_from([WORKER_NAME, "python", "gloo_tcp_loop", "pt_autograd_0"])


def fake_tasks(root: Path, threads: list[tuple[str, str]]) -> Path:
    """A fake ``/proc/self/task``: one folder per thread with ``comm`` and ``stat``."""
    root.mkdir(parents=True, exist_ok=True)
    for tid, (name, state) in enumerate(threads, start=100):
        folder = root / str(tid)
        folder.mkdir()
        (folder / "comm").write_text(name + "\n")
        (folder / "stat").write_text(f"{tid} ({name}) {state} 1 1 1 0 -1 4194560 0\n")
    return root


#: Seconds each read of the fake /proc takes: none, and more than a short wait's whole
#: timeout, as a loaded machine made it once (the quick tier's timeout of 0.02 s failed).
READ_DELAYS = st.sampled_from([0.0, 0.03])


@settings(max_examples=40, deadline=None)
@given(threads=st.lists(st.tuples(NAMES, STATES), max_size=8), read_delay=READ_DELAYS)
def test_only_gloo_workers_are_read_and_busy_ones_are_waited_for(
    tmp_path_factory: pytest.TempPathFactory, threads: list[tuple[str, str]], read_delay: float
) -> None:
    tasks = fake_tasks(tmp_path_factory.mktemp("task"), threads)
    expected = [state for name, state in threads if name == WORKER_NAME]
    assert sorted(worker_states(tasks)) == sorted(expected)
    busy = any(state in ("R", "D") for state in expected)

    def slow_read(folder: Path) -> list[str]:
        time.sleep(read_delay)
        return worker_states(folder)

    # Busy workers never calm down here, so the wait ends by its timeout: a short one. Calm
    # ones end it after a few reads, however slow: a timeout no loaded machine reaches.
    with mock.patch.object(quiesce, "worker_states", slow_read):
        assert quiesce_gloo_workers(timeout_s=0.02 if busy else 60.0, tasks=tasks) is not busy


@pytest.mark.parametrize("line", ["", "12 (pt_gloo", "12 (pt_gloo_runloop)", "12 (x) "])
def test_a_stat_line_without_a_state_is_left_out(tmp_path: Path, line: str) -> None:
    tasks = tmp_path / "task"
    (tasks / "7").mkdir(parents=True)
    (tasks / "7" / "comm").write_text(WORKER_NAME + "\n")
    (tasks / "7" / "stat").write_text(line)
    assert worker_states(tasks) == []


def test_a_name_holding_a_parenthesis_is_read_by_its_last_one(tmp_path: Path) -> None:
    tasks = tmp_path / "task"
    (tasks / "7").mkdir(parents=True)
    (tasks / "7" / "comm").write_text(WORKER_NAME + "\n")
    (tasks / "7" / "stat").write_text(f"7 ({WORKER_NAME}) x) R 1 1\n")
    assert worker_states(tasks) == ["R"]


def test_no_proc_folder_returns_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    assert quiesce_gloo_workers(timeout_s=5, tasks=tmp_path / "missing")
    assert time.monotonic() - started < 1


def test_a_worker_that_goes_to_sleep_ends_the_wait(tmp_path: Path) -> None:
    tasks = fake_tasks(tmp_path / "task", [(WORKER_NAME, "R"), (WORKER_NAME, "S")])
    stat = tasks / "100" / "stat"

    def fall_asleep() -> None:  # replaced whole, as /proc shows a line: never read half-written
        (tasks / "100" / "stat.new").write_text(f"100 ({WORKER_NAME}) S 1 1\n")
        os.replace(tasks / "100" / "stat.new", stat)

    timer = threading.Timer(0.2, fall_asleep)
    started = time.monotonic()  # before the timer starts: on a busy machine, the start took 3 ms
    timer.start()
    try:
        assert quiesce_gloo_workers(timeout_s=30, tasks=tasks)
        assert time.monotonic() - started >= 0.2
    finally:
        timer.cancel()


def _name_this_thread(name: str) -> None:
    """Set this OS thread's name (``prctl(PR_SET_NAME)``), as gloo names its workers."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(15, name.encode(), 0, 0, 0)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_a_real_busy_worker_thread_is_waited_for_until_it_sleeps() -> None:
    go, done = threading.Event(), threading.Event()
    block = bytes(4 << 20)  # hashlib releases the GIL for data this large
    tids: list[int] = []

    def spin_then_sleep() -> None:
        _name_this_thread(WORKER_NAME)
        tids.append(threading.get_native_id())
        go.set()
        end = time.monotonic() + 0.3
        while time.monotonic() < end:  # runnable (state R) in native code, without the GIL,
            hashlib.sha256(block)  # as a gloo worker runs
        done.wait(30)  # asleep: state S

    worker = threading.Thread(target=spin_then_sleep, daemon=True)
    worker.start()
    try:
        go.wait(10)
        started = time.monotonic()
        assert quiesce_gloo_workers(timeout_s=30)
        assert time.monotonic() - started >= 0.1
        # only this thread: the test process may hold real gloo workers from earlier tests
        stat = Path(f"/proc/self/task/{tids[0]}/stat").read_text()
        assert stat.rsplit(")", 1)[1].split()[0] == "S"
    finally:
        done.set()
        worker.join(10)
