"""Saving and restoring a whole run: the work behind ``ctx.save_checkpoint``/``load_checkpoint``.

Saving gathers every rank's random state and every loader's position in one
``all_gather``, converts the meta (:mod:`ddpctx.checkpoint.meta`; refused before
anything is written), and rank 0 writes the file atomically, checks that it
loads with ``weights_only=True`` (memory-mapped, cheap) and only then prunes
older ones. Every rank gets the new path, or the same error.

Loading takes the newest checkpoint that loads on *every* rank: rank 0
lists the files (names only), and for each, newest first, every rank verifies
its own copy against the manifest (one pass over its bytes) and reads it
with ``weights_only=True``; one all-gather then says whether it was whole
everywhere (:mod:`ddpctx.checkpoint.together`). A copy damaged or torn on
any rank makes every rank go on to the next older checkpoint, with a
warning naming the file and the rank; pickled code refused on any rank is
an error on every rank. It then restores the states on every rank, hands
each loader its position, and gives a DDP model the gradient-bucket
layout the saving run had rebuilt (:mod:`ddpctx.parallel.buckets`), so its
first step reduces exactly as the uninterrupted run's did. With ``allow_world_size_change=True``
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

import contextlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ddpctx.checkpoint import perrank
from ddpctx.checkpoint.files import (
    RefusedCheckpoint,
    bare,
    check_single_writer,
    check_world_size,
    checkpoint_paths,
    next_checkpoint_path,
    number_of,
    probe,
    prune,
    read_state,
    refuse_a_file,
    remove_abandoned_checkpoint_temporaries,
    remove_checkpoint_file,
    say_alike,
    say_lost,
    training_state,
    unwrap_model,
)
from ddpctx.checkpoint.listed import check_listed
from ddpctx.checkpoint.meta import plain_meta
from ddpctx.checkpoint.regular import not_regular
from ddpctx.checkpoint.schedules import check_scheduler
from ddpctx.checkpoint.sums import (
    Damaged,
    file_damage,
    read_manifest,
    sidecar,
    unverified_warning,
    write_manifest,
)
from ddpctx.checkpoint.together import read_together
from ddpctx.checkpoint.writefailures import written_by_rank_zero
from ddpctx.checkpoint.writerlock import Claims
from ddpctx.data.book import LoaderBook, saved_loaders
from ddpctx.parallel.buckets import bucket_layout, install_bucket_layout
from ddpctx.parallel.sharding import refuse_unsaveable
from ddpctx.rankzero.outcome import on_rank_zero
from ddpctx.utils.atomic import atomic_save
from ddpctx.utils.identity import Place
from ddpctx.utils.seeding import rng_state, seed_everything, set_rng_state
from ddpctx.utils.warn import warn_user

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
    newest_seen: dict[Path, str] | None = None,
    claims: Claims | None = None,
) -> Path:
    """Write a checkpoint of the run (rank 0), prune old ones; every rank gets its path.

    ``claims`` (rank 0's writer locks, :mod:`ddpctx.checkpoint.writerlock`)
    refuses a second job writing the same directory; ``newest_seen`` (rank
    0's memory of the newest checkpoint it wrote or loaded, per directory)
    detects one where the file system cannot lock.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r} must be a positive int (how many checkpoints to keep).")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step={step!r} must be a non-negative int (the global step), or None.")
    extra = _check_extra(extra)
    rank_state = perrank.check_rank_state(rank_state)
    for item in (model, *extra.values()):  # one rank's shard must never pass for the model
        if isinstance(item, nn.Module):
            refuse_unsaveable(item, "save_checkpoint")
    plain = plain_meta(meta)  # refused here, on every rank, before anything is written
    everyone = gather((rng_state(), loaders.snapshot(), perrank.capture(rank_state)))
    rng_states = [states for states, _, _ in everyone]
    records = loaders.records([snapshot for _, snapshot, _ in everyone])
    rank_states = [states for _, _, states in everyone]
    seen = newest_seen if newest_seen is not None else {}
    layout = bucket_layout(model)  # on every rank: it may rebuild DDP's buckets (a broadcast)

    def write() -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        if claims is not None:
            claims.claim(directory)  # one writer per directory: another job's save is refused
        check_single_writer(directory, seen.get(directory))
        remove_abandoned_checkpoint_temporaries(directory)
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
            rank_states=rank_states,
            keep=keep,
        )
        state["ddp_buckets"] = layout  # the resumed model reduces as this run goes on to
        atomic_save(state, path, lambda saved: write_manifest(sidecar(path), {path.name: saved}))
        try:
            probe(path)
        except RefusedCheckpoint as error:
            remove_checkpoint_file(path)
            raise TypeError(
                f"the checkpoint just written would not load, so it was removed and older "
                f"ones kept: {error}. Some state_dict (optimizer, scheduler, scaler or extra) "
                "holds a value weights_only refuses; convert it to plain values."
            ) from error
        prune(directory, keep, path)  # also what an earlier stop left, and same-step saves
        seen[directory] = path.name
        return path

    return Path(written_by_rank_zero(place, write))  # an OSError is raised on every rank


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
    newest_seen: dict[Path, str] | None = None,
) -> dict[str, Any] | None:
    """Restore the newest checkpoint; return its meta (None when there is no checkpoint at all).

    Loaders made by ``ctx.dataloader`` (now or later) get their saved positions
    through ``loaders``.
    """
    extra = _check_extra(extra)
    rank_state = perrank.check_rank_state(rank_state)
    for item in (model, *extra.values()):
        if isinstance(item, nn.Module):
            refuse_unsaveable(item, "load_checkpoint")
    seen = newest_seen if newest_seen is not None else {}
    _, names = on_rank_zero(place, partial(_candidates, directory), broadcast=True)
    assert isinstance(names, list)
    if not names:
        return None
    chosen, state = None, None
    for name in names:  # each rank verifies and reads its own copy; one gather decides
        path = directory / name
        read = partial(_read_verified, place, path, device)
        outcome = read_together(place, path, sidecar(path), read, _lacking)
        whole, found = outcome  # in two steps: unpacked at once, mypy infers T | None for T
        if whole and found is not None:
            chosen, state = path, found[0]
            break
    if chosen is None or state is None:
        raise RuntimeError(
            f"{str(directory)!r} holds {len(names)} checkpoint file(s) "
            f"({', '.join(names[:5])}) and none of them loads (each is torn or "
            "damaged: see the warnings). "
            "Refusing to start over silently: restore a good checkpoint, or move the "
            "directory away to start a new run."
        )
    path = chosen
    where = repr(str(path))
    if place.rank == 0:
        say_lost(directory, path)
        say_alike(directory, path)
        _after_choice(directory, path, state.get("keep"), seen)
    changed = check_world_size(state, path, place.world_size, allow_world_size_change)
    saved = saved_loaders(state.get("loaders") or [])
    if changed:
        check_scheduler(scheduler, state.get("scheduler"), saved, place.world_size, where)
    unwrap_model(model).load_state_dict(state["model"])
    install_bucket_layout(model, state.get("ddp_buckets"))
    _load_stateful("optimizer", optimizer, state, where)
    _load_stateful("scheduler", scheduler, state, where)
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    saved_extra = state.get("extra") or {}
    for name, item in extra.items():
        if name not in saved_extra:
            raise ValueError(
                f"{where} holds no extra state {name!r} (it has "
                f"{sorted(saved_extra) or 'none'}); it was saved without it. Leave {name!r} out "
                "of extra= for this resume, or start a new run."
            )
        bare(item).load_state_dict(saved_extra[name])
    step = state.get("step")
    saved_ranks = state.get("rank_state") or []
    watch = None
    if changed:
        seed = base_seed if base_seed is not None else state.get("base_seed") or 0
        fresh = derived_seed(seed, place.rank, step or 0, place.world_size)
        perrank.reseed(rank_state, fresh, where, int(state["world_size"]))
        seed_everything(fresh)
    else:
        mine = saved_ranks[place.rank] if saved_ranks else {}
        watch = perrank.restore(rank_state, mine, where).check
        set_rng_state(state["rng"][place.rank])
    loaders.restore(saved, before_resumed_pass=watch)
    meta: dict[str, Any] = dict(state["meta"])
    if step is not None:
        meta["step"] = step
    return meta


