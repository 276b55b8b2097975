"""Checkpoints of sharded (FSDP2) models: every rank writes its shards; DDP checkpoints' promises.

A sharded checkpoint is a *directory* beside the single-file ones, numbered
in the same sequence: ``checkpoint-000008-epoch3-step120.dcp/``. It holds

- the model's and the optimizer's shards, written by every rank through
  ``torch.distributed.checkpoint`` (DCP) from ``get_state_dict`` (keyed by
  parameter names, so any world size can load them: DCP reshards on load);
- ``ddpctx.pt``, written by rank 0: the checkpoint format, the world
  size, the meta, every rank's random state, every loader's position, and the
  scheduler, AMP scaler and ``extra`` states (the same on every rank);
- ``ddpctx.sums``, written by rank 0 last: every other file's size and
  checksum, and of each shard the checksum of every entry DCP wrote into it
  (:mod:`ddpctx.checkpoint.sums`). Each rank hashes its shards as DCP writes
  them (:mod:`ddpctx.checkpoint.shardwriter`), whole and entry by entry, and
  reads none of them back.

Atomic: every rank writes into ``.<name>.<host>.<pid>.<random>.tmp/``; once
DCP's save has returned on every rank (its metadata file is written after
all shards) and every rank has confirmed its part, rank 0 writes
``ddpctx.pt``, checks that it loads, writes the manifest and renames the
directory to its final name. A crash at any point leaves a temporary
that is never chosen (and that a later save removes once its writer is
provably gone), so the previous checkpoint stays the newest loadable one.
``keep=N`` prunes the older directories, never the newest that loads.
A failed write raises an ``OSError`` on every rank alike (a read-only or
unmakeable directory, a full disk): what rank 0 does alone (making the
temporary, publishing) goes through
:func:`~ddpctx.checkpoint.writefailures.written_by_rank_zero`, DCP's own
failures through :func:`~ddpctx.checkpoint.writefailures.as_os_error`.

Loading is :mod:`ddpctx.checkpoint.shardload`: the newest directory that is
whole as every rank reads it (each rank verifies the files and entries it
reads itself; an incomplete or damaged one is skipped on every rank, with a
warning naming the file and the rank), its shards loaded into the model and
optimizer at *this* world size, the rest restored exactly as
:mod:`ddpctx.checkpoint.resume` does for single-file checkpoints. All ranks
must see the same directory (a shared file system across nodes).

Example:
    >>> is_sharded(torch.nn.Linear(2, 1))
    False
"""

from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpctx.checkpoint import perrank
from ddpctx.checkpoint.files import (
    FORMAT,
    RefusedCheckpoint,
    bare,
    probe,
)
from ddpctx.checkpoint.meta import plain_meta
from ddpctx.checkpoint.resume import Gather, _check_extra
from ddpctx.checkpoint.shardfiles import (
    STATE_FILE,
    newest_is_sharded,
    next_checkpoint_dir,
    prune_dirs,
)
from ddpctx.checkpoint.sums import (
    OF_PARTS,
    SHARDED_MANIFEST,
    FileSum,
    Recorded,
    file_record,
    file_sum,
    tiles,
    write_manifest,
)
from ddpctx.checkpoint.writefailures import as_os_error, is_write_failure, written_by_rank_zero
from ddpctx.checkpoint.writerlock import Claims
from ddpctx.data.book import LoaderBook
from ddpctx.parallel.sharding import sharding_of
from ddpctx.rankzero.outcome import on_rank_zero
from ddpctx.reduce.objects import all_gather_objects
from ddpctx.utils.atomic import atomic_save, fsync_directory, temporary_name
from ddpctx.utils.digest import chosen
from ddpctx.utils.identity import Place
from ddpctx.utils.seeding import rng_state


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s checkpoints are written here (FSDP2) rather than as one file."""
    return sharding_of(model) == "fsdp2"


def reads_sharded(place: Place, directory: Path, model: nn.Module) -> bool:
    """Whether to load from a sharded checkpoint: for a sharded model, or when the newest is one.

    An unsharded model loads a sharded checkpoint too (each rank reads whole
    tensors), so a run sharded before can continue under DDP. Decided on rank
    0, so every rank takes the same path.
    """
    if is_sharded(model):
        return True
    return bool(on_rank_zero(place, partial(newest_is_sharded, directory), broadcast=True)[1])


def _refuse_sharded_extra(extra: dict[str, Any]) -> None:
    for name, item in extra.items():
        if isinstance(item, nn.Module) and sharding_of(item) is not None:
            raise TypeError(
                f"extra[{name!r}] is a sharded module: extra= is saved from rank 0 alone, which "
                "holds one shard of it. Keep it unsharded, or save it in its own checkpoint "
                "directory as model=."
            )


def dcp_save(
    state: dict[str, Any],
    checkpoint_id: Path,
    written: list[tuple[str, int, int]],
    hashed: dict[str, Any],
) -> Any:
    """DCP's ``save``, imported when first used (DCP costs about a second of import time).

    ``written`` receives this rank's entries (file name, offset, length), ``hashed``
    the checksums of the files it wrote (:class:`~ddpctx.checkpoint.shardwriter.Hashed`).
    """
    from torch.distributed.checkpoint.state_dict_saver import save

    from ddpctx.checkpoint.shardwriter import Writer

    writer = Writer(checkpoint_id, written, hashed)
    return save(state, checkpoint_id=checkpoint_id, storage_writer=writer)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    # DCP is imported by its users only: it costs about a second of import time
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, [] if optimizer is None else [optimizer])
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer_state
    return state


@dataclass
class Prepared:
    """A sharded save begun: its temporary and final directories and rank 0's small state."""

    directory: Path
    temporary: Path
    final: Path
    keep: int
    state: dict[str, Any]  # ddpctx.pt: everything but the shards, captured at the save call
    written: list[tuple[str, int, int]] = field(default_factory=list)  # this rank's entries
    hashed: dict[str, Any] = field(default_factory=dict)  # name -> shardwriter.Hashed


