"""``DistContext``: the object ``with distributed() as ctx`` gives, made of one face per subsystem.

Each face lives beside the subsystem it fronts and is a thin layer over it:

- :class:`~ddpctx.reduce.faces.CollectiveFaces`: ``barrier``, ``all_reduce``,
  ``broadcast``, ``all_gather``, ``any``, ``all``.
- :class:`~ddpctx.rankzero.faces.RankZeroFaces`: ``rank_zero_first``,
  ``rank_zero``, ``atomic_dir``, ``progress``, ``print``, ``is_main``.
- :class:`~ddpctx.data.faces.DataFaces`: ``dataloader``, ``epochs``.
- :class:`~ddpctx.parallel.faces.ModelFaces`: ``wrap``, ``shard``, ``unwrap``, ``no_sync``,
  ``accumulate``, ``precision``, ``autocast``, ``scaler``, ``clip_grad_norm_``,
  ``full_state_dict``, ``mesh``, ``parallel_mesh``.
- :class:`~ddpctx.checkpoint.faces.CheckpointFaces`: ``save``, ``load``,
  ``save_checkpoint``, ``load_checkpoint``.
- :class:`~ddpctx.watch.faces.WatchFaces`: ``log``, ``log_config``, ``timings``, ``profile``.

This module only names the run's facts (rank, device, seed, ...) and joins
the faces; :mod:`ddpctx.session.context` makes the object.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ddpctx.checkpoint.faces import CheckpointFaces
from ddpctx.checkpoint.pending import Pending
from ddpctx.checkpoint.writerlock import Claims
from ddpctx.data.book import LoaderBook
from ddpctx.data.faces import DataFaces
from ddpctx.parallel.faces import ModelFaces
from ddpctx.parallel.precision import Precision
from ddpctx.rankzero.faces import RankZeroFaces
from ddpctx.reduce.collectives import Site
from ddpctx.reduce.faces import CollectiveFaces
from ddpctx.utils.env import Launcher, LaunchInfo
from ddpctx.watch.faces import WatchFaces


class DistContext(
    CollectiveFaces, RankZeroFaces, DataFaces, ModelFaces, CheckpointFaces, WatchFaces
):
    """This process's place in the run, and the operations that need it.

    Made by :func:`distributed`; read its attributes, don't build one yourself.

    Attributes:
        rank (int): global rank, from 0 to ``world_size - 1``.
        world_size (int): number of processes in the run.
        local_rank (int): rank within this node.
        local_world_size (int): number of processes on this node.
        node_rank (int): index of this node.
        device (torch.device): ``cuda:<local_rank>`` (under Ray: the GPU Ray gave the
            worker) or ``cpu``.
        backend (str): ``"nccl"``, ``"gloo"``, ...
        launcher (str): ``"torchrun"``, ``"slurm"``, ``"mpi"``, ``"launch"``
            (``ddpctx.launch`` and the pytest plugin), ``"ray"`` (a Ray Train
            ``TorchTrainer`` worker) or ``"single"``.
        seed (int | None): this rank's effective seed (``seed + rank``) or None.
        base_seed (int | None): the ``seed`` given to ``distributed()``, the same on every rank.
        is_main (bool): rank 0 of the run.
        is_local_main (bool): local rank 0 of this node.
        restart_count (int): how often an elastic launcher restarted the job.

    Example:
        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     (ctx.is_main, ctx.local_world_size, ctx.node_rank)
        (True, 1, 0)
    """

    def __init__(
        self,
        info: LaunchInfo,
        backend: str,
        device: torch.device,
        seed: int | None,
        close: Callable[[], None],
        precision: Precision | None = None,
    ) -> None:
        self.rank: int = info.rank
        self.world_size: int = info.world_size
        self.local_rank: int = info.local_rank
        self.local_world_size: int = info.local_world_size
        self.node_rank: int = info.node_rank
        self.launcher: Launcher = info.launcher
        self.restart_count: int = info.restart_count
        self.backend: str = backend
        self.device: torch.device = device
        self.base_seed: int | None = seed
        self.seed: int | None = None if seed is None else seed + info.rank
        self._close = close
        self._sites: dict[str, Site] = {}
        self._loader_book = LoaderBook()
        self._newest_checkpoints: dict[Path, str] = {}
        self._pending = Pending.none()
        self._writer_claims = Claims()  # checkpoint directories rank 0 holds; let go at the end
        self._precision = precision or Precision("32", device.type)
        self._mesh = None
        self._parallel_meshes = {}
        self._scaler = None

    def __repr__(self) -> str:
        return (
            f"DistContext(rank={self.rank}, world_size={self.world_size}, "
            f"local_rank={self.local_rank}, device={str(self.device)!r}, "
            f"backend={self.backend!r}, launcher={self.launcher!r}, seed={self.seed})"
        )
