"""Read and validate what the launcher put in the environment.

Everything here is pure: functions take a mapping of environment variables
(and, where CUDA matters, the facts about CUDA) and return plain values or
raise. Nothing is imported from torch, nothing is read from ``os.environ``
behind the caller's back, nothing is opened. That makes every launcher and
every bad value testable in-process.

Why one module (a little over 400 lines): the three launchers' variables
are validated by the same rules with the same error wording; kept together,
one reader can check that torchrun, SLURM and Open MPI are treated alike.
SLURM's list syntax is parsed in :mod:`ddpctx.utils.hostlist`.

Detection order (first match wins):

1. torchrun or any ``env://`` launcher: ``RANK`` / ``WORLD_SIZE`` (with
   ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``,
   ``MASTER_PORT``).
2. SLURM, inside an ``srun`` step: ``SLURM_PROCID`` / ``SLURM_NTASKS`` plus a
   step id. A batch script that runs ``python train.py`` directly (no
   ``srun``) also carries ``SLURM_PROCID`` and ``SLURM_NTASKS``; treating it
   as a member of an N-task group would wait forever for peers that never
   start, so without a step id it is a single process.
3. Open MPI: ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE``.
4. Otherwise a single process (world size 1).

Before the first rule is taken, env:// variables that disagree with an
``srun`` step's or Open MPI's are an error naming both sets
(:mod:`ddpctx.utils.conflicts`): a stale ``RANK=0 WORLD_SIZE=1`` (with or
without a leftover torchrun or ddpctx marker) would otherwise make every task
of the job rank 0 of 1.

Example:
    >>> info = detect_launch({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
    ...                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    >>> (info.launcher, info.rank, info.world_size, info.local_rank)
    ('torchrun', 1, 2, 1)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

from ddpctx.utils.conflicts import check_launchers_agree
from ddpctx.utils.hostlist import parse_nodelist, parse_tasks_per_node

Launcher = Literal["torchrun", "slurm", "mpi", "launch", "ray", "single"]

#: Set by ``ddpctx.launch`` and the pytest plugin in their ranks: the env://
#: variables there come from ddpctx, and ``ctx.launcher`` says ``"launch"``.
LAUNCHER_VARIABLE = "DDPCTX_LAUNCHER"

#: Collective timeout when neither ``timeout=`` nor ``DDPCTX_TIMEOUT`` says otherwise.
#: Ten minutes: long enough for rank 0 to write a multi-gigabyte checkpoint to a
#: slow shared filesystem while the others wait at the barrier, short enough that
#: a rank stuck in a collective ends the job well before torch's own 30 minutes.
DEFAULT_TIMEOUT = timedelta(minutes=10)

#: The accepted range of a timeout, in seconds: a millisecond to a year.
MIN_TIMEOUT_S = 0.001
MAX_TIMEOUT_S = 365 * 24 * 3600.0

#: Backends ddpctx knows how to pin a device for.
KNOWN_BACKENDS = ("gloo", "nccl", "mpi", "ucc")

_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 20000


@dataclass(frozen=True)
class LaunchInfo:
    """Who this process is in the job, as the launcher described it.

    ``master_addr``/``master_port`` are None where the process group is formed
    without a network rendezvous (a single process) or where torch reads them
    itself (``env://``). ``master_addr_from`` names where the address was read,
    for error messages: ``"MASTER_ADDR"``, or the SLURM node list it is the
    first host of (``"SLURM_JOB_NODELIST='node[01-02]'"``).
    """

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    master_addr_from: str = field(default="MASTER_ADDR", compare=False)


def _read_int(environ: Mapping[str, str], name: str, fix: str, minimum: int = 0) -> int:
    raw = environ[name]
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer. {fix}") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be >= {minimum}. {fix}")
    return value


def _optional_int(
    environ: Mapping[str, str], name: str, default: int, fix: str, minimum: int = 0
) -> int:
    if environ.get(name, "").strip() == "":
        return default
    return _read_int(environ, name, fix, minimum)


def _check_ranks(
    launcher: str,
    names: tuple[str, str, str, str],
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    fix: str,
) -> None:
    rank_name, world_name, local_name, local_world_name = names
    if rank >= world_size:
        raise ValueError(
            f"{rank_name}={rank} is not below {world_name}={world_size} ({launcher}): "
            f"ranks run from 0 to {world_name}-1. {fix}"
        )
    if local_world_size > world_size:
        raise ValueError(
            f"{local_world_name}={local_world_size} exceeds {world_name}={world_size} "
            f"({launcher}): a node cannot hold more processes than the job. {fix}"
        )
    if local_rank >= local_world_size:
        raise ValueError(
            f"{local_name}={local_rank} is not below {local_world_name}={local_world_size} "
            f"({launcher}): local ranks run from 0 to {local_world_name}-1. {fix}"
        )


def detect_launch(
    environ: Mapping[str, str], rendezvous: bool = True, pid: int | None = None
) -> LaunchInfo:
    """Work out the launcher and this process's place in the job.

    Raises ``ValueError`` naming the variable, its value and the fix for any
    inconsistent or malformed value. ``rendezvous=False`` skips the checks of
    rank 0's address and of conflicting launchers, for a process group that
    already exists (its own rank and size win). ``pid`` is this process's id
    (``os.getpid()``): ``ddpctx.launch``'s variables are trusted only in the
    process they were set for.
    """
    if rendezvous:
        check_launchers_agree(environ, LAUNCHER_VARIABLE, pid)
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return _detect_env(environ, rendezvous)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ and _in_slurm_step(environ):
        return _detect_slurm(environ)
    if "OMPI_COMM_WORLD_RANK" in environ or "OMPI_COMM_WORLD_SIZE" in environ:
        return _detect_mpi(environ)
    return LaunchInfo("single", rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0)


def _detect_env(environ: Mapping[str, str], rendezvous: bool) -> LaunchInfo:
    fix = (
        "torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE itself: launch with "
        "`torchrun --nproc_per_node=N script.py`, or unset them all to run one process."
    )
    for present, missing in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if present in environ and missing not in environ:
            raise ValueError(
                f"{present}={environ[present]!r} is set but {missing} is not: an env:// "
                f"launcher must set both. {fix}"
            )
    rank = _read_int(environ, "RANK", fix)
    world_size = _read_int(environ, "WORLD_SIZE", fix, minimum=1)
    # A launcher that sets only RANK and WORLD_SIZE is taken as one node.
    local_world_size = _optional_int(environ, "LOCAL_WORLD_SIZE", world_size, fix, minimum=1)
    local_rank = _optional_int(environ, "LOCAL_RANK", rank % local_world_size, fix)
    _check_ranks(
        "torchrun/env://",
        ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        rank,
        world_size,
        local_rank,
        local_world_size,
        fix,
    )
    node_rank = _optional_int(environ, "GROUP_RANK", rank // local_world_size, fix)
    master_addr: str | None = None
    master_port: int | None = None
    if world_size > 1 and rendezvous:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if environ.get(name, "").strip() == "":
                raise ValueError(
                    f"{name} is not set but WORLD_SIZE={world_size}: ranks need the address "
                    f"and port of rank 0 to meet. Set MASTER_ADDR and MASTER_PORT, or launch "
                    f"with torchrun, which sets them."
                )
        master_addr = _read_address(environ, "MASTER_ADDR")
        master_port = _read_port(environ, "MASTER_PORT")
    restarts = _optional_int(environ, "TORCHELASTIC_RESTART_COUNT", 0, fix)
    return LaunchInfo(
        "launch" if environ.get(LAUNCHER_VARIABLE) == "launch" else "torchrun",
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        restart_count=restarts,
    )


def _read_address(environ: Mapping[str, str], name: str) -> str:
    """A host name or address, checked by the same rules on every launcher path.

    env:// takes the variable verbatim, so ``"127.0.0.1 "`` (what ``$(hostname
    -I)`` gives) would be looked up with its space and never reached, and
    ``"127.0.0.1 127.0.0.2"`` names two hosts: refused. A bracketed IPv6
    address (``[::1]``, URL syntax) is not a host name to the store: refused
    with the bare address as the fix, instead of a rendezvous timeout.

    >>> _read_address({"MASTER_ADDR": "::1"}, "MASTER_ADDR")
    '::1'
    """
    raw = environ[name]
    address = raw.strip()
    if raw != address or any(c.isspace() for c in address):
        raise ValueError(
            f"{name}={raw!r} contains whitespace, which torch would take as part of the host "
            f"name: no rank could reach it. Set {name}={address.split()[0]!r} (one address, "
            "no spaces)."
        )
    if address.startswith("[") or address.endswith("]"):
        raise ValueError(
            f"{name}={raw!r} is an address in URL brackets, which the rendezvous store "
            f"cannot resolve (every rank would time out). Set {name}={address.strip('[]')!r} "
            "(an IPv6 address without brackets)."
        )
    return address


def _read_port(environ: Mapping[str, str], name: str) -> int:
    fix = f"Set {name} to a free TCP port between 1 and 65535 (e.g. 29500)."
    port = _read_int(environ, name, fix, minimum=1)
    if port > 65535:
        raise ValueError(f"{name}={environ[name]!r} is not a TCP port. {fix}")
    return port


def _is_set(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip() != ""


def _first_set(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if environ.get(name, "").strip()), None)


def _in_slurm_step(environ: Mapping[str, str]) -> bool:
    return _first_set(environ, ("SLURM_STEP_ID", "SLURM_STEPID")) is not None


def _detect_slurm(environ: Mapping[str, str]) -> LaunchInfo:
    fix = "srun sets these for every task; run the script with `srun python script.py`."
    rank = _read_int(environ, "SLURM_PROCID", fix)
    world_size = _read_int(environ, "SLURM_NTASKS", fix, minimum=1)
    node_rank = _optional_int(environ, "SLURM_NODEID", 0, fix)
    local_rank = _optional_int(environ, "SLURM_LOCALID", 0, fix)
    local_world_size = world_size
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if environ.get(name, "").strip():
            per_node = parse_tasks_per_node(environ[name], name)
            if node_rank >= len(per_node):
                raise ValueError(
                    f"SLURM_NODEID={node_rank} but {name}={environ[name]!r} describes only "
                    f"{len(per_node)} node(s). {fix}"
                )
            local_world_size = per_node[node_rank]
            break
    else:
        if environ.get("SLURM_NTASKS_PER_NODE", "").strip():
            local_world_size = _read_int(environ, "SLURM_NTASKS_PER_NODE", fix, minimum=1)
    _check_ranks(
        "slurm",
        ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "tasks on this node"),
        rank,
        world_size,
        local_rank,
        local_world_size,
        fix,
    )
    master_addr: str | None = None
    master_port: int | None = None
    master_addr_from = "MASTER_ADDR"
    if world_size > 1:
        master_addr = (
            _read_address(environ, "MASTER_ADDR") if _is_set(environ, "MASTER_ADDR") else None
        )
        if master_addr is None:
            nodelist_name = _first_set(
                environ, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            )
            if nodelist_name is None:
                raise ValueError(
                    "Neither MASTER_ADDR nor SLURM_JOB_NODELIST is set, so rank 0's host is "
                    "unknown. Set MASTER_ADDR to the first host of the allocation."
                )
            master_addr = parse_nodelist(environ[nodelist_name], nodelist_name)[0]
            master_addr_from = f"{nodelist_name}={environ[nodelist_name]!r}"
        if environ.get("MASTER_PORT", "").strip():
            master_port = _read_port(environ, "MASTER_PORT")
        else:
            job_id_name = _first_set(environ, ("SLURM_JOB_ID", "SLURM_JOBID"))
            if job_id_name is None:
                raise ValueError(
                    "Neither MASTER_PORT nor SLURM_JOB_ID is set, so no rendezvous port can be "
                    "derived. Set MASTER_PORT to a free TCP port (e.g. 29500)."
                )
            job_id = _read_int(environ, job_id_name, "Set MASTER_PORT explicitly instead.")
            master_port = slurm_port(job_id)
    restarts = _optional_int(environ, "SLURM_RESTART_COUNT", 0, fix)
    return LaunchInfo(
        "slurm",
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        restart_count=restarts,
        master_addr_from=master_addr_from,
    )


def slurm_port(job_id: int) -> int:
    """The rendezvous port for a SLURM job: stable per job, spread across jobs.

    >>> slurm_port(123456)
    18456
    """
    return _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN


def _detect_mpi(environ: Mapping[str, str]) -> LaunchInfo:
    fix = "mpirun sets these for every process; run the script with `mpirun -np N python ...`."
    for present, missing in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ):
        if present in environ and missing not in environ:
            raise ValueError(f"{present}={environ[present]!r} is set but {missing} is not. {fix}")
    rank = _read_int(environ, "OMPI_COMM_WORLD_RANK", fix)
    world_size = _read_int(environ, "OMPI_COMM_WORLD_SIZE", fix, minimum=1)
    local_world_size = _optional_int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", world_size, fix, 1)
    local_rank = _optional_int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", rank % local_world_size, fix)
    _check_ranks(
        "mpi",
        (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        rank,
        world_size,
        local_rank,
        local_world_size,
        fix,
    )
    master_addr: str | None = None
    master_port: int | None = None
    if world_size > 1:
        master_addr = (
            _read_address(environ, "MASTER_ADDR") if _is_set(environ, "MASTER_ADDR") else None
        )
        if master_addr is None:
            raise ValueError(
                f"MASTER_ADDR is not set but OMPI_COMM_WORLD_SIZE={world_size}: Open MPI does "
                "not tell a process where rank 0 runs. Export it to every rank, e.g. "
                "`mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...`."
            )
        master_port = _read_port(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else 29500
    return LaunchInfo(
        "mpi",
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=rank // local_world_size,
        master_addr=master_addr,
        master_port=master_port,
    )


def resolve_timeout(timeout: float | timedelta | None, environ: Mapping[str, str]) -> timedelta:
    """The collective timeout: ``timeout=`` wins, then ``DDPCTX_TIMEOUT`` (seconds).

    >>> resolve_timeout(90, {})
    datetime.timedelta(seconds=90)
    """
    if timeout is None:
        if environ.get("DDPCTX_TIMEOUT", "").strip() == "":
            return DEFAULT_TIMEOUT
        raw = environ["DDPCTX_TIMEOUT"]
        try:
            seconds = float(raw)
        except ValueError:
            raise ValueError(
                f"DDPCTX_TIMEOUT={raw!r} is not a number of seconds. Set it to e.g. 600, "
                "or unset it for the default of 10 minutes."
            ) from None
        return check_timeout(seconds, f"DDPCTX_TIMEOUT={raw!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise ValueError(
            f"timeout={timeout!r} is not a number of seconds or a datetime.timedelta. "
            "Pass e.g. timeout=600 or timeout=timedelta(minutes=10)."
        )
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return check_timeout(seconds, f"timeout={timeout!r}")


def check_timeout(seconds: float, setting: str) -> timedelta:
    """``seconds`` as a timedelta, if within what torch and gloo accept; else a ValueError.

    ``setting`` names where the value came from, e.g. ``"timeout=inf"``.

    >>> check_timeout(90, "timeout=90")
    datetime.timedelta(seconds=90)
    """
    if not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:  # also refuses NaN
        raise ValueError(
            f"{setting} is outside the accepted range of {MIN_TIMEOUT_S} s to "
            f"{MAX_TIMEOUT_S:.0f} s (365 days): torch keeps timeouts as milliseconds, and "
            "an endless wait is what the timeout exists to prevent. Pass e.g. 600 (10 "
            "minutes), or leave it unset for the default."
        )
    return timedelta(seconds=seconds)


def resolve_backend(requested: str | None, cuda_available: bool) -> str:
    """``nccl`` with CUDA, else ``gloo``; an explicit choice is checked and wins.

    >>> resolve_backend(None, cuda_available=False)
    'gloo'
    """
    if requested is None:
        return "nccl" if cuda_available else "gloo"
    if not isinstance(requested, str) or requested.lower() not in KNOWN_BACKENDS:
        raise ValueError(
            f"backend={requested!r} is not a known backend. Use one of "
            f"{', '.join(repr(b) for b in KNOWN_BACKENDS)}, or leave it unset to get 'nccl' "
            "with CUDA and 'gloo' without."
        )
    backend = requested.lower()
    if backend == "nccl" and not cuda_available:
        raise RuntimeError(
            "backend='nccl' needs CUDA, but torch.cuda.is_available() is False here. Use "
            "backend='gloo' (or leave backend unset) to run on the CPU, or run on a GPU node."
        )
    return backend


def resolve_device_index(
    info: LaunchInfo, cuda_available: bool, cuda_device_count: int, visible: str | None
) -> int | None:
    """The CUDA device this rank pins (``LOCAL_RANK``), or None for the CPU.

    ``visible`` is ``CUDA_VISIBLE_DEVICES`` as set, for the error message only.
    """
    if not cuda_available:
        return None
    if info.local_rank >= cuda_device_count:
        shown = "unset" if visible is None else repr(visible)
        raise RuntimeError(
            f"LOCAL_RANK={info.local_rank} but only {cuda_device_count} CUDA device(s) are "
            f"visible (CUDA_VISIBLE_DEVICES={shown}). Start at most {cuda_device_count} "
            f"process(es) per node (torchrun --nproc_per_node={cuda_device_count}), or make "
            "more devices visible."
        )
    return info.local_rank
