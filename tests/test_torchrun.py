"""Two ranks under a real ``torchrun``, with a real gloo process group."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    REPO,
    child_env,
    child_pids,
    patience,
    run_torchrun,
    start_torchrun,
    wait_for_files,
)

# Starts its own processes (torchrun jobs, scripts, notebooks): the full tier only.
pytestmark = pytest.mark.slow

Report = tuple[list[dict[str, Any]], str]

SCRIPTS = REPO / "tests" / "scripts"


@pytest.fixture(scope="module")
def two_rank_report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    out = tmp_path_factory.mktemp("report")
    result = run_torchrun(SCRIPTS / "report_ranks.py", str(out), nproc=2, timeout=120)
    assert result.returncode == 0, result.stderr
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    return records, result.stdout


def test_each_rank_gets_its_place_in_the_job(two_rank_report: Report) -> None:
    records, _ = two_rank_report
    assert [(r["rank"], r["local_rank"]) for r in records] == [(0, 0), (1, 1)]
    for record in records:
        assert record["world_size"] == record["local_world_size"] == 2
        assert (record["launcher"], record["backend"], record["device"]) == (
            "torchrun",
            "gloo",
            "cpu",
        )
        assert record["node_rank"] == 0


def test_seeds_are_offset_by_rank_so_draws_differ(two_rank_report: Report) -> None:
    records, _ = two_rank_report
    assert [r["seed"] for r in records] == [42, 43]
    assert records[0]["draw"] != records[1]["draw"]


def test_collectives_and_reduce_tensor_give_the_true_mean(two_rank_report: Report) -> None:
    records, _ = two_rank_report
    for rank, record in enumerate(records):
        assert record["sum"] == 3.0
        assert record["mean"] == 1.5  # (1 + 2) / 2, not divided twice
        assert record["input_after_reduce"] == rank + 1.0  # input untouched


def test_print_appears_once_and_groups_are_destroyed(two_rank_report: Report) -> None:
    _, stdout = two_rank_report
    assert stdout.count("PRINTED-BY-MAIN-ONLY") == 1
    assert stdout.count("GROUP-ALIVE-AFTER-EXIT False") == 2


@pytest.mark.parametrize("nproc", [2, 3])
def test_an_exception_on_one_rank_ends_the_job_naming_that_rank(nproc: int) -> None:
    started = time.monotonic()
    result = run_torchrun(SCRIPTS / "fail_on_rank.py", nproc=nproc, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    report = result.stderr
    root_cause = report[report.index("Root Cause") :]
    assert "rank      : 1 (local_rank: 1)" in root_cause
    assert "ValueError: boom from rank 1" in root_cause
    assert 'raise ValueError(f"boom from rank {rank}")' in root_cause  # the traceback itself
    assert "error_file: <N/A>" not in root_cause
    assert elapsed < patience(60), f"the job took {elapsed:.0f} s to end after one rank failed"


def test_the_timeout_bounds_a_collective_that_a_rank_never_joins() -> None:
    stretch = patience(1.0)  # a loaded machine: the job's own start-up may outlast 3 s
    result = run_torchrun(SCRIPTS / "hang_on_rank.py", str(3 * stretch), nproc=2, timeout=120)
    assert result.returncode != 0
    waited = [
        float(line.split()[1])
        for line in result.stdout.splitlines()
        if line.startswith("RANK0-WAITED")
    ]
    assert waited, result.stdout
    assert waited[0] < 20 * stretch
    root_cause = result.stderr[result.stderr.index("Root Cause") :]
    assert "rank      : 0" in root_cause
    assert "Timed out" in root_cause


def test_distributed_can_be_entered_again_in_the_same_job() -> None:
    result = run_torchrun(SCRIPTS / "reenter.py", nproc=2, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for attempt in range(4):
        assert f"formation {attempt}: sum {1.0 + 2 * attempt}" in result.stdout


def test_decorators_work_under_a_group_formed_without_ddpctx(tmp_path: Path) -> None:
    result = run_torchrun(SCRIPTS / "foreign_group.py", str(tmp_path), nproc=2, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert records == [
        {"context": False, "mean": 0.5, "broadcast": 100, "plain": "ran"},
        {"context": False, "mean": 0.5, "broadcast": 100, "plain": None},
    ]


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_rank_killed_with_sigkill_ends_the_job_naming_it(nproc: int, tmp_path: Path) -> None:
    job = start_torchrun(SCRIPTS / "wait_forever.py", str(tmp_path), nproc=nproc)
    try:
        wait_for_files(tmp_path, "ready*", nproc)
        workers = child_pids(job.pid)
        assert len(workers) == nproc
        started = time.monotonic()
        os.kill(workers[-1], signal.SIGKILL)  # the highest pid: the last rank started
        _, stderr = job.communicate(timeout=patience(60))
        elapsed = time.monotonic() - started
    finally:
        job.kill()
    assert job.returncode != 0
    assert elapsed < patience(30), f"the job took {elapsed:.0f} s to end after a rank was killed"
    root_cause = stderr[stderr.index("Root Cause") :]
    assert "Signal 9 (SIGKILL)" in root_cause or "exitcode  : -9" in root_cause


@pytest.mark.parametrize(
    ("case", "failing", "says"),
    [
        (
            "some-ranks",
            0,
            "rank 1 had already left distributed() (finished its block) after 1 collective(s), "
            "while rank 0 waited in its collective #2: a collective was issued on some ranks only",
        ),
        (
            "shapes",
            1,
            "rank 0 entered collective #2 too and then left distributed() (finished its block), "
            "yet rank 1's collective #2 lost its peer: the ranks' calls did not match",
        ),
    ],
)
def test_a_peer_that_left_its_block_is_named_in_torchruns_root_cause(
    case: str, failing: int, says: str
) -> None:
    """Before: only gloo's 'Connection closed by peer ... a remote worker crashing'."""
    result = run_torchrun(SCRIPTS / "partial_collective.py", case, nproc=2, timeout=120)
    assert result.returncode != 0
    root_cause = " ".join(result.stderr[result.stderr.index("Root Cause") :].split())
    assert f"rank : {failing} (local_rank: {failing})" in root_cause, root_cause
    assert says in root_cause, root_cause
    assert f"[rank{failing}]: ddpctx: " in result.stderr  # also under the traceback


