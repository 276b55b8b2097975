"""Multi-node and non-torchrun launchers, on this machine: two torchrun agents, SLURM, Open MPI."""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, child_env, start_torchrun

# Starts its own processes (torchrun jobs, scripts, notebooks): the full tier only.
pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "scripts" / "scale_out.py"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def records(out: Path, world: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def wait_all(processes: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    outputs = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=timeout)
            assert process.returncode == 0, err[-3000:]
            outputs.append(out)
    finally:
        for process in processes:
            process.kill()
    return outputs


def test_two_torchrun_nodes_on_loopback(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        start_torchrun(
            SCRIPT,
            str(tmp_path),
            nproc=2,
            launcher_args=(
                "--nnodes=2",
                f"--node_rank={node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}",
                "--rdzv-id=ddpctx-test",
            ),
        )
        for node in range(2)
    ]
    wait_all(agents, timeout=180)
    found = records(tmp_path, 4)
    assert sorted((r["node_rank"], r["local_rank"]) for r in found) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    for record in found:
        assert (record["world_size"], record["local_world_size"], record["launcher"]) == (
            4,
            2,
            "torchrun",
        )
        assert record["sum"] == 10.0
        assert record["mean"] == 1.5
        assert record["marker_existed"] == (
            record["local_rank"] != 0
        )  # rank_zero_first(local=True)
    for node in range(2):  # rank_zero_only(local=True) ran exactly once per node
        assert (tmp_path / f"node{node}-count").read_text() == "x"


def start(environ: dict[str, str], out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out)],
        cwd=REPO,
        env=child_env(**environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("tasks_per_node", ["2", "1(x2)"], ids=["one-node", "two-nodes"])
def test_slurm_variables_form_a_group(tmp_path: Path, tasks_per_node: str) -> None:
    job_id = str(40000 + free_port() % 20000)
    two_nodes = tasks_per_node == "1(x2)"
    ranks = []
    for rank in range(2):
        ranks.append(
            start(
                {
                    "SLURM_PROCID": str(rank),
                    "SLURM_NTASKS": "2",
                    "SLURM_STEP_ID": "0",
                    "SLURM_LOCALID": "0" if two_nodes else str(rank),
                    "SLURM_NODEID": str(rank) if two_nodes else "0",
                    "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
                    "SLURM_JOB_NODELIST": "localhost" if not two_nodes else "localhost,127.0.0.1",
                    "SLURM_JOB_ID": job_id,
                },
                tmp_path,
            )
        )
    wait_all(ranks, timeout=120)
    found = records(tmp_path, 2)
    for rank, record in enumerate(found):
        assert record["launcher"] == "slurm"
        assert record["sum"] == 3.0
        assert record["node_rank"] == (rank if two_nodes else 0)
        assert record["local_world_size"] == (1 if two_nodes else 2)


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.rsplit(":", 1)[0]).is_loopback


def test_a_one_node_slurm_job_listens_on_loopback_only(tmp_path: Path) -> None:
    job_id = str(40000 + free_port() % 20000)
    environ = {
        "SLURM_NTASKS": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_ID": job_id,
    }
    ranks = [
        start({**environ, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}, tmp_path)
        for rank in range(2)
    ]
    wait_all(ranks, timeout=120)
    for record in records(tmp_path, 2):
        assert record["listening"], "expected the store and gloo to listen somewhere"
        # Before: the store listened on every interface ("0.0.0.0:<port>").
        assert all(is_loopback(a) for a in record["listening"]), record["listening"]


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("address", ["127.0.0.1", "::1"], ids=["ipv4", "ipv6"])
def test_open_mpi_variables_form_a_group(tmp_path: Path, address: str) -> None:
    if address == "::1" and not ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    port = str(free_port())
    ranks = [
        start(
            {
                "OMPI_COMM_WORLD_RANK": str(rank),
                "OMPI_COMM_WORLD_SIZE": "3",
                "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
                "OMPI_COMM_WORLD_LOCAL_SIZE": "3",
                "MASTER_ADDR": address,  # before: IPv6 broke the tcp:// URL
                "MASTER_PORT": port,
            },
            tmp_path,
        )
        for rank in range(3)
    ]
    wait_all(ranks, timeout=120)
    found = records(tmp_path, 3)
    assert [r["launcher"] for r in found] == ["mpi"] * 3
    assert [r["sum"] for r in found] == [6.0] * 3
    assert all(is_loopback(a) for r in found for a in r["listening"])


@pytest.mark.parametrize("launcher", ["slurm", "mpi"])
def test_a_stale_rank_0_of_1_next_to_a_two_task_launch_stops_every_task(
    tmp_path: Path, launcher: str
) -> None:
    """Before: both tasks ran as rank 0 of 1, each training alone and writing rank 0's files."""
    port = str(free_port())
    stale = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    own = {
        "slurm": lambda rank: {
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_STEP_ID": "0",
            "SLURM_LOCALID": str(rank),
            "SLURM_JOB_NODELIST": "localhost",
            "SLURM_JOB_ID": "41234",
        },
        "mpi": lambda rank: {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2"},
    }[launcher]
    tasks = [start({**stale, **own(rank)}, tmp_path) for rank in range(2)]
    try:
        results = [task.communicate(timeout=120) for task in tasks]
    finally:
        for task in tasks:
            task.kill()
    rank_name = {"slurm": "SLURM_PROCID", "mpi": "OMPI_COMM_WORLD_RANK"}[launcher]
    for rank, (task, (_, err)) in enumerate(zip(tasks, results, strict=True)):
        assert task.returncode != 0, f"task {rank} ran as rank 0 of 1"
        assert "RANK='0' WORLD_SIZE='1' (env://" in err, err[-2000:]
        assert f"{rank_name}='{rank}'" in err
        assert "unset RANK WORLD_SIZE" in err
    assert not (tmp_path / "rank0.json").exists()
