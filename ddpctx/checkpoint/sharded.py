"""Checkpoints of sharded (FSDP2) models: every rank writes its shards; DDP checkpoints' promises.

A sharded checkpoint is a *directory* beside the single-file ones, numbered
in the same sequence: ``checkpoint-000008-epoch3-step120.dcp/``. It holds

- the model's and the optimizer's shards, written by every rank through
  ``torch.distributed.checkpoint`` (DCP) from ``get_state_dict`` (keyed by
  parameter names, so any world size can load them: DCP reshards on load);
- ``ddpctx.pt``, written by rank 0 last: the checkpoint format, the world
  size, the meta, every rank's random state, every loader's position, and the
  scheduler, AMP scaler and ``extra`` states (the same on every rank).

Atomic: every rank writes into ``.<name>.<host>.<pid>.<random>.tmp/``; once
DCP's save has returned on every rank (its metadata file is written after
all shards), rank 0 writes ``ddpctx.pt``, checks that it loads, and renames
the directory to its final name. A crash at any point leaves a temporary
that is never chosen (and that a later save removes once its writer is
provably gone), so the previous checkpoint stays the newest loadable one.
``keep=N`` prunes the older directories, never the newest that loads.

Loading picks the newest directory whose ``ddpctx.pt`` and DCP metadata are
there (an incomplete one is skipped with a warning), loads the shards into
the model and optimizer at *this* world size, and restores the rest exactly
as :mod:`ddpctx.checkpoint.resume` does for single-file checkpoints. All
ranks must see the same directory (a shared file system across nodes).

Example:
    >>> checkpoint_dirs(Path("/nonexistent"))
    []
"""

from __future__ import annotations

import copy
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpctx.checkpoint import perrank
from ddpctx.checkpoint.files import (
    FORMAT,
    RefusedCheckpoint,
    bare,
    check_world_size,
    checkpoint_paths,
    load_file,
    number_of,
    probe,
)
from ddpctx.checkpoint.meta import plain_meta
from ddpctx.checkpoint.resume import Gather, _check_extra, derived_seed
from ddpctx.checkpoint.schedules import check_scheduler
from ddpctx.checkpoint.shardfiles import (
    STATE_FILE,
    checkpoint_dirs,
    newest_checkpoint_dir,
    next_checkpoint_dir,
    prune_dirs,
)
from ddpctx.data.book import LoaderBook, saved_loaders
from ddpctx.parallel.sharding import sharding_of
from ddpctx.rankzero.outcome import on_rank_zero
from ddpctx.utils.atomic import atomic_save, fsync_directory, temporary_name
from ddpctx.utils.identity import Place
from ddpctx.utils.seeding import rng_state, seed_everything, set_rng_state


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

    def newest_is_sharded() -> bool:
        dirs, files = checkpoint_dirs(directory), checkpoint_paths(directory)
        return bool(dirs) and (not files or number_of(dirs[0]) > number_of(files[0]))

    return bool(on_rank_zero(place, newest_is_sharded, broadcast=True)[1])


def _refuse_sharded_extra(extra: dict[str, Any]) -> None:
    for name, item in extra.items():
        if isinstance(item, nn.Module) and sharding_of(item) is not None:
            raise TypeError(
                f"extra[{name!r}] is a sharded module: extra= is saved from rank 0 alone, which "
                "holds one shard of it. Keep it unsharded, or save it in its own checkpoint "
                "directory as model=."
            )


def dcp_save(state: dict[str, Any], checkpoint_id: Path) -> Any:
    """DCP's ``save``, imported when first used (DCP costs about a second of import time)."""
    from torch.distributed.checkpoint.state_dict_saver import save

    return save(state, checkpoint_id=checkpoint_id)


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
        final = next_checkpoint_dir(directory, plain.get("epoch"), step)
        temporary = temporary_name(final)
        temporary.mkdir()
        return str(final), str(temporary)

    _, (final, temporary) = on_rank_zero(place, begin, broadcast=True)
    return Prepared(directory, Path(temporary), Path(final), keep, state)