def test_a_peer_that_left_its_block_is_named_under_a_plain_env_launch() -> None:
    """RANK/WORLD_SIZE/MASTER_* set by hand (no torchrun): the note comes all the same."""
    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "partial_collective.py"), "some-ranks"],
            cwd=REPO,
            env=child_env(
                RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        (_, err0), (out1, _) = (rank.communicate(timeout=patience(120)) for rank in ranks)
    finally:
        for rank in ranks:
            rank.kill()
    assert ranks[1].returncode == 0
    assert "rank 1 left its block" in out1
    assert ranks[0].returncode != 0
    assert "ddpctx: rank 1 had already left distributed() (finished its block)" in err0, err0


#: A training script's opening: it must stop before any rendezvous, naming both launchers.
ENTER = (
    "from ddpctx import distributed\nwith distributed() as ctx:\n    print('TRAINING', ctx.rank)"
)


@pytest.mark.parametrize(
    ("job", "stale"),
    [
        pytest.param("srun", {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "none"}),
        pytest.param("mpirun", {"RANK": "0", "WORLD_SIZE": "4"}, id="mpirun-world-4"),
        pytest.param("srun", {"RANK": "0", "WORLD_SIZE": "1", "DDPCTX_LAUNCHER": "launch"}),
    ],
    ids=["srun-torchrun-leftover", "mpirun-world-4", "srun-launch-leftover"],
)
def test_stale_launcher_variables_stop_both_tasks_of_a_two_task_job_at_once(
    job: str, stale: dict[str, str]
) -> None:
    """Two plain ``python`` processes, as srun/mpirun would start them, with stale env://."""
    port = str(free_port())
    tasks = []
    for task in range(2):
        if job == "srun":
            own = {"SLURM_PROCID": str(task), "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}
            own |= {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost"}
        else:
            own = {"OMPI_COMM_WORLD_RANK": str(task), "OMPI_COMM_WORLD_SIZE": "2"}
        environ = child_env(**own, **stale, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        if "DDPCTX_LAUNCHER" in stale:
            environ["DDPCTX_LAUNCHER_PID"] = "1"  # copied from a launch rank long gone
        environ["DDPCTX_TIMEOUT"] = "900"  # a wait for peers would outlast the test's bound
        tasks.append(
            subprocess.Popen(
                [sys.executable, "-c", ENTER],
                cwd=REPO,
                env=environ,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        outputs = [task.communicate(timeout=patience(90)) for task in tasks]
    finally:
        for task in tasks:
            task.kill()
            task.wait()
    for task, (out, err) in zip(tasks, outputs, strict=True):
        assert task.returncode != 0, out
        assert "TRAINING" not in out
        assert "disagree with" in err, err
        assert f"RANK='0' WORLD_SIZE={stale['WORLD_SIZE']!r}" in err, err
        assert "Unset them" in err, err


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
