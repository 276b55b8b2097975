"""Checkpoints' face on :class:`~ddpctx.DistContext`: save/load a file, save/load a run.

:class:`CheckpointFaces` is mixed into ``DistContext``; the work is in
:mod:`ddpctx.checkpoint.resume` (a whole run) and :mod:`ddpctx.utils.atomic`
(one file).

``save_checkpoint``, ``load_checkpoint`` and ``finish_checkpoint`` (of a save
in flight) concern every rank: each rank's random state, loader positions,
replica or shards. Called where the other ranks cannot join (rank-zero-only
work, another thread, a DataLoader worker) they are refused at once, naming the
call (:mod:`ddpctx.reduce.guard`), on every rank through the rank-zero block's
outcome: a load there restored rank 0 alone (its replica then left the others'),
and a sharded one waited for the collective timeout.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpctx.checkpoint import resume, sharded, shardload
from ddpctx.checkpoint.files import load_file
from ddpctx.checkpoint.pending import Pending
from ddpctx.checkpoint.writefailures import written_by_rank_zero
from ddpctx.checkpoint.writerlock import Claims
from ddpctx.data.book import LoaderBook
from ddpctx.reduce.guard import check_caller
from ddpctx.utils.atomic import atomic_save
from ddpctx.utils.identity import Place


def checkpoint_directory(directory: str | os.PathLike[str], method: str) -> Path:
    """``directory`` as a path, refused by name where a file stands in its place.

    (``load_checkpoint`` says more: a checkpoint file given for its directory is
    named as such, in :func:`ddpctx.checkpoint.files.refuse_a_file`.)

    >>> checkpoint_directory("runs/ckpt", "save_checkpoint")
    PosixPath('runs/ckpt')
    """
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(
            f"ctx.{method}({str(directory)!r}): {str(path)!r} is a file, not a directory; "
            "checkpoints are saved into a directory, one file or folder per checkpoint. "
            f"Pass a directory (e.g. {str(path.with_suffix('')) + '_checkpoints'!r}), or move "
            "the file away."
        )
    return path


class CheckpointFaces:
    """``ctx.save``, ``ctx.load``, ``ctx.save_checkpoint``, ``ctx.load_checkpoint``."""

    device: torch.device
    base_seed: int | None
    all_gather: Callable[[Any], list[Any]]
    _place: Callable[[], Place]
    _loader_book: LoaderBook
    _newest_checkpoints: dict[Path, str]
    _pending: Pending
    _writer_claims: Claims
    #: Meta a save records for the session (the metrics trail's last step), after flushing it.
    _before_save: Callable[[], dict[str, Any]] | None = None
    #: Told the meta a load returns (None: no checkpoint); takes out what :attr:`_before_save` put.
    _after_load: Callable[[dict[str, Any] | None], None] | None = None

    def save(self, obj: Any, path: str | os.PathLike[str]) -> None:
        """Rank 0 writes ``obj`` atomically (temporary file, fsync, rename); every rank waits.

        A failed write raises on every rank: an ``OSError`` (a full disk, a
        read-only or missing directory) as the same ``OSError`` everywhere,
        anything else as :class:`~ddpctx.RankZeroError` on the others.

        >>> from ddpctx import distributed
        >>> import tempfile, os
        >>> with distributed() as ctx:
        ...     ctx.save({"step": 1}, os.path.join(tempfile.mkdtemp(), "state.pt"))
        """
        written_by_rank_zero(self._place(), lambda: atomic_save(obj, Path(path)))

    def load(self, path: str | os.PathLike[str], weights_only: bool = True) -> Any:
        """Load ``path`` on every rank, tensors mapped to :attr:`device`.

        ``weights_only=True`` (the default) refuses pickled code; pass False
        only for files you trust.
        """
        return load_file(Path(path), self.device, weights_only)

    def save_checkpoint(
        self,
        directory: str | os.PathLike[str],
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        extra: dict[str, Any] | None = None,
        rank_state: dict[str, Any] | None = None,
        step: int | None = None,
        keep: int = 2,
        async_save: bool = False,
        **meta: Any,
    ) -> Path:
        """Save the training state, every rank's random state and every loader's position.

        Writes a new checkpoint named for its epoch and step (see
        :mod:`ddpctx.checkpoint.files`), keeps the newest ``keep`` (a save with
        the same epoch and step replaces the older one), and returns its
        path on every rank. ``scaler`` (AMP) is saved too. ``extra`` (name ->
        object with ``state_dict``) is **rank 0's** state, one copy that
        every rank loads: use it for what is the same on every rank.
        ``rank_state`` (name -> object with ``state_dict``, or a
        ``random.Random`` / NumPy / torch generator) is saved on **every**
        rank and restored to the same rank (see :mod:`ddpctx.checkpoint.perrank`).
        ``meta`` (e.g. ``epoch=3``) comes back from :meth:`load_checkpoint`;
        NumPy values, paths and namespaces are converted, anything that would
        not load is refused here (see :mod:`ddpctx.checkpoint.meta`). Call it every
        K steps with ``step=`` to resume mid-epoch. Another job writing
        checkpoints into the same directory is refused, naming it: rank 0
        holds the directory's writer lock until the block ends
        (:mod:`ddpctx.checkpoint.writerlock`). A sharded
        model (``ctx.shard``, or FSDP2 applied by hand) is saved as a directory
        in which every rank writes its shards (:mod:`ddpctx.checkpoint.sharded`),
        with the same promises;
        ``async_save=True`` writes it while training goes on and publishes it
        at the next save or load, :meth:`finish_checkpoint`, or the end of
        the block (:mod:`ddpctx.checkpoint.pending`). Every rank calls it, outside
        rank-zero-only work (refused there, see the module docstring).
        """
        check_caller("ctx.save_checkpoint()")
        self.finish_checkpoint()  # at most one save in flight
        directory = checkpoint_directory(directory, "save_checkpoint")
        if self._before_save is not None:
            meta = {**meta, **self._before_save()}
        if async_save is not False:
            return self._save_async(
                Path(directory),
                model,
                optimizer,
                scheduler,
                scaler,
                extra,
                rank_state,
                step,
                keep,
                meta,
            )
        writer = sharded.save if sharded.is_sharded(model) else resume.save
        return writer(
            self._place(),
            self.all_gather,
            self._loader_book,
            self.base_seed,
            Path(directory),
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            extra=extra,
            step=step,
            keep=keep,
            meta=meta,
            rank_state=rank_state,
            newest_seen=self._newest_checkpoints,
            claims=self._writer_claims,
        )

    def load_checkpoint(
        self,
        directory: str | os.PathLike[str],
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        extra: dict[str, Any] | None = None,
        rank_state: dict[str, Any] | None = None,
        allow_world_size_change: bool = False,
    ) -> dict[str, Any] | None:
        """Restore the newest loadable checkpoint in ``directory``; return its meta.

        None only when ``directory`` holds no checkpoint at all. Restores the
        model, optimizer, scheduler, scaler, ``extra``, this rank's random
        state and every loader's position, so the run continues exactly as
        an uninterrupted one would (``step`` is in the meta when it was
        saved). Torn files are skipped with a warning; a file that reads but
        is refused is an error, as is a directory where no checkpoint loads.
        An ``optimizer`` or ``scheduler`` the checkpoint holds no state for,
        or of another type, is an error. ``rank_state`` objects get this
        rank's saved states. A checkpoint from another world size is an error
        unless ``allow_world_size_change=True`` (see :mod:`ddpctx.checkpoint.resume`);
        then a step-counted scheduler whose steps per epoch change is named
        (see :mod:`ddpctx.checkpoint.schedules`). A sharded checkpoint loads at
        any world size into a sharded or an unsharded model
        (:mod:`ddpctx.checkpoint.sharded`). Every rank calls it, outside rank-zero-only
        work (refused there; to read a checkpoint in one process, use
        :func:`ddpctx.load_weights`).
        """
        check_caller("ctx.load_checkpoint()")
        self.finish_checkpoint()
        sharded_read = sharded.reads_sharded(self._place(), Path(directory), model)
        reader = shardload.load if sharded_read else resume.load
        meta = reader(
            self._place(),
            self.device,
            self._loader_book,
            self.base_seed,
            Path(directory),
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            extra=extra,
            allow_world_size_change=allow_world_size_change,
            rank_state=rank_state,
            newest_seen=self._newest_checkpoints,
        )
        if self._after_load is not None:
            self._after_load(meta)
        return meta

    def finish_checkpoint(self) -> Path | None:
        """Wait for an ``async_save=True`` checkpoint and publish it; its path, or None.

        Every rank must call it (``save_checkpoint``, ``load_checkpoint`` and a
        normal end of the ``distributed()`` block call it for you).

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     ctx.finish_checkpoint() is None
        True
        """
        if self._pending.in_flight:
            check_caller("ctx.finish_checkpoint()")
        return self._pending.finish(self._place())

    def _save_async(
        self,
        directory: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
        scaler: Any,
        extra: dict[str, Any] | None,
        rank_state: dict[str, Any] | None,
        step: int | None,
        keep: int,
        meta: dict[str, Any],
    ) -> Path:
        if async_save_refusal := _async_refusal(model):
            raise ValueError(async_save_refusal)
        prepared = sharded.prepare(
            self._place(),
            self.all_gather,
            self._loader_book,
            self.base_seed,
            directory,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            extra=extra,
            step=step,
            keep=keep,
            meta=meta,
            rank_state=rank_state,
            claims=self._writer_claims,
        )
        try:
            return self._pending.start(prepared, model, optimizer)
        except BaseException:
            sharded.abandon(self._place(), prepared)
            raise


def _async_refusal(model: nn.Module) -> str | None:
    if sharded.is_sharded(model):
        return None
    return (
        f"save_checkpoint(async_save=True) got an unsharded {type(model).__name__}: async saves "
        "are for sharded models (ctx.shard), whose every rank writes its shards. Drop "
        "async_save=True (a DDP checkpoint is one file written by rank 0), or shard the model."
    )
