"""Launcher detection and validation, on plain dictionaries (no processes)."""

from __future__ import annotations

import os
import re
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
from tests.helpers import REPO

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


def test_an_srun_steps_variables_win_over_open_mpis_as_the_launching_guide_says() -> None:
    """Both sets, disagreeing: the srun step's (first in the order); without a step, Open MPI's."""
    both = {**MPI, **SLURM_STEP}  # rank 5 of 8 (srun) vs rank 3 of 4 (Open MPI)
    info = detect_launch(both)
    assert (info.launcher, info.rank, info.world_size) == ("slurm", 5, 8)
    batch = {k: v for k, v in both.items() if k != "SLURM_STEP_ID"}
    info = detect_launch(batch)
    assert (info.launcher, info.rank, info.world_size) == ("mpi", 3, 4)
    guide = " ".join((REPO / "docs" / "guides" / "launching.md").read_text().split())
    assert "an `srun` step's variables and Open MPI's both appear" in guide
    assert "the `srun` step's win" in guide
    assert "without `SLURM_STEP_ID` (no `srun`) Open MPI's are used" in guide


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


@pytest.mark.parametrize("name", ["SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_NODELIST"])
def test_an_unresolvable_first_host_of_the_node_list_names_the_node_list(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Rank 0's address came from SLURM's node list: the error names it, not MASTER_ADDR."""
    from ddpctx import distributed

    environ = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_JOB_NODELIST"}
    for key, value in {**environ, name: "node[01-02].invalid"}.items():
        monkeypatch.setenv(key, value)
    info = detect_launch({**environ, name: "node[01-02].invalid"})
    assert (info.master_addr, info.master_addr_from) == (
        "node01.invalid",
        f"{name}='node[01-02].invalid'",
    )
    with pytest.raises(ValueError, match="does not resolve") as caught, distributed():
        pass
    message = str(caught.value)
    assert f"the first host of {name}='node[01-02].invalid'" in message
    assert "'node01.invalid'" in message
    assert f"unset {name}" in message
    assert "Set MASTER_ADDR" in message
    assert "MASTER_ADDR='node01.invalid'" not in message  # MASTER_ADDR was never set


def test_an_explicit_master_addr_under_slurm_is_named_as_master_addr() -> None:
    info = detect_launch({**SLURM_STEP, "MASTER_ADDR": "host-a"})
    assert (info.master_addr, info.master_addr_from) == ("host-a", "MASTER_ADDR")


STALE = {"RANK": "0", "WORLD_SIZE": "1"}
SLURM_TWO_TASKS = {**SLURM_STEP, "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
SLURM_TWO_TASKS.pop("SLURM_STEP_TASKS_PER_NODE")
MPI_TWO = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "host-a"}


@pytest.mark.parametrize(
    ("other", "names"),
    [
        (SLURM_TWO_TASKS, "SLURM_PROCID='1' SLURM_NTASKS='2' (an srun step (SLURM))"),
        (MPI_TWO, "OMPI_COMM_WORLD_RANK='1' OMPI_COMM_WORLD_SIZE='2' (Open MPI (mpirun))"),
    ],
    ids=["slurm", "mpi"],
)
def test_a_stale_rank_and_world_size_next_to_another_launch_is_an_error_naming_both(
    other: dict[str, str], names: str
) -> None:
    with pytest.raises(ValueError, match="disagree with") as caught:
        detect_launch({**other, **STALE})
    message = str(caught.value)
    assert "RANK='0' WORLD_SIZE='1' (env://" in message
    assert names in message
    assert "unset RANK WORLD_SIZE" in message
    assert "MASTER_ADDR and MASTER_PORT too" in message


@pytest.mark.parametrize("other", [SLURM_TWO_TASKS, MPI_TWO], ids=["slurm", "mpi"])
def test_following_the_stale_variables_advice_to_make_them_agree_gives_a_launch(
    other: dict[str, str],
) -> None:
    # The error offers two ways out; the second once led to another error, as agreeing env://
    # variables need an address of their own (the merged-whole attack).
    agreeing = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "host-a", "MASTER_PORT": "29500"}
    info = detect_launch({**other, **agreeing})
    assert (info.rank, info.world_size) == (1, 2)


@pytest.mark.parametrize(
    "environ",
    [
        pytest.param({**SLURM_STEP, **TORCHRUN}, id="torchrun-inside-srun"),
        pytest.param(
            {**SLURM_STEP, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", **TORCHRUN},
            id="srun-one-torchrun-per-node",
        ),
        pytest.param(
            {**SLURM_STEP, **TORCHRUN, "RANK": "5", "WORLD_SIZE": "8"}, id="copied-from-slurm"
        ),
        pytest.param(
            # An unmarked per-node launcher says how many ranks it runs per node: without
            # LOCAL_WORLD_SIZE, task 0's RANK=0 WORLD_SIZE=4 is also a stale copy's.
            {**SLURM_STEP, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "RANK": "3"}
            | {"WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
            | {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
            id="per-node-launcher-without-torchrun-markers",
        ),
        pytest.param(
            {**SLURM_STEP, "RANK": "1", "WORLD_SIZE": "2", "DDPCTX_LAUNCHER": "launch"}
            | {"DDPCTX_LAUNCHER_PID": str(os.getpid())}
            | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
            id="ddpctx-launch-inside-srun",
        ),
        pytest.param(
            {k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_ID"} | STALE,
            id="slurm-batch-script-without-srun",
        ),
        pytest.param({**MPI, **TORCHRUN, "RANK": "3", "WORLD_SIZE": "4"}, id="copied-from-mpi"),
    ],
)
def test_launchers_that_really_combine_keep_working(environ: dict[str, str]) -> None:
    info = detect_launch(environ, pid=os.getpid())
    assert (info.rank, info.world_size) == (int(environ["RANK"]), int(environ["WORLD_SIZE"]))


def test_an_existing_group_is_described_whatever_stale_variables_say() -> None:
    assert detect_launch({**SLURM_TWO_TASKS, **STALE}, rendezvous=False).world_size == 1


@given(
    nodes=st.integers(1, 16),
    per_node=st.integers(1, 8),
    data=st.data(),
    markers=st.booleans(),
    launcher=st.sampled_from(["slurm", "mpi"]),
)
def test_every_consistent_per_node_launch_is_accepted(
    nodes: int, per_node: int, data: st.DataObject, markers: bool, launcher: str
) -> None:
    """srun/mpirun start one task per node, each a launcher of ``per_node`` env:// ranks."""
    node = data.draw(st.integers(0, nodes - 1))
    local = data.draw(st.integers(0, per_node - 1))
    environ = {
        "RANK": str(node * per_node + local),
        "WORLD_SIZE": str(nodes * per_node),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(per_node),
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    if markers:
        environ["TORCHELASTIC_RUN_ID"] = "job"
    if launcher == "slurm":
        environ |= {"SLURM_PROCID": str(node), "SLURM_NTASKS": str(nodes), "SLURM_STEP_ID": "0"}
    else:
        environ |= {"OMPI_COMM_WORLD_RANK": str(node), "OMPI_COMM_WORLD_SIZE": str(nodes)}
    assert detect_launch(environ).world_size == nodes * per_node


@given(tasks=st.integers(2, 64), data=st.data(), launcher=st.sampled_from(["slurm", "mpi"]))
def test_stale_single_process_variables_stop_every_task_of_a_larger_job(
    tasks: int, data: st.DataObject, launcher: str
) -> None:
    task = data.draw(st.integers(0, tasks - 1))
    if launcher == "slurm":
        environ = {"SLURM_PROCID": str(task), "SLURM_NTASKS": str(tasks), "SLURM_STEP_ID": "0"}
    else:
        environ = {"OMPI_COMM_WORLD_RANK": str(task), "OMPI_COMM_WORLD_SIZE": str(tasks)}
    with pytest.raises(ValueError, match="disagree with"):
        detect_launch({**environ, **STALE})


def _task_environ(launcher: str, task: int, tasks: int) -> dict[str, str]:
    if launcher == "slurm":
        return {"SLURM_PROCID": str(task), "SLURM_NTASKS": str(tasks), "SLURM_STEP_ID": "0"}
    return {"OMPI_COMM_WORLD_RANK": str(task), "OMPI_COMM_WORLD_SIZE": str(tasks)}


#: Leftovers next to stale RANK/WORLD_SIZE: none, a torchrun rank's marks, a launch rank's.
LEFTOVER_MARKS = {
    "none": {},
    "torchrun": {"TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0"},
    "launch": {"DDPCTX_LAUNCHER": "launch", "DDPCTX_LAUNCHER_PID": "1"},
}


def _accepting_tasks(tasks: int, launcher: str, stale: dict[str, str]) -> list[int]:
    """The tasks of a ``tasks``-task job, all given ``stale``, that would start training."""
    accepted, messages = [], []
    for task in range(tasks):
        try:
            detect_launch({**_task_environ(launcher, task, tasks), **stale}, pid=os.getpid())
        except ValueError as error:
            messages.append(str(error))
        else:
            accepted.append(task)
    names = f"RANK={stale['RANK']!r} WORLD_SIZE={stale['WORLD_SIZE']!r}"
    assert all("disagree with" in message and names in message for message in messages)
    return accepted


@given(
    tasks=st.integers(2, 12),
    world=st.integers(1, 40),
    data=st.data(),
    marks=st.sampled_from(sorted(LEFTOVER_MARKS)),
    launcher=st.sampled_from(["slurm", "mpi"]),
)
def test_stale_variables_stop_every_task_they_do_not_describe(
    tasks: int, world: int, data: st.DataObject, marks: str, launcher: str
) -> None:
    """The same stale RANK/WORLD_SIZE on every task of a job (what a stale copy is).

    Unmarked (or with a launch marker from another process), at most the one task they
    happen to describe starts; under leftover torchrun marks (a single-node world, as
    no LOCAL_WORLD_SIZE says otherwise) every task stops.
    """
    rank = data.draw(st.integers(0, world - 1))
    stale = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "10.0.0.1"}
    stale |= {"MASTER_PORT": "29500", **LEFTOVER_MARKS[marks]}
    accepted = _accepting_tasks(tasks, launcher, stale)
    if marks == "torchrun":
        assert accepted == []
    else:
        assert accepted == ([rank] if world == tasks else [])


@pytest.mark.parametrize("marks", sorted(LEFTOVER_MARKS))
@pytest.mark.parametrize("launcher", ["slurm", "mpi"])
def test_a_stale_rank_0_of_1_with_leftover_marks_stops_both_tasks_of_a_two_task_job(
    marks: str, launcher: str
) -> None:
    stale = {**STALE, **LEFTOVER_MARKS[marks]}
    assert _accepting_tasks(2, launcher, stale) == []


@pytest.mark.parametrize("launcher", ["slurm", "mpi"])
def test_a_stale_world_of_4_stops_both_tasks_of_a_two_task_job(launcher: str) -> None:
    stale = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert _accepting_tasks(2, launcher, stale) == []


def test_a_copied_single_node_torchrun_stops_every_task_by_its_agent_count() -> None:
    """A whole single-node torchrun rank's environment (4 ranks, 1 agent) in a 2-task job."""
    stale = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}
    stale |= {"GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    stale |= {"MASTER_PORT": "29500", **LEFTOVER_MARKS["torchrun"]}
    assert _accepting_tasks(2, "slurm", stale) == []
    with pytest.raises(ValueError, match=r"The launcher marks here .*TORCHELASTIC_RUN_ID='none'"):
        detect_launch({**_task_environ("slurm", 0, 2), **stale})


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_launch_made_for_this_process_is_trusted_inside_a_larger_job(world: int) -> None:
    """``launch(fn, world_size=...)`` called inside an srun task: its own local world."""
    environ = {**_task_environ("slurm", 5, 8), "RANK": "0", "WORLD_SIZE": str(world)}
    environ |= {"DDPCTX_LAUNCHER": "launch", "DDPCTX_LAUNCHER_PID": str(os.getpid())}
    environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert detect_launch(environ, pid=os.getpid()).world_size == world
    with pytest.raises(ValueError, match="DDPCTX_LAUNCHER='launch'"):
        detect_launch(environ, pid=os.getpid() + 1)  # the same variables in another process
