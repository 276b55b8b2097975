"""Two launchers' variables that disagree: an error naming both, never a silent choice.

:func:`ddpctx.utils.env.detect_launch` takes the first launcher it recognises,
and ``RANK`` / ``WORLD_SIZE`` come first. A stale ``RANK=0 WORLD_SIZE=1`` (an
``export`` in a shell profile, an environment copied from an earlier torchrun
with its ``TORCHELASTIC_RUN_ID``) would then silently turn every process of an
``srun`` or ``mpirun`` job into rank 0 of 1: each trains alone and all write
the same checkpoints. A stale ``WORLD_SIZE=4`` in a 2-task job would make one
process fail on a port in use and the other wait for the timeout.

Some combinations are real and must keep working:

- torchrun inside a SLURM allocation or an ``srun`` step: torchrun's ``RANK``
  and ``WORLD_SIZE`` next to the allocation's ``SLURM_*``. torchrun marks its
  ranks with ``TORCHELASTIC_RUN_ID`` / ``TORCHELASTIC_RESTART_COUNT``; its
  variables are then trusted (``SLURM_NTASKS`` may describe the allocation, not
  the tasks torchrun was started by) -- unless they describe a single-node
  world (``GROUP_WORLD_SIZE=1``, or no ``LOCAL_WORLD_SIZE`` smaller than
  ``WORLD_SIZE``) inside a multi-task step or ``mpirun``. That is the leftover
  of one torchrun run copied into every task (``RANK=0 WORLD_SIZE=1
  TORCHELASTIC_RUN_ID=none``), or tasks that each run a world of their own
  and write the same checkpoints: an error either way.
- ``ddpctx.launch`` and the pytest plugin inside a job: they set
  ``DDPCTX_LAUNCHER=launch`` and ``DDPCTX_LAUNCHER_PID`` (the rank's own
  process id) with the variables they hand their ranks. Those variables are
  trusted whole -- but only in the process they were set for: a copy read by
  another process is left over, and checked like unmarked ones.
- A per-node launcher started once per node by ``srun``/``mpirun`` (one task
  per node, N ranks each) that does not mark its ranks: ``SLURM_NTASKS`` is
  then the node count, ``LOCAL_WORLD_SIZE`` the ranks per node, the world
  their product and this task's block of ranks the one holding ``RANK``.
- Variables copied on purpose (``RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS``):
  they agree.

Anything else is an error, raised before any rendezvous, by every process: the
unmarked variables of a stale copy (the same on every task) describe another
world than the step's on every task but at most one. Known blind spots: a stale
copy that is itself a consistent per-node layout (``LOCAL_WORLD_SIZE`` and all)
passes on the one task whose block holds its ``RANK``, the others stop; a stale
copy of a multi-node torchrun rank passes on every task, as one process
cannot tell it from the real thing.

>>> check_launchers_agree({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0",
...                        "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"})
>>> check_launchers_agree({"RANK": "0", "WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "1",
...                        "OMPI_COMM_WORLD_SIZE": "2"})
Traceback (most recent call last):
...
ValueError: RANK='0' WORLD_SIZE='1' (env://, e.g. torchrun) disagree with ...
"""

from __future__ import annotations

from collections.abc import Mapping

#: Variables torchrun (torch.distributed.elastic) sets in every rank it starts.
TORCHRUN_MARKERS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")

#: Set next to ``DDPCTX_LAUNCHER=launch``: the process id of the rank it was set for.
LAUNCHER_PID_VARIABLE = "DDPCTX_LAUNCHER_PID"

