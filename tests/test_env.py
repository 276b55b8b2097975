"""Launcher detection and validation, on plain dictionaries (no processes)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest

from ddpctx.utils.env import (
    DEFAULT_TIMEOUT,
    LaunchInfo,
    detect_launch,
    parse_nodelist,
    parse_tasks_per_node,
    resolve_backend,
    resolve_device_index,
    resolve_timeout,
    slurm_port,
)

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RESTART_COUNT": "2",
}

SLURM_STEP = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "123456",
}

MPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "MASTER_ADDR": "host-a",
}


def test_no_launcher_variables_means_a_single_process() -> None:
    info = detect_launch({})
    assert info == LaunchInfo("single", 0, 1, 0, 1, 0)


def test_torchrun_variables_give_every_rank_field() -> None:
    info = detect_launch(TORCHRUN)
    assert info == LaunchInfo(
        "torchrun",
        rank=3,
        world_size=4,
        local_rank=1,
        local_world_size=2,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=29500,
        restart_count=2,
    )


def test_env_launcher_with_only_rank_and_world_size_is_taken_as_one_node() -> None:
    info = detect_launch(
        {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}
    )
    assert (info.local_rank, info.local_world_size, info.node_rank) == (2, 3, 0)


def test_world_size_one_needs_no_rendezvous_address() -> None:
    info = detect_launch({"RANK": "0", "WORLD_SIZE": "1"})
    assert (info.launcher, info.master_addr, info.master_port) == ("torchrun", None, None)


def test_slurm_step_derives_address_from_nodelist_and_port_from_job_id() -> None:
    info = detect_launch(SLURM_STEP)
    assert info == LaunchInfo(
        "slurm",
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        node_rank=1,
        master_addr="gpu07",
        master_port=slurm_port(123456),
        restart_count=0,
    )
    assert 15000 <= slurm_port(123456) < 35000


def test_slurm_explicit_master_variables_win() -> None:
    info = detect_launch({**SLURM_STEP, "MASTER_ADDR": "login1", "MASTER_PORT": "4000"})
    assert (info.master_addr, info.master_port) == ("login1", 4000)


def test_slurm_batch_script_without_srun_is_a_single_process() -> None:
    batch = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_ID"}
    assert detect_launch(batch).launcher == "single"


def test_torchrun_inside_srun_is_detected_as_torchrun() -> None:
    assert detect_launch({**SLURM_STEP, **TORCHRUN}).launcher == "torchrun"


def test_open_mpi_variables() -> None:
    info = detect_launch(MPI)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.node_rank) == (
        "mpi",
        3,
        4,
        1,
        1,
    )
    assert (info.master_addr, info.master_port) == ("host-a", 29500)


BAD_ENVIRONMENTS = [
    pytest.param({"RANK": "0"}, "WORLD_SIZE is not", id="rank-without-world-size"),
    pytest.param({"WORLD_SIZE": "2"}, "RANK is not", id="world-size-without-rank"),
    pytest.param({**TORCHRUN, "RANK": "one"}, "RANK='one' is not an integer", id="rank-not-int"),
    pytest.param({**TORCHRUN, "RANK": "-1"}, "RANK='-1' must be >= 0", id="rank-negative"),
    pytest.param({**TORCHRUN, "WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be >= 1", id="world-0"),
    pytest.param({**TORCHRUN, "RANK": "4"}, "RANK=4 is not below WORLD_SIZE=4", id="rank-ge-ws"),
    pytest.param(
        {**TORCHRUN, "LOCAL_RANK": "2"},
        "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2",
        id="local-rank-ge-local-ws",
    ),
    pytest.param(
        {**TORCHRUN, "LOCAL_WORLD_SIZE": "8"},
        "LOCAL_WORLD_SIZE=8 exceeds WORLD_SIZE=4",
        id="local-ws-gt-ws",
    ),
    pytest.param(
        {**TORCHRUN, "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an integer", id="local-rank-nan"
    ),
    pytest.param(
        {k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"},
        "MASTER_ADDR is not set but WORLD_SIZE=4",
        id="no-master-addr",
    ),
    pytest.param({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT='70000'", id="port-range"),
    pytest.param({**SLURM_STEP, "SLURM_PROCID": "8"}, "SLURM_PROCID=8", id="slurm-procid"),
    pytest.param(
        {**SLURM_STEP, "SLURM_STEP_TASKS_PER_NODE": "4 x2"},
        "SLURM_STEP_TASKS_PER_NODE='4 x2'",
        id="slurm-tasks-per-node",
    ),
    pytest.param({**SLURM_STEP, "SLURM_NODEID": "2"}, "SLURM_NODEID=2", id="slurm-nodeid-beyond"),
    pytest.param(
        {k: v for k, v in SLURM_STEP.items() if k != "SLURM_JOB_NODELIST"},
        "SLURM_JOB_NODELIST",
        id="slurm-no-nodelist",
    ),
    pytest.param(
        {**SLURM_STEP, "SLURM_JOB_NODELIST": "gpu[07-"},
        "SLURM_JOB_NODELIST='gpu[07-'",
        id="slurm-bad-nodelist",
    ),
    pytest.param(
        {k: v for k, v in SLURM_STEP.items() if k != "SLURM_JOB_ID"},
        "SLURM_JOB_ID",
        id="slurm-no-job-id",
    ),
    pytest.param(
        {"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE is not", id="mpi-missing-size"
    ),
    pytest.param(
        {k: v for k, v in MPI.items() if k != "MASTER_ADDR"},
        "MASTER_ADDR is not set but OMPI_COMM_WORLD_SIZE=4",
        id="mpi-no-master-addr",
    ),
]


@pytest.mark.parametrize(("environ", "expected"), BAD_ENVIRONMENTS)
def test_bad_launcher_variables_name_the_variable_and_value(
    environ: dict[str, str], expected: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)) as raised:
        detect_launch(environ)
    message = str(raised.value)
    # every message says what to do, not only what is wrong
    assert any(word in message for word in ("Set", "set", "launch", "run", "Leave", "srun"))


LAUNCHERS = {"torchrun": TORCHRUN, "slurm": SLURM_STEP, "mpi": MPI}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1 127.0.0.2", "MASTER_ADDR='127.0.0.1 127.0.0.2' contains whitespace"),
        ("127.0.0.1 ", "Set MASTER_ADDR='127.0.0.1'"),
        ("[::1]", "MASTER_ADDR='[::1]' is an address in URL brackets"),
        ("[::1]", "Set MASTER_ADDR='::1'"),
    ],
)
def test_master_addr_is_checked_alike_on_every_launcher_path(
    launcher: str, address: str, expected: str
) -> None:
    # Before: Open MPI and SLURM took both values, and every rank timed out after ~50 s.
    with pytest.raises(ValueError, match=re.escape(expected)):
        detect_launch({**LAUNCHERS[launcher], "MASTER_ADDR": address})


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_bare_ipv6_master_addr_is_taken_on_every_launcher_path(launcher: str) -> None:
    info = detect_launch({**LAUNCHERS[launcher], "MASTER_ADDR": "::1"})
    assert info.master_addr == "::1"


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03,07],gpu-a1", ["node01", "node02", "node03", "node07", "gpu-a1"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("x[008-010]", ["x008", "x009", "x010"]),
    ],
)
def test_nodelist_expansion(text: str, hosts: list[str]) -> None:
    assert parse_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-", "node]", "node[a-b]", "node[3-1]", ""])
def test_malformed_nodelists_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="SLURM host list"):
        parse_nodelist(text)


def test_tasks_per_node_expansion() -> None:
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def test_timeout_default_argument_and_environment() -> None:
    assert resolve_timeout(None, {}) == DEFAULT_TIMEOUT == timedelta(minutes=10)
    assert resolve_timeout(None, {"DDPCTX_TIMEOUT": "30"}) == timedelta(seconds=30)
    assert resolve_timeout(5, {"DDPCTX_TIMEOUT": "30"}) == timedelta(seconds=5)
    assert resolve_timeout(timedelta(minutes=2), {}) == timedelta(minutes=2)


@pytest.mark.parametrize(
    ("timeout", "environ", "expected"),
    [
        (0, {}, "timeout=0 is outside the accepted range"),
        (-3.5, {}, "timeout=-3.5 is outside the accepted range"),
        ("60", {}, "timeout='60' is not a number"),
        (True, {}, "timeout=True is not a number"),
        (None, {"DDPCTX_TIMEOUT": "soon"}, "DDPCTX_TIMEOUT='soon'"),
        (None, {"DDPCTX_TIMEOUT": "-1"}, "DDPCTX_TIMEOUT='-1' is outside the accepted range"),
    ],
)
def test_bad_timeouts(timeout: object, environ: dict[str, str], expected: str) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        resolve_timeout(timeout, environ)  # type: ignore[arg-type]


def test_backend_choice_follows_cuda() -> None:
    assert resolve_backend(None, cuda_available=True) == "nccl"
    assert resolve_backend(None, cuda_available=False) == "gloo"
    assert resolve_backend("GLOO", cuda_available=True) == "gloo"


def test_nccl_without_cuda_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"backend='nccl' needs CUDA.*backend='gloo'"):
        resolve_backend("nccl", cuda_available=False)


def test_unknown_backend_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"backend='glo' is not a known backend.*'gloo'"):
        resolve_backend("glo", cuda_available=False)


def test_device_index_is_the_local_rank_on_cuda_and_none_on_cpu() -> None:
    info = detect_launch(TORCHRUN)
    assert resolve_device_index(info, True, 2, None) == 1
    assert resolve_device_index(info, False, 0, None) is None


def test_local_rank_beyond_visible_devices_is_refused() -> None:
    info = detect_launch({**TORCHRUN, "LOCAL_RANK": "1"})
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=1 but only 1 CUDA device.*'0'"):
        resolve_device_index(info, True, 1, "0")
