"""``save_checkpoint(..., async_save=True)``: a sharded save that writes while training goes on.

The call does everything that must see *this* step's state before it
returns: it gathers the random states and loader positions, creates the
temporary directory, and hands the shards to DCP's ``async_save``, which
copies them to CPU memory (staging) and writes them from a background
thread over a process group of its own (gloo), so the training loop's
collectives never interleave with the checkpoint's.

The checkpoint becomes visible -- ``ddpctx.pt`` written, the directory
renamed to its final name -- only when it is *finished*: at the next
``save_checkpoint`` or ``load_checkpoint``, at :meth:`finish_checkpoint`, or
when the ``distributed()`` block ends normally. Finishing waits for every
rank's write, so at most one save is in flight: memory holds at most one
staged copy of this rank's shards. Rank 0 publishes only after every rank
has confirmed, inside its own finishing call, that its part is written: a
rank that dies before then -- even after its write completed -- leaves a
temporary directory that is never chosen (rank 0 removes it); the previous
checkpoint stays the newest loadable one. A block that ends with an exception waits for this
rank's write but does not publish it.

This module knows ranks only through a :class:`~ddpctx.utils.identity.Place`.

Example:
    >>> Pending.none().in_flight
    False
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpctx.checkpoint.sharded import Prepared, abandon, confirm_parts, finish, sharded_state
from ddpctx.checkpoint.writefailures import as_os_error, is_write_failure
from ddpctx.utils.identity import Place


@dataclass
class Pending:
    """The async save in flight on this rank (if any), and the process group it writes over."""

    prepared: Prepared | None = None
    future: Future[Any] | None = None
    group: Any = None  # a gloo group for checkpoint traffic, formed at the first async save

    @classmethod
    def none(cls) -> Pending:
        """Nothing in flight."""
        return cls()

    @property
    def in_flight(self) -> bool:
        """Whether a save was started and not finished yet."""
        return self.prepared is not None

    def start(
        self,
        prepared: Prepared,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
    ) -> Path:
        """Stage this rank's shards and start writing them; the final path (not there yet)."""
        try:
            from torch.distributed.checkpoint.state_dict_saver import async_save
        except ImportError as error:
            raise RuntimeError(
                f"save_checkpoint(async_save=True) needs torch.distributed.checkpoint's "
                f"async_save, which torch {torch.__version__} lacks ({error}). Upgrade torch, "
                "or save with async_save=False (the same checkpoint, written before it returns)."
            ) from error
        from ddpctx.checkpoint.shardwriter import Writer

        if self.group is None:
            self.group = dist.new_group(backend="gloo")  # every rank: save_checkpoint is collective
        try:
            response = async_save(
                sharded_state(model, optimizer),
                checkpoint_id=prepared.temporary,
                storage_writer=Writer(prepared.temporary, prepared.written, prepared.hashed),
                process_group=self.group,
            )
        except BaseException as error:  # e.g. the planning step failed on some rank
            if is_write_failure(error):
                raise as_os_error(error, prepared.final, prepared.temporary) from error
            raise
        # a recent torch answers an AsyncSaveResponse, an older one the write's Future itself
        answer: Any = response
        self.future = getattr(answer, "upload_completion", answer)
        self.prepared = prepared
        return prepared.final

    def finish(self, place: Place, publish: bool = True) -> Path | None:
        """Wait for the write in flight; with ``publish``, make it the newest checkpoint.

        A collective when ``publish`` (every rank must call it); None when
        nothing was in flight.
        """
        prepared, future = self.prepared, self.future
        if prepared is None or future is None:
            return None
        self.prepared = self.future = None
        try:
            future.result()  # DCP reports a failed write on every rank
        except BaseException as error:
            abandon(place, prepared)
            if is_write_failure(error):  # a BaseException: an OSError naming the path instead
                raise as_os_error(error, prepared.final, prepared.temporary) from error
            raise
        if not publish:
            return None
        try:  # rank 0 publishes only what every rank confirms: a rank killed by now never does
            parts = confirm_parts(place, prepared)
        except BaseException:
            abandon(place, prepared)
            raise
        return finish(place, prepared, parts)
