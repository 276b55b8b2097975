"""A Ray Train worker: this process's place in the job, read from Ray's own context.

Ray Train's ``TorchTrainer`` starts one worker process per rank, forms the
default process group in each (``env://`` by default, ``tcp://`` with
``TorchConfig(init_method="tcp")``) and only then runs the user's training
function -- in a thread of the worker, not its main thread. It also sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
``NODE_RANK`` (not torchrun's ``GROUP_RANK``). ``distributed()`` in such a
function adopts Ray's group and reports ``launcher == "ray"``.

Ray is never imported here: importing it costs about a second, and a process
that has not imported ``ray.train`` is no Ray Train worker.
:func:`ray_train_place` asks ``ray.train.get_context()`` only when
``ray.train`` is already in ``sys.modules``; outside a training function
(the driver, a plain Ray task) Ray raises ``RuntimeError`` and this is None
(Ray Train v1 answers there instead, with made-up values: a v1 context
counts only inside a v1 training session).
:func:`ray_launch` is pure: it checks that the variables Ray sets agree with
Ray's context and describes the worker.

Example:
    >>> place = RayPlace(world_rank=1, world_size=2, local_rank=1,
    ...                  local_world_size=2, node_rank=0)
    >>> info = ray_launch({"RANK": "1", "WORLD_SIZE": "2"}, place)
    >>> (info.launcher, info.rank, info.world_size, info.local_rank)
    ('ray', 1, 2, 1)
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddpctx.utils.env import LaunchInfo


@dataclass(frozen=True)
class RayPlace:
    """What ``ray.train.get_context()`` says of this worker.

    >>> RayPlace(0, 1, 0, 1, 0).world_size
    1
    """

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int


def ray_train_place(modules: Mapping[str, Any] | None = None) -> RayPlace | None:
    """This worker's place from Ray Train's context, or None outside a training function.

    ``modules`` stands in for ``sys.modules`` (tests pass a fake ``ray.train``).

    >>> ray_train_place({}) is None  # ray.train not imported: not a Ray Train worker
    True
    """
    train = (sys.modules if modules is None else modules).get("ray.train")
    get_context = getattr(train, "get_context", None)
    if get_context is None:
        return None
    try:
        context = get_context()
    except RuntimeError:  # Ray's answer in the driver and in processes Ray Train did not start
        return None
    if _v1_outside_a_worker(context, sys.modules if modules is None else modules):
        return None
    return RayPlace(
        world_rank=int(context.get_world_rank()),
        world_size=int(context.get_world_size()),
        local_rank=int(context.get_local_rank()),
        local_world_size=int(context.get_local_world_size()),
        node_rank=int(context.get_node_rank()),
    )


def _v1_outside_a_worker(context: object, modules: Mapping[str, Any]) -> bool:
    """Ray Train v1 (the default before Ray 2.5x; ``RAY_TRAIN_V2_ENABLED=0``) answers
    outside a worker too, with a warning and made-up values (world size 1, local
    world size 0): a torchrun job that imports ``ray.train`` would be taken for a
    Ray worker. There, a v1 context counts only inside a v1 training session.
    """
    if type(context).__module__.startswith("ray.train.v2"):  # it raised outside a worker
        return False
    session = modules.get("ray.train._internal.session")
    get_session = getattr(session, "get_session", None)
    return get_session is None or get_session() is None


#: The variables Ray Train sets in each worker, and the context's value each must equal.
_RAY_VARIABLES = (
    ("RANK", "world_rank"),
    ("WORLD_SIZE", "world_size"),
    ("LOCAL_RANK", "local_rank"),
    ("LOCAL_WORLD_SIZE", "local_world_size"),
    ("NODE_RANK", "node_rank"),
)


def ray_launch(environ: Mapping[str, str], place: RayPlace) -> LaunchInfo:
    """Describe a Ray Train worker; a variable Ray sets that disagrees with its context is an error.

    Ray's context wins where a variable is unset (Ray Train v1 sets them only
    as training starts). A value that disagrees -- one exported into the
    workers by ``runtime_env={"env_vars": ...}`` or a job script, say -- is a
    ``ValueError`` naming it: ranks, shards and seeds would follow it.

    >>> ray_launch({"RANK": "0"}, RayPlace(1, 2, 1, 2, 0))
    Traceback (most recent call last):
    ...
    ValueError: RANK='0' but Ray Train's context says world_rank=1 for this worker ...
    """
    for name, field in _RAY_VARIABLES:
        raw = environ.get(name, "")
        expected = getattr(place, field)
        if raw.strip() != "" and raw.strip() != str(expected):
            raise ValueError(
                f"{name}={raw!r} but Ray Train's context says {field}={expected} for this "
                f"worker (ray.train.get_context().get_{field}()). Ray sets {name} itself; "
                f"a value exported into the workers (runtime_env env_vars, the job's "
                f"environment) overrides it wrongly. Unset {name} there."
            )
    return LaunchInfo(
        "ray",
        rank=place.world_rank,
        world_size=place.world_size,
        local_rank=place.local_rank,
        local_world_size=place.local_world_size,
        node_rank=place.node_rank,
    )


def ray_group_mismatch(place: RayPlace, rank: int, world_size: int) -> str | None:
    """Why the adopted process group is not Ray Train's, or None when it agrees.

    >>> ray_group_mismatch(RayPlace(0, 2, 0, 2, 0), rank=0, world_size=2) is None
    True
    """
    if (place.world_rank, place.world_size) == (rank, world_size):
        return None
    return (
        f"the process group already initialised here is rank {rank} of {world_size}, but "
        f"Ray Train's context says world_rank={place.world_rank} of "
        f"world_size={place.world_size}: it is not the group TorchTrainer formed. Leave "
        "Ray's group in place (don't destroy it or form another before distributed()), "
        "and let distributed() adopt it."
    )


def ray_without_group(place: RayPlace) -> str:
    """The error for a Ray Train worker of several that has no process group to adopt.

    >>> "TorchTrainer" in ray_without_group(RayPlace(0, 2, 0, 2, 0))
    True
    """
    return (
        f"this is Ray Train worker {place.world_rank} of world_size={place.world_size}, but "
        "no torch process group is initialised, and Ray gives no rendezvous address to "
        "form one. ray.train.torch.TorchTrainer forms the group before the training "
        "function runs: use it (not a framework-free DataParallelTrainer), and don't "
        "destroy its group (distributed() leaves it alive at exit)."
    )