def finish(place: Place, prepared: Prepared) -> Path:
    """After every rank's shards are written: rank 0 adds ``ddpctx.pt`` and renames (collective)."""
    temporary, final = prepared.temporary, prepared.final

    def publish() -> Path:
        atomic_save(prepared.state, temporary / STATE_FILE)
        try:
            probe(temporary / STATE_FILE)
        except RefusedCheckpoint as error:
            shutil.rmtree(temporary, ignore_errors=True)
            raise TypeError(
                f"the checkpoint just written would not load, so it was removed and older ones "
                f"kept: {error}. Some state_dict (scheduler, scaler or extra) holds a value "
                "weights_only refuses; convert it to plain values."
            ) from error
        fsync_directory(temporary)
        os.rename(temporary, final)
        fsync_directory(prepared.directory)
        prune_dirs(prepared.directory, prepared.keep, final)
        return final

    _, path = on_rank_zero(place, publish, broadcast=True)
    return Path(path)


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
    )
    try:
        dcp_save(sharded_state(model, optimizer), checkpoint_id=prepared.temporary)
    except BaseException:  # DCP raises on every rank when any rank's write failed
        abandon(place, prepared)
        raise
    return finish(place, prepared)


def load(
    place: Place,
    device: torch.device,
    loaders: LoaderBook,
    base_seed: int | None,
    directory: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: Any,
    extra: dict[str, Any] | None,
    allow_world_size_change: bool,
    rank_state: dict[str, Any] | None = None,
    newest_seen: dict[Path, str] | None = None,  # single-file checkpoints' writer check
) -> dict[str, Any] | None:
    """Restore the newest sharded checkpoint; its meta (None when there is none at all).

    Loaders made by ``ctx.dataloader`` (now or later) get their saved positions
    through ``loaders``.
    """
    extra = _check_extra(extra)
    _refuse_sharded_extra(extra)
    rank_state = perrank.check_rank_state(rank_state)
    _, chosen = on_rank_zero(place, lambda: newest_checkpoint_dir(directory), broadcast=True)
    if chosen is None:
        return None
    path = Path(chosen)
    state = load_file(path / STATE_FILE, device, weights_only=True)
    changed = check_world_size(state, path, place.world_size, allow_world_size_change)
    saved = saved_loaders(state.get("loaders") or [])
    if changed:
        check_scheduler(scheduler, state.get("scheduler"), saved, place.world_size, repr(str(path)))
    if optimizer is not None and not state["optimizer_saved"]:
        raise ValueError(
            f"{str(path)!r} was saved without an optimizer, so its state cannot be restored. "
            "Leave optimizer= out of this load_checkpoint (a fresh optimizer), or resume from a "
            "checkpoint saved with one."
        )
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    shards = sharded_state(model, optimizer)  # this world size's layout; DCP reshards into it
    dcp_load(shards, checkpoint_id=path)
    set_state_dict(
        model,
        [] if optimizer is None else [optimizer],
        model_state_dict=shards["model"],
        optim_state_dict=shards.get("optimizer", {}),
    )
    _restore_replicated(state, path, scheduler, scaler, extra)
    step = state.get("step")
    where = repr(str(path))
    if changed:
        seed = base_seed if base_seed is not None else state.get("base_seed") or 0
        fresh = derived_seed(seed, place.rank, step or 0, place.world_size)
        perrank.reseed(rank_state, fresh, where, int(state["world_size"]))
        seed_everything(fresh)
    else:
        saved_ranks = state.get("rank_state") or []
        perrank.restore(rank_state, saved_ranks[place.rank] if saved_ranks else {}, where)
        set_rng_state(state["rng"][place.rank])
    loaders.restore(saved)
    meta: dict[str, Any] = dict(state["meta"])
    if step is not None:
        meta["step"] = step
    return meta


def _restore_replicated(
    state: dict[str, Any], path: Path, scheduler: Any, scaler: Any, extra: dict[str, Any]
) -> None:
    """Scheduler, scaler and ``extra``: rank 0's states, the same on every rank."""
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    saved_extra = state["extra"]
    for name, item in extra.items():
        if name not in saved_extra:
            raise ValueError(
                f"{str(path)!r} holds no extra state {name!r} (it has "
                f"{sorted(saved_extra) or 'none'}); it was saved without it. Leave {name!r} out "
                "of extra= for this resume, or start a new run."
            )
        bare(item).load_state_dict(saved_extra[name])
