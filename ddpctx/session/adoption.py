"""Who this process is when ``distributed()`` finds a process group already formed.

``distributed()`` adopts a default process group that someone else
initialised -- ``mp.spawn`` with its own ``init_process_group``, a test
harness, Ray Train's ``TorchTrainer`` -- and never destroys it. Rank and
world size come from the group; the launcher and local ranks from the
environment when it agrees with the group. Otherwise (e.g. ``mp.spawn``
without ``RANK``) the group is taken to be one node.

Inside a Ray Train training function (:mod:`ddpctx.utils.raytrain`) the
place comes from Ray's context instead, checked against the group and
against the variables Ray sets; a Ray Train worker of several without a
group is refused, naming ``TorchTrainer``.

Example (no group and no Ray here: the environment alone decides):
    >>> launch_info({}).launcher
    'single'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

import torch
import torch.distributed as dist

from ddpctx.utils.env import LaunchInfo, detect_launch
from ddpctx.utils.raytrain import (
    ray_group_mismatch,
    ray_launch,
    ray_train_place,
    ray_without_group,
)


def launch_info(environ: Mapping[str, str]) -> LaunchInfo:
    """This process's place: from an existing group, a Ray Train worker, or the launcher."""
    place = ray_train_place()
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if place is not None:
            mismatch = ray_group_mismatch(place, rank, world_size)
            if mismatch is not None:
                raise RuntimeError(mismatch)
            return ray_launch(environ, place)
        return _adopted_from_environment(environ, rank, world_size)
    if place is not None:
        if place.world_size > 1:
            raise RuntimeError(ray_without_group(place))
        return ray_launch(environ, place)  # one worker: formed like a single process
    return detect_launch(environ, pid=os.getpid())


def check_backend(backend: str | None) -> str:
    """The adopted group's backend; a different ``backend=`` is an error naming both."""
    group_backend = str(dist.get_backend())
    if backend is not None and backend.lower() not in group_backend:
        raise ValueError(
            f"backend={backend!r} but the process group that was already initialised uses "
            f"{group_backend!r}. Drop backend= to adopt the existing group, or destroy it first."
        )
    return group_backend


def adopted_device_index(info: LaunchInfo, cuda_available: bool) -> int | None:
    """The CUDA device a Ray Train worker already has, or None to choose by local rank.

    Ray pins each worker's own GPU (``ray.train.torch.get_device()``) before the
    training function runs; with several GPUs per worker, or GPUs listed in
    another order, that is not ``cuda:<local_rank>``, so Ray's choice stands.
    """
    if info.launcher != "ray" or not cuda_available or not dist.is_initialized():
        return None
    return int(torch.cuda.current_device())


def _adopted_from_environment(environ: Mapping[str, str], rank: int, world_size: int) -> LaunchInfo:
    detected = detect_launch(environ, rendezvous=False)
    if (detected.rank, detected.world_size) == (rank, world_size):
        return detected
    return replace(
        detected,
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        local_world_size=world_size,
        node_rank=0,
    )
