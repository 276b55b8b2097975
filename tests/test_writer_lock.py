"""The writer lock of a checkpoint directory: held by the claiming process alone (never by a
child it forks), re-checked when the file goes away under the job, and refused with a message
that names the holder, whoever it is. Real processes, real flock; no mocks."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpctx.checkpoint.writerlock import LOCK_FILE, Claims

#: Job A's rank 0: claims, forks a child (a DataLoader worker, a pool process) that lets go of
#: what it thinks it holds, prints the child's pid, then waits to be killed.
JOB_A = """
import os, sys, time
from pathlib import Path
from ddpctx.checkpoint.writerlock import Claims

claims = Claims()
claims.claim(Path(sys.argv[1]))
Claims().claim(Path(sys.argv[2]))  # a Claims dropped at once: its lock is held all the same
child = os.fork()
if child == 0:
    claims.release()  # e.g. a forked process that ends its own copy of the block
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
time.sleep(60)
"""


@pytest.fixture
def claims() -> Iterator[Claims]:
    held = Claims()
    yield held
    held.release()


@pytest.mark.slow  # over 2 s: out of the quick tier
def test_a_child_forked_after_the_claim_neither_holds_nor_removes_the_writers_lock(
    tmp_path: Path, claims: Claims
) -> None:
    second = tmp_path / "second"
    second.mkdir()
    job = subprocess.Popen(
        [sys.executable, "-c", JOB_A, str(tmp_path), str(second)],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = 0
    try:
        assert job.stdout is not None
        child = int(job.stdout.readline())
        assert (tmp_path / LOCK_FILE).exists()  # the child's release() removed nothing
        with pytest.raises(RuntimeError, match="another job is writing checkpoints"):
            Claims().claim(tmp_path)  # job A still holds it
        job.send_signal(signal.SIGKILL)  # job A dies (OOM killer); its child lives on
        job.wait(timeout=30)
        claims.claim(tmp_path)  # the restarted job takes the directory at once
        claims.claim(second)
        assert len(claims.held) == 2
    finally:
        job.kill()
        job.wait(timeout=30)
        if child:
            os.kill(child, signal.SIGKILL)


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=30)
    return process.pid


def test_a_lock_held_in_the_name_of_a_dead_process_says_so_and_how_to_find_the_holder(
    tmp_path: Path,
) -> None:
    path = tmp_path / LOCK_FILE
    dead = _dead_pid()
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:  # a process the dead writer started (by a fork outside Python) holds the lock
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        os.write(descriptor, json.dumps({"host": socket.gethostname(), "pid": dead}).encode())
        with pytest.raises(RuntimeError) as refused:
            Claims().claim(tmp_path)
    finally:
        os.close(descriptor)
    message = str(refused.value)
    assert f"Its process {dead} is dead, but a process it started still holds the lock" in message
    assert "fuser -v" in message, message
    assert "lsof" in message, message
    assert "releases the lock at once" not in message


def test_a_lock_file_removed_under_the_job_is_claimed_again_at_the_next_save(
    tmp_path: Path, claims: Claims
) -> None:
    claims.claim(tmp_path)
    (tmp_path / LOCK_FILE).unlink()  # e.g. someone cleaned the directory during the run
    claims.claim(tmp_path)
    owner = json.loads((tmp_path / LOCK_FILE).read_text())
    assert owner["pid"] == os.getpid()
    with pytest.raises(RuntimeError, match="another job is writing checkpoints"):
        Claims().claim(tmp_path)  # held again: a second job is refused


def test_a_lock_file_removed_and_taken_by_another_job_refuses_this_one_and_is_left_alone(
    tmp_path: Path, claims: Claims
) -> None:
    claims.claim(tmp_path)
    (tmp_path / LOCK_FILE).unlink()
    other = Claims()  # another job's first save finds no lock file and takes a new one
    other.claim(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="was removed while this job held it"):
            claims.claim(tmp_path)
        claims.release()
        assert (tmp_path / LOCK_FILE).exists()  # the other job's lock file is not removed
        with pytest.raises(RuntimeError, match="another job is writing checkpoints"):
            Claims().claim(tmp_path)
    finally:
        other.release()


#: Another user's job: a lock file this process cannot open at all (mode 0600, umask 077).
ANOTHER_USER = """
import os, pwd, sys
from pathlib import Path
from ddpctx.checkpoint.writerlock import Claims
if os.getuid() == 0:
    try:
        os.setuid(65534)  # root reads everything: become nobody (Python may be root's alone)
    except PermissionError:
        print("cannot drop root")
        sys.exit(0)
try:
    Claims().claim(Path(sys.argv[1]))
except Exception as error:
    print(type(error).__name__, error)
"""


@pytest.mark.slow  # over 2 s: out of the quick tier
def test_another_users_unreadable_lock_file_is_refused_naming_its_owner() -> None:
    folder = Path(tempfile.mkdtemp())
    try:
        folder.chmod(0o777)
        path = folder / LOCK_FILE
        path.write_text("{}")
        path.chmod(0o600 if os.getuid() == 0 else 0o000)
        found = subprocess.run(
            [sys.executable, "-c", ANOTHER_USER, str(folder)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        said = found.stdout + found.stderr
        if said.startswith("cannot drop root"):
            pytest.skip("root without CAP_SETUID reads every file: no other user to be")
        assert said.startswith("RuntimeError another job may be writing checkpoints"), said
        assert f"belongs to uid {os.getuid()}" in said, said
        assert str(path) in said, said
        assert "own checkpoint directory" in said, said
    finally:
        (folder / LOCK_FILE).unlink(missing_ok=True)
        folder.rmdir()
