"""Saving and restoring a whole run: the work behind ``ctx.save_checkpoint``/``load_checkpoint``.

Saving gathers every rank's random state and every loader's position in one
``all_gather``, converts the meta (:mod:`ddpctx.checkpoint.meta`; refused before
anything is written), and rank 0 writes the file atomically, checks that it
loads with ``weights_only=True`` (memory-mapped, cheap) and only then prunes
older ones. Every rank gets the new path, or the same error.

Loading picks the newest loadable checkpoint on rank 0
(:func:`~ddpctx.checkpoint.files.newest_checkpoint`), restores the states on every
rank, and hands each loader its position. With ``allow_world_size_change=True``
a checkpoint from another world size is
accepted: each rank's random state is then *derived* from the base seed, the
rank and the saved step (bit-identity with the old world size is impossible:
the ranks' streams do not map; a given world size stays deterministic), and
each loader's position is mapped by the samples consumed, so the epoch reads
every remaining sample exactly once.

This module knows ranks only through a :class:`~ddpctx.rankzero.outcome.Place` and
the gather function it is given; :mod:`ddpctx.session.context` wires it in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ddpctx.checkpoint.files import (
    RefusedCheckpoint,
    bare,
    check_world_size,
    load_file,
    newest_checkpoint,
    next_checkpoint_path,
    probe,
    prune,
    training_state,
    unwrap_model,
)
from ddpctx.checkpoint.meta import plain_meta
from ddpctx.data.loader import ShardLoader
from ddpctx.data.sampling import Position
from ddpctx.parallel.sharding import refuse_unsaveable
from ddpctx.rankzero.outcome import on_rank_zero
from ddpctx.utils.atomic import atomic_save
from ddpctx.utils.identity import Place
from ddpctx.utils.seeding import rng_state, seed_everything, set_rng_state

Gather = Callable[[Any], list[Any]]


def _check_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise TypeError(
            f"extra={type(extra).__name__} must be a dict of name -> object with state_dict(), "
            "e.g. extra={'ema': ema_model}."
        )
    for name, item in extra.items():
        if not (hasattr(item, "state_dict") and hasattr(item, "load_state_dict")):
            raise TypeError(
                f"extra[{name!r}] is a {type(item).__name__} without state_dict() and "
                "load_state_dict(); pass objects that have both (a module, an optimizer, an "
                "EMA helper), or put plain values in the meta instead."
            )
    return extra


LoaderPosition = tuple[int, int, bool, bytes]


def _positions(loaders: Sequence[ShardLoader]) -> list[LoaderPosition]:
    return [loader.position() for loader in loaders]


def loader_records(
    loaders: Sequence[ShardLoader], everyone: list[list[LoaderPosition]]
) -> list[dict[str, Any]]:
    """Per loader: its epoch and every rank's consumed count (see :mod:`ddpctx.data.sampling`)."""
    records = []
    for index, loader in enumerate(loaders):
        mine = [ranks[index] for ranks in everyone]
        done = mine[0][3]  # the same on every rank: where this epoch's deal started
        records.append(
            {
                "epoch": mine[0][0],
                "world_size": len(everyone),
                "consumed": [consumed for _, consumed, _, _ in mine],
                "complete": all(complete for _, _, complete, _ in mine),
                "done": torch.tensor(list(done), dtype=torch.uint8),
                "length": loader.shard.length,
                "pad": loader.shard.pad,
            }
        )
    return records


def save(
    place: Place,
    gather: Gather,
    loaders: Sequence[ShardLoader],
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
) -> Path:
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r} must be a positive int (how many checkpoints to keep).")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step={step!r} must be a non-negative int (the global step), or None.")
    extra = _check_extra(extra)
    for item in (model, *extra.values()):  # one rank's shard must never pass for the model
        if isinstance(item, nn.Module):
            refuse_unsaveable(item, "save_checkpoint")
    plain = plain_meta(meta)  # refused here, on every rank, before anything is written
    everyone = gather((rng_state(), _positions(loaders)))
    rng_states = [states for states, _ in everyone]
    records = loader_records(loaders, [positions for _, positions in everyone])

    def write() -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        path = next_checkpoint_path(directory, plain.get("epoch"), step)
        state = training_state(
            model,
            optimizer,
            scheduler,
            plain,
            place.world_size,
            rng_states,
            scaler=scaler,
            extra=extra,
            loaders=records,
            step=step,
            base_seed=base_seed,
        )
        atomic_save(state, path)
        try:
            probe(path)
        except RefusedCheckpoint as error:
            path.unlink(missing_ok=True)
            raise TypeError(
                f"the checkpoint just written would not load, so it was removed and older "
                f"ones kept: {error}. Some state_dict (optimizer, scheduler, scaler or extra) "
                "holds a value weights_only refuses; convert it to plain values."
            ) from error
        prune(directory, keep, path)
        return path

    _, path = on_rank_zero(place, write, broadcast=True)
    return Path(path)


def derived_seed(base_seed: int, rank: int, step: int, world_size: int) -> int:
    """The seed a rank restarts from after a world-size change (deterministic, distinct per rank).

    >>> derived_seed(0, 0, 10, 3) != derived_seed(0, 1, 10, 3)
    True
    """
    words = np.random.SeedSequence([base_seed, rank, step, world_size, 0x5EED]).generate_state(1)
    return int(words[0])


def load(
    place: Place,
    device: torch.device,
    loaders: Sequence[ShardLoader],
    base_seed: int | None,
    directory: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: Any,
    extra: dict[str, Any] | None,
    allow_world_size_change: bool,
) -> tuple[dict[str, Any] | None, list[tuple[Position | None, int]]]:
    """The meta (None when no checkpoint at all) and each saved loader's position to resume."""
    extra = _check_extra(extra)
    for item in (model, *extra.values()):
        if isinstance(item, nn.Module):
            refuse_unsaveable(item, "load_checkpoint")
    _, chosen = on_rank_zero(place, lambda: newest_checkpoint(directory), broadcast=True)
    if chosen is None:
        return None, []
    path = Path(chosen)
    state = load_file(path, device, weights_only=True)
    changed = check_world_size(state, path, place.world_size, allow_world_size_change)
    unwrap_model(model).load_state_dict(state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    saved_extra = state.get("extra") or {}
    for name, item in extra.items():
        if name not in saved_extra:
            raise ValueError(
                f"{str(path)!r} holds no extra state {name!r} (it has "
                f"{sorted(saved_extra) or 'none'}); it was saved without it. Leave {name!r} out "
                "of extra= for this resume, or start a new run."
            )
        bare(item).load_state_dict(saved_extra[name])
    step = state.get("step")
    if changed:
        seed = base_seed if base_seed is not None else state.get("base_seed") or 0
        seed_everything(derived_seed(seed, place.rank, step or 0, place.world_size))
    else:
        set_rng_state(state["rng"][place.rank])
    records = state.get("loaders") or []
    positions = [(_position(record), int(record["length"])) for record in records]
    meta: dict[str, Any] = dict(state["meta"])
    if step is not None:
        meta["step"] = step
    return meta, positions


def _position(record: dict[str, Any]) -> Position | None:
    if record["complete"]:
        return None  # a finished pass: the next pass reads everything
    done = record["done"]
    return Position(
        epoch=int(record["epoch"]),
        world_size=int(record["world_size"]),
        consumed=tuple(int(c) for c in record["consumed"]),
        done=bytes(done.cpu().numpy().tobytes()) if done.numel() else b"",
    )
