"""Forming a process group on a store ddpctx owns, so that it never fails by chance.

For the groups ddpctx forms by itself -- a single process, the ranks of
``launch()`` and of the pytest plugin -- :func:`form_group` wraps
``init_process_group`` in two safeguards:

- **An agreement after formation.** gloo's ``connectFullMesh`` can return on
  one rank while its peer is still finishing the handshake; a rank that then
  destroys its group at once (a test body with no collective) closes the
  socket under the peer, which fails with "Connection closed by peer". Every
  rank therefore reports on the store how its formation went and waits for
  all the others before it returns: no rank leaves formation -- or tears its
  group down -- before every rank is connected.
- **A bounded retry.** Under CPU load gloo's mesh set-up also fails this way
  with plain torch (fork + ``FileStore`` + gloo). When the agreement says some
  rank failed with exactly ``connectFullMesh failed ... Connection closed by
  peer``, every rank drops what it formed and tries again, up to
  :data:`FORMATION_ATTEMPTS` times, under a fresh key prefix so that no stale
  address is read. The first retry is logged once, by rank 0, on its stderr (a plain
  print: a logging handler inherited from a forking parent would swallow it).

Any other error is raised as it is; a rank that formed the group while a peer
failed raises a short error naming that rank instead of returning with a
group that is missing a member. Groups formed through a launcher's store
(torchrun, SLURM, Open MPI) do not come here: their formation is the
launcher's business.

Example:
    >>> import torch.distributed as dist
    >>> form_group(dist.HashStore(), rank=0, world_size=1, backend="gloo")
    >>> dist.get_world_size()
    1
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

#: How many times a group is formed before gloo's mesh race is given up on.
FORMATION_ATTEMPTS = 3

_OK, _MESH_RACE, _FAILED = 0, 1, 1000  # per-rank outcome codes, summed in the store


def is_mesh_race(error: BaseException) -> bool:
    """True for exactly gloo's "connectFullMesh failed ... Connection closed by peer".

    >>> is_mesh_race(RuntimeError("Gloo connectFullMesh failed with [pair.cc:446] "
    ...                           "Connection closed by peer [127.0.0.1]:41203"))
    True
    >>> is_mesh_race(RuntimeError("Connection closed by peer"))
    False
    """
    text = str(error)
    return "connectFullMesh failed" in text and "Connection closed by peer" in text


def form_group(store: Any, *, rank: int, world_size: int, **init_kwargs: Any) -> None:
    """``init_process_group`` on ``store``, agreed on by every rank, retried on gloo's mesh race.

    ``init_kwargs`` go to ``init_process_group`` (backend, timeout, device_id).
    Returns once every rank has formed the group; raises the rank's own error,
    or a ``RuntimeError`` naming the failing rank when a peer failed.
    """
    for attempt in range(1, FORMATION_ATTEMPTS + 1):
        prefix = f"ddpctx/formation{attempt}/"
        error: BaseException | None = None
        try:
            dist.init_process_group(
                store=PrefixStore(prefix, store), rank=rank, world_size=world_size, **init_kwargs
            )
        except Exception as caught:  # reported to the peers, then raised below
            error = caught
        code = _OK if error is None else _MESH_RACE if is_mesh_race(error) else _FAILED
        total, failed_rank = _agree(store, prefix, rank, world_size, code)
        if total == _OK:
            return
        _drop_group()
        retry = total < _FAILED and attempt < FORMATION_ATTEMPTS
        if retry:
            if attempt == 1 and rank == 0:
                print(
                    f"ddpctx: gloo's connectFullMesh failed on rank {failed_rank} with "
                    "'Connection closed by peer' (a race in gloo under CPU load); retrying the "
                    "group formation with a fresh store prefix (at most "
                    f"{FORMATION_ATTEMPTS} attempts).",
                    file=sys.stderr,
                    flush=True,
                )
            continue
        if error is not None:
            raise error
        raise RuntimeError(
            f"rank {failed_rank} failed to form the process group (attempt {attempt} of "
            f"{FORMATION_ATTEMPTS}); this rank formed it and stops too. See rank "
            f"{failed_rank}'s error for the cause."
        )


def _agree(store: Any, prefix: str, rank: int, world_size: int, code: int) -> tuple[int, int]:
    """Wait for every rank's outcome; return (sum of the codes, the lowest failing rank or -1)."""
    if code != _OK:
        store.set(f"{prefix}failed{rank}", str(code))
    store.add(f"{prefix}codes", code)
    if store.add(f"{prefix}arrived", 1) == world_size:
        store.set(f"{prefix}all", "1")
    store.wait([f"{prefix}all"])
    total = int(store.add(f"{prefix}codes", 0))
    if total == _OK:
        return total, -1
    failing = [r for r in range(world_size) if store.check([f"{prefix}failed{r}"])]
    return total, min(failing, default=-1)


def _drop_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