def _candidates(directory: Path) -> list[str]:
    """Rank 0: the checkpoint files to try, newest first, after removing what a killed save left."""
    refuse_a_file(directory)
    with contextlib.suppress(OSError):  # a read-only directory still loads
        remove_abandoned_checkpoint_temporaries(directory)
    return [path.name for path in checkpoint_paths(directory)]


def _read_verified(
    place: Place, path: Path, device: torch.device
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """This rank's copy of the checkpoint ``path``, verified against its manifest, then loaded;
    and the files its manifest lists that this rank lacks (:mod:`ddpctx.checkpoint.listed`).

    The file is hashed in one sequential pass, then memory-mapped by ``torch.load``:
    the model's tensors are copied once, from the page cache the hash just
    filled, straight into the model (a ``.pt`` is a zip that torch reads out of
    order, so it cannot be hashed as torch reads it). Measured on a 256 MiB
    checkpoint (BENCHMARKS.md), hash + mapped load + ``load_state_dict`` took
    0.3x the time of a plain ``torch.load`` + ``load_state_dict``; reading the
    file into memory while hashing and loading from that buffer took 2x.
    """
    if why := not_regular(path):  # a FIFO: damage, never opened (that would wait)
        raise Damaged(str(path), why)
    manifest = sidecar(path)
    verified = manifest.exists()
    lacking: tuple[str, ...] = ()
    if verified:
        recorded = read_manifest(manifest)
        if isinstance(recorded, str):
            raise Damaged(str(manifest), recorded)
        if path.name not in recorded:
            raise Damaged(str(manifest), f"its manifest does not list {path.name!r}")
        if reason := file_damage(path, recorded[path.name]):
            raise Damaged(str(path), reason)
        lacking = check_listed(recorded, path.parent, read={path.name})
    elif place.rank == 0:
        warn_user(unverified_warning(path, manifest), RuntimeWarning)
    return _off_the_file(read_state(path, device, mmap=True, verified=verified)), lacking


def _lacking(found: tuple[dict[str, Any], tuple[str, ...]]) -> tuple[str, ...]:
    return found[1]


def _off_the_file(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with every tensor but the model's copied out of the mapped file.

    The model's tensors are copied into the model by ``load_state_dict``; an
    optimizer would keep its loaded tensors, which must not stay views of a file
    that someone may later truncate or overwrite.
    """

    def copied(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return item.clone() if item.device.type == "cpu" else item
        if isinstance(item, dict):
            return {key: copied(value) for key, value in item.items()}
        if isinstance(item, (list, tuple)):
            return type(item)(copied(value) for value in item)
        return item

    return {key: value if key == "model" else copied(value) for key, value in state.items()}


def _after_choice(directory: Path, path: Path, keep: object, seen: dict[Path, str]) -> None:
    """Rank 0, once every rank read ``path``: prune by its ``keep``, note the newest seen."""
    if isinstance(keep, int) and keep >= 1:
        with contextlib.suppress(OSError):  # a read-only directory still loads
            prune(directory, keep, path)
    # A newer checkpoint skipped as damaged or torn was seen by this run too: the next save
    # numbers past it, and the single-writer check must not take it for another job's.
    present = checkpoint_paths(directory)[:1]
    newest = present[0] if present and number_of(present[0]) > number_of(path) else path
    seen[directory] = newest.name


def _load_stateful(what: str, item: Any, state: dict[str, Any], where: str) -> None:
    """Load the optimizer or scheduler; a missing state or another type is a clear error."""
    if item is None:
        return
    saved = state.get(what)
    if saved is None:
        raise ValueError(
            f"{where} holds no {what} state: it was saved without {what}=. Leave {what}= out "
            f"of load_checkpoint for this resume (the {what} starts fresh), or start a new run."
        )
    saved_type = state.get(f"{what}_type")
    mine = type(item).__qualname__
    if saved_type is not None and saved_type != mine:
        raise TypeError(
            f"{where} holds the state of a {saved_type} {what}, and load_checkpoint was given a "
            f"{mine}. Pass a {saved_type} (as the run that saved it), or leave {what}= out to "
            f"start the {mine} fresh."
        )
    try:
        item.load_state_dict(saved)
    except (KeyError, ValueError, TypeError, RuntimeError) as error:
        raise ValueError(
            f"{where}'s {what} state does not fit the {mine} given to load_checkpoint "
            f"({type(error).__name__}: {error}). Build it as the run that saved it did (same "
            f"parameter groups and options), or leave {what}= out to start it fresh."
        ) from error
