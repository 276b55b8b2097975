"""What is checked before any rank is forked: a world size this machine can hold, a clean parent.

Every check raises before the first ``fork``, naming the bad value and the
fix: a pool that fails halfway through forking has already cost the machine
what the check is there to spare it.

Example:
    >>> max_local_ranks() >= MIN_RANK_CAP
    True
"""

from __future__ import annotations

import multiprocessing
import os
import sys

#: The fewest local ranks :func:`max_local_ranks` allows, whatever the core count.
MIN_RANK_CAP = 64


def max_local_ranks() -> int:
    """The most ranks one pool forks: 8 per CPU core, at least :data:`MIN_RANK_CAP`.

    Oversubscribing a laptop to test 8- or 16-rank logic is normal; a typo such
    as ``world_size=100000`` would fork until the machine swaps to a halt.
    """
    return max(MIN_RANK_CAP, 8 * (os.cpu_count() or 1))


def check_before_forking(world_size: object) -> None:
    """Refuse a world size that is not a positive int or more than :func:`max_local_ranks`."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int, e.g. 2.")
    most = max_local_ranks()
    if world_size > most:
        raise ValueError(
            f"world_size={world_size} local ranks is more than this machine can hold: each "
            f"rank is a process with its own copy of torch, and ddpctx starts at most {most} "
            f"here (8 per CPU core, at least {MIN_RANK_CAP}). Pass world_size<={most}, or "
            "start a job that large with torchrun across nodes."
        )
    refuse_inherited_group()
    if "fork" not in multiprocessing.get_all_start_methods():
        raise RuntimeError(
            "ddpctx starts ranks by forking, which this platform does not offer "
            f"({sys.platform}). Use torchrun to start the ranks instead."
        )


def refuse_inherited_group() -> None:
    """Refuse to fork ranks from a process that has a process group of its own.

    Forked ranks would inherit the caller's group (and its ``distributed()``
    context) and block destroying it, or form theirs beside it.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    raise RuntimeError(
        f"launch() was called while this process is rank {dist.get_rank()} of a process "
        f"group of {dist.get_world_size()} (inside `with distributed()`, after setup_ddp() "
        "or init_process_group()); ranks forked from it would inherit that group. Call "
        "launch() outside the `with distributed()` block, or after cleanup_ddp() / "
        "torch.distributed.destroy_process_group()."
    )
