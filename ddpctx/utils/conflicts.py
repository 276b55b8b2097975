"""Two launchers' variables that disagree: an error naming both, never a silent choice.

:func:`ddpctx.utils.env.detect_launch` takes the first launcher it recognises,
and ``RANK`` / ``WORLD_SIZE`` come first. A stale ``RANK=0 WORLD_SIZE=1`` (an
``export`` in a shell profile, an environment copied from an earlier torchrun)
would then silently turn every process of an ``srun`` or ``mpirun`` job into
rank 0 of 1: each trains alone and all write the same checkpoints.

Some combinations are real and must keep working:

- torchrun inside a SLURM allocation or an ``srun`` step: torchrun's ``RANK``
  and ``WORLD_SIZE`` next to the allocation's ``SLURM_*``. torchrun marks its
  ranks with ``TORCHELASTIC_RUN_ID`` / ``TORCHELASTIC_RESTART_COUNT``; its
  variables are then trusted.
- ``ddpctx.launch`` and the pytest plugin inside a job: they set
  ``DDPCTX_LAUNCHER=launch`` with the variables they hand their ranks.
- A per-node launcher started once per node by ``srun``/``mpirun`` (one task
  per node, N ranks each): ``SLURM_NTASKS`` is then the node count, and the
  env:// world is at least as large.
- Variables copied on purpose (``RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS``):
  they agree.

So the env:// variables of a launch that no known launcher marked as its own
conflict with an ``srun`` step's (or Open MPI's) when they describe fewer ranks
than the job has tasks, or the same number with another rank for this process.

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

#: Per launcher: (its name, its rank variable, its world-size variable, the variable
#: that says it is running now -- a SLURM batch script without srun is no launch).
_OTHERS = (
    ("an srun step (SLURM)", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_STEP_ID", "SLURM_STEPID")),
    ("Open MPI (mpirun)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", ()),
)

#: What an env:// launcher sets, all of which a stale copy should lose.
_ENV_VARIABLES = "RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT"


def _integer(environ: Mapping[str, str], name: str) -> int | None:
    try:
        return int(environ.get(name, "").strip())
    except ValueError:
        return None  # a malformed value is reported by the launcher's own checks


def check_launchers_agree(environ: Mapping[str, str], launcher_variable: str = "") -> None:
    """Raise ``ValueError`` if env:// variables disagree with another launcher's (see above).

    ``launcher_variable`` is ddpctx's own marker (``DDPCTX_LAUNCHER``): a launch
    it made is never a stale one.
    """
    rank, world = _integer(environ, "RANK"), _integer(environ, "WORLD_SIZE")
    if rank is None or world is None:
        return
    if any(environ.get(name, "").strip() for name in TORCHRUN_MARKERS):
        return
    if launcher_variable and environ.get(launcher_variable) == "launch":
        return
    for name, rank_name, world_name, running in _OTHERS:
        their_rank, their_world = _integer(environ, rank_name), _integer(environ, world_name)
        if their_rank is None or their_world is None:
            continue
        if running and not any(environ.get(v, "").strip() for v in running):
            continue
        if world > their_world or (world == their_world and rank == their_rank):
            continue
        raise ValueError(
            f"RANK={environ['RANK']!r} WORLD_SIZE={environ['WORLD_SIZE']!r} (env://, e.g. "
            f"torchrun) disagree with {rank_name}={environ[rank_name]!r} "
            f"{world_name}={environ[world_name]!r} ({name}): this process would run as rank "
            f"{rank} of {world} while {name} started it as rank {their_rank} of {their_world}, "
            "and processes that think they are the same rank write the same checkpoints. "
            "No launcher that marks its ranks (torchrun sets TORCHELASTIC_RUN_ID) set the "
            "env:// ones here, so they are probably left over (an `export` in a shell "
            f"profile or job script). Unset them (`unset {_ENV_VARIABLES}`) to use "
            f"{name}'s, or set them to agree with it (RANK=${rank_name} "
            f"WORLD_SIZE=${world_name}, and then MASTER_ADDR and MASTER_PORT too: agreeing "
            f"env:// variables make it an env:// launch, with no address taken from {name})."
        )