#: Per launcher: (its name, its rank variable, its world-size variable, the variable
#: that says it is running now -- a SLURM batch script without srun is no launch).
_OTHERS = (
    ("an srun step (SLURM)", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_STEP_ID", "SLURM_STEPID")),
    ("Open MPI (mpirun)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ()),
)

#: What an env:// launcher sets, all of which a stale copy should lose.
_ENV_VARIABLES = (
    "RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE MASTER_ADDR "
    "MASTER_PORT TORCHELASTIC_RUN_ID TORCHELASTIC_RESTART_COUNT DDPCTX_LAUNCHER "
    "DDPCTX_LAUNCHER_PID"
)


def _integer(environ: Mapping[str, str], name: str) -> int | None:
    try:
        return int(environ.get(name, "").strip())
    except ValueError:
        return None  # a malformed value is reported by the launcher's own checks


def _launched_here(environ: Mapping[str, str], launcher_variable: str, pid: int | None) -> bool:
    """Whether ddpctx's own launcher set the env:// variables for this very process."""
    return (
        bool(launcher_variable)
        and environ.get(launcher_variable) == "launch"
        and pid is not None
        and environ.get(LAUNCHER_PID_VARIABLE, "").strip() == str(pid)
    )


def _torchrun_agents(environ: Mapping[str, str], world: int) -> int:
    """How many torchrun agents (nodes) the marked world spans, as its variables say."""
    agents = _integer(environ, "GROUP_WORLD_SIZE")
    if agents is not None:
        return agents
    per_node = _integer(environ, "LOCAL_WORLD_SIZE")
    return world // per_node if per_node else 1  # no LOCAL_WORLD_SIZE: one node, as env.py


def _agree(
    environ: Mapping[str, str], rank: int, world: int, their_rank: int, their_world: int
) -> bool:
    """Whether env:// (rank, world) can be this task's share of the other launcher's job."""
    if any(environ.get(name, "").strip() for name in TORCHRUN_MARKERS):
        return their_world == 1 or _torchrun_agents(environ, world) > 1
    if world == their_world:
        return rank == their_rank
    per_node = _integer(environ, "LOCAL_WORLD_SIZE")
    return (
        per_node is not None
        and per_node > 0
        and world == their_world * per_node
        and rank // per_node == their_rank
    )


def check_launchers_agree(
    environ: Mapping[str, str], launcher_variable: str = "", pid: int | None = None
) -> None:
    """Raise ``ValueError`` if env:// variables disagree with another launcher's (see above).

    ``launcher_variable`` is ddpctx's own marker (``DDPCTX_LAUNCHER``) and
    ``pid`` this process's id: a launch ddpctx made for this process is never a
    stale one. Without ``pid`` no such launch is recognised.
    """
    rank, world = _integer(environ, "RANK"), _integer(environ, "WORLD_SIZE")
    if rank is None or world is None:
        return
    if _launched_here(environ, launcher_variable, pid):
        return
    for name, rank_name, world_name, running in _OTHERS:
        their_rank, their_world = _integer(environ, rank_name), _integer(environ, world_name)
        if their_rank is None or their_world is None:
            continue
        if running and not any(environ.get(v, "").strip() for v in running):
            continue
        if _agree(environ, rank, world, their_rank, their_world):
            continue
        marks = [f"{m}={environ[m]!r}" for m in TORCHRUN_MARKERS if environ.get(m, "").strip()]
        if launcher_variable and environ.get(launcher_variable, "").strip():
            marks.append(f"{launcher_variable}={environ[launcher_variable]!r}")
        marked = (
            f"The launcher marks here ({', '.join(marks)}) cannot be this job's: a "
            f"single-node torchrun world is not what {name} runs on {their_world} tasks, nor "
            "is another process's ddpctx.launch"
            if marks
            else "No launcher that marks its ranks (torchrun sets TORCHELASTIC_RUN_ID) set the "
            "env:// ones here"
        )
        raise ValueError(
            f"RANK={environ['RANK']!r} WORLD_SIZE={environ['WORLD_SIZE']!r} (env://, e.g. "
            f"torchrun) disagree with {rank_name}={environ[rank_name]!r} "
            f"{world_name}={environ[world_name]!r} ({name}): this process would run as rank "
            f"{rank} of {world} while {name} started it as rank {their_rank} of {their_world}, "
            "and processes that think they are the same rank write the same checkpoints "
            "(or wait for peers that never come). "
            f"{marked}, so they are probably left over (an `export` in a shell profile or job "
            f"script, an environment copied from an earlier run). Unset them "
            f"(`unset {_ENV_VARIABLES}`) to use {name}'s, or set them to agree with it "
            f"(RANK=${rank_name} WORLD_SIZE=${world_name}, and then MASTER_ADDR and "
            f"MASTER_PORT too: agreeing env:// variables make it an env:// launch, with no "
            f"address taken from {name})."
        )
