"""Loading a sharded checkpoint: each rank verifies what it reads, and all load the same one.

The loading side of :mod:`ddpctx.checkpoint.sharded`. Rank 0 lists the
checkpoint directories (names only: every rank joins them to *its* view of
the directory) and skips those lacking ``ddpctx.pt`` or DCP's ``.metadata``.
Then, newest first (:mod:`ddpctx.checkpoint.together`):

1. every rank reads the checkpoint's manifest, ``ddpctx.pt`` (verified, then
   loaded with ``weights_only=True``) and ``.metadata`` (verified, then
   unpickled by the restricted unpickler of :mod:`ddpctx.checkpoint.dcpread`;
   without a manifest, the shard sizes it names are checked too);
2. one all-gather of what each rank found: damaged or torn on any rank, and
   every rank goes on to the next older checkpoint; refused as unsafe on any
   rank, and every rank raises;
3. DCP reads the shards each rank needs, through the verifying reader: each
   entry's bytes are checked against the manifest as they are read (each
   rank verifies exactly the bytes it reads; none reads another's only to
   verify them). DCP runs without collectives of its own (a load's plan is
   each rank's own); a second 1-element vote, as in step 2, makes a damaged
   entry on any rank send every rank on to the next older checkpoint
   together (the model's state is written again by that one).

A rank interrupted while reading (Ctrl-C, SIGTERM) raises its interrupt, not
a read failure; a rank that leaves so, or is killed, is named by the others
in the vote they wait in (:func:`ddpctx.checkpoint.together.agree`).

What is restored, and at which world size, is as before: the shards into the
model and optimizer at *this* world size (DCP reshards), the rest from
``ddpctx.pt`` as :mod:`ddpctx.checkpoint.resume` does for single-file
checkpoints.

This module imports DCP (about a second) when it first loads.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpctx.checkpoint import perrank
from ddpctx.checkpoint.files import bare, check_world_size, read_state, say_alike
from ddpctx.checkpoint.listed import check_listed, short_shard
from ddpctx.checkpoint.resume import _check_extra, derived_seed
from ddpctx.checkpoint.schedules import check_scheduler
from ddpctx.checkpoint.sharded import _refuse_sharded_extra, sharded_state
from ddpctx.checkpoint.shardfiles import (
    METADATA_FILE,
    STATE_FILE,
    Candidates,
    candidates,
    none_loads,
    refuse_newer_file,
)
from ddpctx.checkpoint.sums import (
    SHARDED_MANIFEST,
    Damaged,
    Recorded,
    Torn,
    file_damage,
    read_manifest,
    unverified_warning,
)
from ddpctx.checkpoint.together import read_together
from ddpctx.data.book import LoaderBook, saved_loaders
from ddpctx.rankzero.outcome import on_rank_zero
from ddpctx.utils.identity import Place
from ddpctx.utils.seeding import seed_everything, set_rng_state
from ddpctx.utils.warn import warn_user


def read_small(
    place: Place, path: Path, device: torch.device
) -> tuple[dict[str, Any], Any, dict[str, Recorded] | None, tuple[str, ...]]:
    """This rank's ``ddpctx.pt`` state, DCP metadata and manifest of ``path``, verified; and
    the files the manifest lists that this rank lacks (:mod:`ddpctx.checkpoint.listed`).

    :class:`~ddpctx.checkpoint.sums.Damaged` (or ``Torn``) for a file that is
    not as saved; ``RefusedCheckpoint`` for one refused as unsafe.
    """
    from ddpctx.checkpoint.dcpread import files_read, read_metadata

    manifest = path / SHARDED_MANIFEST
    recorded: dict[str, Recorded] | None = None
    if manifest.exists():
        found = read_manifest(manifest)
        if isinstance(found, str):
            raise Damaged(str(manifest), found)
        for name in (STATE_FILE, METADATA_FILE):
            if name not in found:
                raise Damaged(str(manifest), f"its manifest does not list {name!r}")
        recorded = found
        if reason := file_damage(path / STATE_FILE, found[STATE_FILE]):
            raise Damaged(str(path / STATE_FILE), reason)
    elif place.rank == 0:
        warn_user(unverified_warning(path, manifest), RuntimeWarning)
    state = read_state(path / STATE_FILE, device, verified=recorded is not None)
    metadata = read_metadata(path / METADATA_FILE, recorded)
    if recorded is None and (why := short_shard(path, metadata)):
        raise Torn(str(path), why)
    lacking: tuple[str, ...] = ()
    if recorded is not None:  # each listed file: here, or on another rank (listed)
        lacking = check_listed(recorded, path, {STATE_FILE, METADATA_FILE, *files_read(metadata)})
    return state, metadata, recorded, lacking


def _lacking(small: tuple[dict[str, Any], Any, Any, tuple[str, ...]]) -> tuple[str, ...]:
    return small[3]


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
    """Restore the newest sharded checkpoint that is whole on every rank; its meta.

    None when there is no checkpoint at all. Loaders made by ``ctx.dataloader``
    (now or later) get their saved positions through ``loaders``.
    """
    extra = _check_extra(extra)
    _refuse_sharded_extra(extra)
    rank_state = perrank.check_rank_state(rank_state)
    _, listed = on_rank_zero(place, partial(candidates, directory), broadcast=True)
    assert isinstance(listed, Candidates)
    if not listed.found and not listed.files:
        return None
    for name in listed.dirs:
        path = directory / name
        attempt = _load_shards(
            place, device, path, listed, model, optimizer, scheduler, allow_world_size_change
        )
        if attempt is not None:
            if place.rank == 0:
                say_alike(directory, path)
            state, changed = attempt
            return _restore_rest(
                place,
                state,
                path,
                changed,
                loaders,
                base_seed,
                scheduler,
                scaler,
                extra,
                rank_state,
            )
    raise none_loads(directory, listed.found, listed.files)


def _load_shards(
    place: Place,
    device: torch.device,
    path: Path,
    listed: Candidates,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    allow_world_size_change: bool,
) -> tuple[dict[str, Any], bool] | None:
    """``path``'s shards loaded into ``model``/``optimizer``; its ``ddpctx.pt`` and whether the
    world size changed. None (on every rank) when some rank found it damaged or torn.
    """
    manifest = path / SHARDED_MANIFEST
    outcome = read_together(
        place, path, manifest, partial(read_small, place, path, device), _lacking
    )
    whole_here, small = outcome  # in two steps: unpacked at once, mypy infers T | None for T
    if not whole_here:
        return None
    assert small is not None
    state, metadata, recorded, _ = small
    refuse_newer_file(path.parent, path, listed.files)
    changed = check_world_size(state, path, place.world_size, allow_world_size_change)
    if changed:
        saved = saved_loaders(state.get("loaders") or [])
        check_scheduler(scheduler, state.get("scheduler"), saved, place.world_size, repr(str(path)))
    if optimizer is not None and not state["optimizer_saved"]:
        raise ValueError(
            f"{str(path)!r} was saved without an optimizer, so its state cannot be restored. "
            "Leave optimizer= out of this load_checkpoint (a fresh optimizer), or resume from a "
            "checkpoint saved with one."
        )
    from torch.distributed.checkpoint.state_dict import set_state_dict

    shards = sharded_state(model, optimizer)  # this world size's layout; DCP reshards into it
    shards_read, _ = read_together(
        place, path, manifest, partial(_read_shards, shards, path, metadata, recorded)
    )
    if not shards_read:
        return None
    set_state_dict(
        model,
        [] if optimizer is None else [optimizer],
        model_state_dict=shards["model"],
        optim_state_dict=shards.get("optimizer", {}),
    )
    return state, changed


def _read_shards(
    shards: dict[str, Any], path: Path, metadata: Any, recorded: dict[str, Recorded] | None
) -> None:
    """This rank's shards of ``path`` read into ``shards`` by DCP, each entry verified.

    DCP's load step alone, with no collective of its own: for a load, DCP's
    default plan is each rank's own (its global step changes nothing), and its
    collectives only gathered and scattered the plans and every rank's outcome
    -- three object collectives, ~4-10 ms of a 3-rank load here. What the
    ranks found is exchanged by the caller's one 1-element vote instead.
    Raises what DCP's reader raised (``Damaged``, ``RefusedCheckpoint``, ...).
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from ddpctx.checkpoint.dcpread import Reader, cause_of, failures_said

    try:
        _load_state_dict(shards, storage_reader=Reader(path, metadata, recorded), no_dist=True)
    except CheckpointException as error:  # DCP wraps what its reader raised: say it plainly
        if (interrupt := _interrupt_of(error)) is not None:
            raise interrupt from None  # Ctrl-C stays Ctrl-C: this rank leaves, the others name it
        if (cause := cause_of(error)) is not None:
            raise cause from None
        # a BaseException: as an Exception, it reaches the other ranks through the vote
        said = failures_said(error)[:300]
        raise RuntimeError(
            f"DCP could not read the shards of {str(path)!r} ({said}). Make the files named "
            "readable on this rank's host (permissions, the file system's mount), or move "
            "this checkpoint away to resume from an older one."
        ) from error