def prepare(
    place: Place,
    gather: Gather,
    loaders: LoaderBook,
    base_seed: int | None,
    directory: Path,
    *,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: Any,
    extra: dict[str, Any] | None,
    step: int | None,
    keep: int,
    meta: dict[str, Any],
    rank_state: dict[str, Any] | None = None,
    claims: Claims | None = None,
) -> Prepared:
    """Check the arguments, gather RNG states and positions, create the temporary directory."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r} must be a positive int (how many checkpoints to keep).")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step={step!r} must be a non-negative int (the global step), or None.")
    extra = _check_extra(extra)
    _refuse_sharded_extra(extra)
    rank_state = perrank.check_rank_state(rank_state)
    plain = plain_meta(meta)  # refused here, on every rank, before anything is written
    everyone = gather((rng_state(), loaders.snapshot(), perrank.capture(rank_state)))
    state = {
        "format": FORMAT,
        "sharded": True,
        "world_size": place.world_size,
        "optimizer_saved": optimizer is not None,
        "scheduler": copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
        "scaler": copy.deepcopy(scaler.state_dict()) if scaler is not None else None,
        "extra": {name: copy.deepcopy(bare(item).state_dict()) for name, item in extra.items()},
        "meta": plain,
        "rng": [states for states, _, _ in everyone],
        "loaders": loaders.records([snapshot for _, snapshot, _ in everyone]),
        "rank_state": [states for _, _, states in everyone],
        "step": step,
        "base_seed": base_seed,
    }

    def begin() -> tuple[str, str]:
        directory.mkdir(parents=True, exist_ok=True)
        if claims is not None:
            claims.claim(directory)  # one writer per directory: another job's save is refused
        final = next_checkpoint_dir(directory, plain.get("epoch"), step)
        temporary = temporary_name(final)
        temporary.mkdir()
        return str(final), str(temporary)

    final, temporary = written_by_rank_zero(place, begin)  # an OSError: on every rank
    return Prepared(directory, Path(temporary), Path(final), keep, state)


def confirm_parts(place: Place, prepared: Prepared) -> list[dict[str, Recorded]]:
    """Every rank's word that its shards are written, with their sizes and checksums (collective).

    The checksums are those hashed as DCP wrote the files (``prepared.hashed``):
    each whole file's, and each entry's (what a loading rank verifies as it reads
    the entries it needs). A file of this rank (DCP names them ``__<rank>_*``)
    that was not hashed so -- an entry that is not one segment, a writer in
    another process -- is read back once instead. A rank that died cannot
    answer: the gather then fails on the others, and nothing is published.
    """
    spans: dict[str, list[tuple[int, int]]] = {}
    for name, offset, length in prepared.written:
        spans.setdefault(name, []).append((offset, length))
    mine = {
        path.name: _record_of(path, spans.get(path.name, []), prepared.hashed.get(path.name))
        for path in prepared.temporary.glob(f"__{place.rank}_*")
    }
    return [mine] if place.world_size == 1 else all_gather_objects(mine)


def _record_of(path: Path, spans: list[tuple[int, int]], hashed: Any) -> Recorded:
    """The manifest's record of the shard ``path``: from its write's hashes, else read back."""
    if hashed is not None and all(span in hashed.segments for span in spans):
        try:
            size = path.stat().st_size
        except OSError:
            size = -1
        parts = tuple((o, n, hashed.segments[(o, n)]) for o, n in sorted(set(spans)))
        if size == hashed.size and tiles(parts, size):  # the file is its entries
            return Recorded(size, OF_PARTS, parts, hashed.algorithm)
    return file_record(path, spans)


def finish(place: Place, prepared: Prepared, parts: list[dict[str, Recorded]]) -> Path:
    """Once every rank confirmed its shards (``parts``), rank 0 seals and renames (collective)."""
    if len(parts) != place.world_size:
        raise RuntimeError(
            f"{len(parts)} of {place.world_size} ranks confirmed their part of "
            f"{str(prepared.final)!r}; it is not published. Save again."
        )
    temporary, final = prepared.temporary, prepared.final

    def publish() -> Path:
        try:  # a failure here (a full disk, say) leaves no temporary behind
            seal(prepared, {name: part for confirmed in parts for name, part in confirmed.items()})
            os.rename(temporary, final)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        fsync_directory(prepared.directory)
        prune_dirs(prepared.directory, prepared.keep, final)
        return final

    path = written_by_rank_zero(place, publish)  # an OSError (a full disk): on every rank
    return Path(path)


def seal(prepared: Prepared, sums: dict[str, FileSum | Recorded]) -> None:
    """Rank 0: write ``ddpctx.pt``, check that it loads, write the manifest, sync the directory."""
    temporary = prepared.temporary
    atomic_save(prepared.state, temporary / STATE_FILE, partial(sums.__setitem__, STATE_FILE))
    try:
        probe(temporary / STATE_FILE)
    except RefusedCheckpoint as error:
        raise TypeError(
            f"the checkpoint just written would not load, so it was removed and older ones "
            f"kept: {error}. Some state_dict (scheduler, scaler or extra) holds a value "
            "weights_only refuses; convert it to plain values."
        ) from error
    for name, value in list(sums.items()):  # a rank without xxhash hashed with CRC-32
        if isinstance(value, Recorded) and value.algorithm != chosen():
            spans = [(offset, length) for offset, length, _ in value.parts]
            sums[name] = file_record(temporary / name, spans)
    for path in temporary.iterdir():  # DCP's .metadata, and whatever no rank claimed
        if path.name not in sums and path.is_file():
            sums[path.name] = file_sum(path)
    write_manifest(temporary / SHARDED_MANIFEST, sums)  # before the directory is published
    fsync_directory(temporary)


def abandon(place: Place, prepared: Prepared) -> None:
    """A failed write: rank 0 removes the temporary (older checkpoints stay the newest)."""
    if place.rank == 0:
        shutil.rmtree(prepared.temporary, ignore_errors=True)


def save(
    place: Place,
    gather: Gather,
    loaders: LoaderBook,
    base_seed: int | None,
    directory: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: Any,
    extra: dict[str, Any] | None,
    step: int | None,
    keep: int,
    meta: dict[str, Any],
    rank_state: dict[str, Any] | None = None,
    newest_seen: dict[Path, str] | None = None,  # single-file checkpoints' writer check
    claims: Claims | None = None,
) -> Path:
    """Write a sharded checkpoint (see the module docstring); every rank gets its path."""
    prepared = prepare(
        place,
        gather,
        loaders,
        base_seed,
        directory,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        extra=extra,
        step=step,
        keep=keep,
        meta=meta,
        rank_state=rank_state,
        claims=claims,
    )
    try:
        dcp_save(
            sharded_state(model, optimizer),
            prepared.temporary,
            prepared.written,
            prepared.hashed,
        )
    except BaseException as error:  # DCP raises on every rank when any rank's write failed
        abandon(place, prepared)
        if is_write_failure(error):  # a BaseException: an OSError naming the path instead
            raise as_os_error(error, prepared.final, prepared.temporary) from error
        raise
    try:
        parts = confirm_parts(place, prepared)
    except BaseException:
        abandon(place, prepared)
        raise
    return finish(place, prepared, parts)