def _interrupt_of(error: BaseException) -> BaseException | None:
    """A ``KeyboardInterrupt`` (or ``SystemExit``: SIGTERM) among DCP's wrapped failures."""
    failures = getattr(error, "failures", None)
    for failure in failures.values() if isinstance(failures, dict) else ():
        cause = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(cause, BaseException) and not isinstance(cause, Exception):
            return cause
    return None


def _restore_rest(
    place: Place,
    state: dict[str, Any],
    path: Path,
    changed: bool,
    loaders: LoaderBook,
    base_seed: int | None,
    scheduler: Any,
    scaler: Any,
    extra: dict[str, Any],
    rank_state: dict[str, Any],
) -> dict[str, Any]:
    """Everything but the shards, from ``ddpctx.pt``; the meta ``load_checkpoint`` returns."""
    _restore_replicated(state, path, scheduler, scaler, extra)
    step = state.get("step")
    where = repr(str(path))
    watch = None
    if changed:
        seed = base_seed if base_seed is not None else state.get("base_seed") or 0
        fresh = derived_seed(seed, place.rank, step or 0, place.world_size)
        perrank.reseed(rank_state, fresh, where, int(state["world_size"]))
        seed_everything(fresh)
    else:
        saved_ranks = state.get("rank_state") or []
        mine = saved_ranks[place.rank] if saved_ranks else {}
        watch = perrank.restore(rank_state, mine, where).check
        set_rng_state(state["rng"][place.rank])
    loaders.restore(saved_loaders(state.get("loaders") or []), before_resumed_pass=watch)
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
