"""Training checkpoint files: their names, which one is newest, which ones to prune.

- A training checkpoint is one file written by :func:`~ddpctx.utils.atomic.atomic_save`,
  named for its order and for what it holds: ``checkpoint-000007-epoch3.pt``,
  ``checkpoint-000012-epoch5-step1200.pt`` (the six digits count saves and
  order them; the rest is for people; two of one number are copied in, never
  saved: :func:`say_alike`). It holds the bare model's state, the
  optimizer's, scheduler's, AMP scaler's and any ``extra`` objects' states,
  the caller's meta (converted by :mod:`ddpctx.checkpoint.meta` so it always loads), the
  world size, the position of every loader (:mod:`ddpctx.data.sampling`), and
  **every rank's** generator states, so each rank resumes with exactly its
  own random stream.
- Beside each file, ``checkpoint-000007-epoch3.pt.sums`` records its size and
  checksum (:mod:`ddpctx.checkpoint.sums`), written before the file is renamed
  into place; copy both.
- Three cases are told apart: a file *torn* by a crash or *damaged* since
  it was saved (not a readable torch file, or not the bytes its manifest
  records: skipped with a warning, the next older one is used), a file that
  reads but is *refused* (:func:`read_state`: ``weights_only`` refuses what
  it holds -- pickled code, refused as unsafe -- or it is not a ddpctx
  checkpoint: an error naming it, never skipped silently), and no checkpoint
  at all (None). When checkpoints exist and none loads, that is an error
  too, never "start over". :func:`newest_checkpoint` decides so for one
  process that reads the file (``load_weights``); ``load_checkpoint`` has
  every rank verify and read its own copy (:mod:`ddpctx.checkpoint.resume`).
- :func:`prune` never deletes the newest loadable checkpoint. A checkpoint
  with the same epoch and step as a newer one is superseded and removed
  (a mid-epoch save at the last step, then the end-of-epoch save). The
  ``keep`` of the last save is stored, so loading prunes again what a stop
  between the rename and the prune left behind. Pruning reads no
  checkpoint's tensors (:func:`loads`).
- :func:`check_single_writer`: two jobs writing one directory would reuse
  numbers and prune each other's newest files. A run remembers the newest
  checkpoint it wrote or loaded; a newer one it did not write means another
  writer, and saving is refused.
- Temporaries of any checkpoint in the directory that a killed save left
  behind are removed at the next save or load (see :func:`~ddpctx.utils.atomic.is_abandoned`).

Everything is loaded with ``weights_only=True``: the states are stored as
tensors and plain numbers, so no pickled code is ever needed.

This module does the file work; :class:`ddpctx.DistContext` decides which rank
writes and makes the others wait.

Why one module: names, the newest that loads, refusals and pruning are one
rule set -- which files count as a run's checkpoints, in which order, and
which of them load -- and each of them is read with the others.

Example:
    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "weights.pt"
    >>> atomic_save({"w": torch.ones(2)}, target)
    >>> torch.load(target, weights_only=True)["w"]
    tensor([1., 1.])
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpctx.checkpoint.claims import check_torch_file, refusal
from ddpctx.checkpoint.regular import NotRegular, open_regular
from ddpctx.checkpoint.shape import check_loaded
from ddpctx.checkpoint.sums import (
    Damaged,
    Torn,
    damaged_warning,
    found_damaged,
    intact,
    sidecar,
    sizes_differ,
)
from ddpctx.checkpoint.sums import RefusedCheckpoint as RefusedCheckpoint  # its old home
from ddpctx.parallel.wrapping import unwrap_model
from ddpctx.utils.atomic import atomic_save, remove_abandoned
from ddpctx.utils.warn import warn_user

__all__ = [
    "FORMAT",
    "atomic_save",
    "check_single_writer",
    "check_world_size",
    "checkpoint_paths",
    "load_file",
    "newest_checkpoint",
    "next_checkpoint_path",
    "prune",
    "training_state",
    "unwrap_model",
]

FORMAT = "ddpctx-checkpoint-1"
_NAME = re.compile(r"^checkpoint-(\d{6,})(-[a-z0-9-]+)?\.pt$")


def bare(item: Any) -> Any:
    """A module without its DDP / compile wrappers; anything else as it is."""
    return unwrap_model(item) if isinstance(item, nn.Module) else item


def load_file(path: Path, device: torch.device | str, weights_only: bool) -> Any:
    """``torch.load`` with errors that say which file and what to do."""
    if not path.exists():
        raise FileNotFoundError(
            f"{str(path)!r} does not exist. Check the path, or save it first (ctx.save)."
        )
    try:
        return torch.load(path, map_location=device, weights_only=weights_only)
    except Exception as error:
        if weights_only and "GLOBAL" in str(error):  # a pickled callable or class, refused
            raise RuntimeError(
                f"{str(path)!r} holds pickled objects that weights_only=True refuses to run "
                f"({type(error).__name__}). Load it with weights_only=False only if you trust "
                "whoever wrote it."
            ) from error
        raise RuntimeError(
            f"{str(path)!r} could not be loaded as a torch file ({type(error).__name__}: "
            f"{error}). It may be torn or not a checkpoint; use another file."
        ) from error


def checkpoint_paths(directory: Path) -> list[Path]:
    """The checkpoint files in ``directory``, newest (highest number) first."""
    if not directory.is_dir():
        return []
    numbered = [
        (int(match.group(1)), path.name, path)
        for path in directory.iterdir()
        if (match := _NAME.match(path.name))
    ]
    return [path for _, _, path in sorted(numbered, reverse=True)]


#: Any checkpoint's name, a file (``.pt``) or a sharded directory (``.dcp``): one sequence.
ANY_NAME = re.compile(r"^checkpoint-(\d{6,})")
_EITHER = re.compile(r"^checkpoint-(\d{6,})(-[a-z0-9-]+)?\.(pt|dcp)$")


def highest_number(directory: Path) -> int:
    """The highest number of any checkpoint in ``directory``, file or sharded; 0 when none."""
    if not directory.is_dir():
        return 0
    return max(
        (
            int(match.group(1))
            for path in directory.iterdir()
            if (match := ANY_NAME.match(path.name))
        ),
        default=0,
    )


def next_name(directory: Path, epoch: object, step: int | None, suffix: str) -> Path:
    """The next checkpoint's path: one past the highest number, labelled with epoch and step.

    Files and sharded directories share one sequence, so a run that switches
    between DDP and sharding never reuses a number.
    """
    label = ""
    if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0:
        label += f"-epoch{epoch}"
    if step is not None:
        label += f"-step{step}"
    return directory / f"checkpoint-{highest_number(directory) + 1:06d}{label}{suffix}"


def next_checkpoint_path(directory: Path, epoch: object = None, step: int | None = None) -> Path:
    """The next single-file checkpoint's name (:func:`next_name`).

    >>> import tempfile
    >>> next_checkpoint_path(Path(tempfile.mkdtemp()), epoch=3, step=120).name
    'checkpoint-000001-epoch3-step120.pt'
    """
    return next_name(directory, epoch, step, ".pt")


def refuse_a_file(directory: Path) -> None:
    """A checkpoint (file or sharded directory) given where its directory belongs is an error.

    Not "no checkpoint": that would start the run over without a word.
    """
    if directory.exists() and not directory.is_dir():
        what = "a file"
    elif directory.suffix == ".dcp" and ANY_NAME.match(directory.name) and directory.is_dir():
        what = "one sharded checkpoint"
    else:
        return
    raise NotADirectoryError(
        f"load_checkpoint({str(directory)!r}): that is {what}, and load_checkpoint takes the "
        f"directory given to save_checkpoint -- here {str(directory.parent)!r} -- and "
        "restores the newest checkpoint in it. Pass the directory (to resume from an older "
        "checkpoint, move the newer ones out of it)."
    )


def read_state(
    path: Path, device: torch.device | str = "cpu", mmap: bool = False, verified: bool = False
) -> dict[str, Any]:
    """The checkpoint at ``path``, loaded with ``weights_only=True`` onto ``device``.

    What it claims is weighed first (:mod:`ddpctx.checkpoint.claims`: nothing past a
    small multiple of its size is allocated), and what it loaded before anything walks
    it (:mod:`ddpctx.checkpoint.shape`: its depth, and its size with shared parts expanded).
    :class:`~ddpctx.checkpoint.sums.Torn` when it does not read as a torch file (torn, or
    missing); :class:`~ddpctx.checkpoint.sums.Damaged` when it is no regular file (a FIFO:
    never opened, :mod:`ddpctx.checkpoint.regular`); :class:`RefusedCheckpoint` when
    ``weights_only`` refuses what it holds (pickled code: refused as unsafe), it claims
    more than it holds, it is not a ddpctx checkpoint, or it fails to read although
    ``verified`` (its checksum matched: it was written so, it is not torn).
    """
    try:
        with open_regular(path) as stream:  # a FIFO: said, never waited on
            size = os.fstat(stream.fileno()).st_size
            check_torch_file(stream, size, path)
        try:
            state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
        except Exception:
            if not mmap:
                raise
            # a file system that cannot map files, say: read it as torch reads it
            state = torch.load(path, map_location=device, weights_only=True)
    except RefusedCheckpoint:
        raise
    except NotRegular as error:
        raise Damaged(str(path), str(error)) from None
    except Exception as error:
        if "Weights only load failed" in str(error):
            reason = str(error).split("WeightsUnpickler error:")[-1].strip().splitlines()[0]
            raise RefusedCheckpoint(
                f"{str(path)!r} reads as a torch file but torch.load(weights_only=True) "
                f"refuses what it holds ({reason}): refused as unsafe, since unpickling it could "
                "run code. It was not skipped: older checkpoints would silently lose progress. If "
                "you trust the file, load it with torch.load(path, weights_only=False), store "
                "its values as plain numbers/strings/tensors, and save it again (or move it away)."
            ) from error
        missing = isinstance(error, FileNotFoundError)
        said = f"{type(error).__name__}: {str(error)[:200]}"
        if verified and not missing:
            raise refusal(path, f"data that does not read as a checkpoint ({said})") from None
        raise Torn(
            str(path),
            f"{path.name!r} is missing"
            if missing
            else f"{path.name!r} does not read as a torch file ({said})",
        ) from error
    check_loaded(state, size, path)  # before anything walks it: its depth, its expanded size
    if not (isinstance(state, dict) and state.get("format") == FORMAT):
        raise RefusedCheckpoint(
            f"{str(path)!r} is named like a checkpoint but is not a ddpctx checkpoint (no "
            f"format {FORMAT!r}). Move it out of the checkpoint directory, or load it yourself."
        )
    return state


def probe(path: Path, verified: bool = False) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (memory-mapped), None if torn or damaged (warned);
    RefusedCheckpoint if refused.

    ``verified``: its checksum just matched, so a failure to read it is a refusal.
    """
    try:
        return read_state(path, mmap=True, verified=verified)
    except Torn as error:
        warn_user(
            f"skipping {str(path)!r}: it is torn: {error.reason}; trying an older checkpoint.",
            RuntimeWarning,
        )
    except Damaged as error:  # no regular file (a FIFO)
        warn_user(damaged_warning(path, error.reason, sidecar(path)), RuntimeWarning)
    return None


def newest_checkpoint(
    directory: Path, probed: dict[Path, dict[str, Any]] | None = None
) -> Path | None:
    """The newest checkpoint in ``directory`` that loads; None only if there is none at all.

    Torn files are skipped with a warning; a refused file is an error; when
    checkpoints exist and none of them loads, that is an error. ``probed``
    receives the state read of the one chosen (memory-mapped), by its path.
    """
    refuse_a_file(directory)
    paths = checkpoint_paths(directory)
    for path in paths:  # the checksums first: a damaged file is never unpickled
        verified = sidecar(path).exists()
        if (
            intact(sidecar(path), path.parent, (path.name,), path)
            and (state := probe(path, verified)) is not None
        ):
            if probed is not None:
                probed[path] = state
            say_lost(directory, path)
            say_alike(directory, path)
            return path
    if paths:
        raise RuntimeError(
            f"{str(directory)!r} holds {len(paths)} checkpoint file(s) "
            f"({', '.join(p.name for p in paths[:5])}) and none of them loads (each is torn or "
            "damaged: see the warnings). "
            "Refusing to start over silently: restore a good checkpoint, or move the "
            "directory away to start a new run."
        )
    return None


def label_of(path: Path, names: re.Pattern[str] = _NAME) -> str:
    """The ``-epoch3-step120`` part of a checkpoint's name ('' when it has none).

    ``names``: the pattern of its kind of checkpoint (single files by default).
    """
    match = names.match(path.name)
    return (match.group(2) or "") if match else ""


def prune(directory: Path, keep: int, newest_good: Path) -> None:
    """Delete checkpoints older than the newest ``keep`` that load, never ``newest_good``.

    ``newest_good`` is known to load. A damaged or torn checkpoint does not
    count towards ``keep`` (:func:`beyond_keep`), so it never pushes out one
    that loads. Older checkpoints labelled with the same epoch and step as
    ``newest_good`` are superseded by it and deleted first.
    """
    label = label_of(newest_good)
    paths = checkpoint_paths(directory)
    if label:
        for older in paths:
            if older != newest_good and label_of(older) == label:
                remove_checkpoint_file(older)
        paths = checkpoint_paths(directory)
    for old in beyond_keep(paths, keep, newest_good, loads):
        remove_checkpoint_file(old)
    for manifest in directory.glob("checkpoint-*.pt.sums"):  # a save stopped before its rename
        orphan = manifest.with_name(manifest.name.removesuffix(".sums"))
        if not orphan.exists() and number_of(orphan) < number_of(newest_good):
            manifest.unlink(missing_ok=True)


def beyond_keep(
    found: list[Path], keep: int, newest_good: Path, loads: Callable[[Path], bool]
) -> list[Path]:
    """Which of ``found`` (newest first) to prune: those older than the ``keep``-th that loads.

    ``newest_good`` (known to load) counts; each older one counts if ``loads``
    says so, asked newest first and only until ``keep`` are counted (with
    ``keep=2``, one look at the previous checkpoint per save). A newer one
    than ``newest_good`` (skipped at load as damaged or torn) never counts and
    is never pruned by this rule: it is the older checkpoints, not it, that
    hold the run's progress.

    >>> names = [Path(f"checkpoint-00000{n}.pt") for n in (3, 2, 1)]
    >>> [p.name for p in beyond_keep(names, 2, names[0], lambda p: p != names[1])]
    []
    >>> [p.name for p in beyond_keep(names, 2, names[0], lambda p: True)]
    ['checkpoint-000001.pt']
    """
    counted = 0
    for index, path in enumerate(found):
        older = number_of(path) < number_of(newest_good)
        if path == newest_good or (older and loads(path)):
            counted += 1
            if counted >= keep:
                return [old for old in found[index + 1 :] if old != newest_good]
    return []


def quietly(check: Callable[[Path], bool], path: Path) -> bool:
    """``check(path)`` without its "skipping ..." warnings; False for a refused checkpoint.

    Pruning asks whether a checkpoint loads; only loading warns about one it skips.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            return check(path)
        except RefusedCheckpoint:
            return False


def loads(path: Path) -> bool:
    """Whether the single-file checkpoint ``path`` counts as one that loads, for pruning.

    No warning, and no read of its bytes: there, at its recorded size, it reads as
    a ddpctx checkpoint (memory-mapped: its tensors are not read), and no load in
    this process found it damaged.
    """
    return quietly(
        lambda p: (
            not found_damaged(p)
            and (not sidecar(p).exists() or sizes_differ(sidecar(p), p.parent, (p.name,)) is None)
            and probe(p) is not None
        ),
        path,
    )


def remove_checkpoint_file(path: Path) -> None:
    """Delete a single-file checkpoint and its checksum manifest."""
    path.unlink(missing_ok=True)
    sidecar(path).unlink(missing_ok=True)


def remove_abandoned_checkpoint_temporaries(directory: Path) -> None:
    """Remove what killed saves of any checkpoint in ``directory`` left behind.

    A save killed after its manifest was written and before the rename leaves the
    manifest too: it goes with the temporary (its checkpoint was never published).
    """
    names = {path.name.split(".")[1] for path in directory.glob(".checkpoint-*.tmp")}
    for name in names:
        if _NAME.match(name + ".pt"):
            target = directory / (name + ".pt")
            remove_abandoned(target)
            if not target.exists() and not _saving(target):
                sidecar(target).unlink(missing_ok=True)


def _saving(target: Path) -> bool:
    """Whether a temporary of ``target`` is there (a save in flight, or killed and not cleaned)."""
    return any(target.parent.glob(f".{target.name}.*.tmp"))


def lost_checkpoints(directory: Path, chosen: Path) -> list[Path]:
    """Checkpoint files newer than ``chosen`` that are gone while their manifests are there.

    A manifest is written just before its checkpoint is published, and removed with it;
    one left without its file (and no save of it in flight) means the file was deleted,
    or not copied, after it was saved.
    """
    lost = []
    for manifest in directory.glob("checkpoint-*.pt.sums"):
        target = manifest.with_name(manifest.name.removesuffix(".sums"))
        newer = _NAME.match(target.name) and number_of(target) > number_of(chosen)
        if newer and not target.exists() and not _saving(target):
            lost.append(target)
    return sorted(lost, key=number_of, reverse=True)


def say_lost(directory: Path, chosen: Path) -> None:
    """Warn, naming it, when a checkpoint newer than ``chosen`` was lost (see above)."""
    lost = lost_checkpoints(directory, chosen)
    if lost:
        names = ", ".join(path.name for path in lost)
        warn_user(
            f"{str(lost[0])!r} is missing though its checksum manifest {sidecar(lost[0]).name!r} "
            f"is there: the newer checkpoint(s) {names} were saved, then deleted or not copied. "
            f"Using the older {chosen.name!r}, which loses the progress since. Copy "
            f"{lost[0].name!r} back beside its manifest to resume from it, or remove "
            f"{sidecar(lost[0]).name!r} if it is gone for good.",
            RuntimeWarning,
        )


def say_alike(directory: Path, chosen: Path) -> None:
    """Warn, naming them, when other checkpoints in ``directory`` have ``chosen``'s number.

    ddpctx numbers every save past the highest number there (files and sharded
    folders alike), so two of one number were copied or renamed in, and which is
    newer cannot be told. Every reader takes the same one: of one number, a sharded
    ``.dcp`` before a ``.pt`` (every reader reads both kinds; a sharded model only
    the first), then the last name in order.
    """
    number = number_of(chosen)
    others = sorted(
        path.name
        for path in directory.iterdir()
        if path != chosen and _EITHER.match(path.name) and number_of(path) == number
    )
    if others:
        names = ", ".join(others)
        warn_user(
            f"{str(directory)!r} holds {len(others) + 1} checkpoints numbered {number:06d}: "
            f"{chosen.name} and {names}. ddpctx never saves two under one number (they were "
            "copied or renamed into the directory), so which is newer cannot be told. Using "
            f"{chosen.name!r}, as every reader does (of one number: a sharded .dcp before a "
            f".pt, then the last name in order). Move {names} out of the directory, or, to "
            f"resume from {'it' if len(others) == 1 else 'one of them'}, move the others out.",
            RuntimeWarning,
        )


def check_single_writer(directory: Path, last_seen: str | None) -> None:
    """Refuse to save when a checkpoint newer than ``last_seen`` (ours) appeared: another writer."""
    if last_seen is None:
        return
    newest = checkpoint_paths(directory)[:1]
    if newest and newest[0].name != last_seen and number_of(newest[0]) > number_of(Path(last_seen)):
        raise RuntimeError(
            f"{str(directory)!r} holds {newest[0].name!r}, which this run did not write: its "
            f"newest save or load was {last_seen!r}. Another job is writing checkpoints to the "
            "same directory; the two would reuse numbers and prune each other's newest files. "
            "Give each run its own checkpoint directory (or stop the other job)."
        )


def number_of(path: Path) -> int:
    """A checkpoint's number (file or sharded directory); -1 for any other name."""
    match = ANY_NAME.match(path.name)
    return int(match.group(1)) if match else -1


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    meta: dict[str, Any],
    world_size: int,
    rng_states: list[Any],
    *,
    scaler: Any = None,
    extra: dict[str, Any] | None = None,
    loaders: list[dict[str, Any]] | None = None,
    step: int | None = None,
    base_seed: int | None = None,
    rank_states: list[dict[str, Any]] | None = None,
    keep: int | None = None,
) -> dict[str, Any]:
    """Everything a checkpoint file holds (see the module docstring)."""
    return {
        "format": FORMAT,
        "world_size": world_size,
        "model": unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "optimizer_type": type(optimizer).__qualname__ if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scheduler_type": type(scheduler).__qualname__ if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "extra": {name: bare(item).state_dict() for name, item in (extra or {}).items()},
        "meta": meta,
        "rng": rng_states,
        "loaders": loaders or [],
        "step": step,
        "base_seed": base_seed,
        "rank_state": rank_states or [],
        "keep": keep,
    }


def check_world_size(
    state: dict[str, Any], path: Path, world_size: int, allow_change: bool = False
) -> bool:
    """True if the world size changed (allowed); an error if it changed and that is not allowed."""
    if state["world_size"] == world_size:
        return False
    if allow_change:
        return True
    raise ValueError(
        f"{str(path)!r} was written by a run of world size {state['world_size']}, and this "
        f"run has world size {world_size}: each rank's random state cannot be restored, so "
        f"the run would not continue exactly. Resume with {state['world_size']} ranks, or pass "
        "load_checkpoint(..., allow_world_size_change=True) to continue with fresh per-rank "
        "random states and the data position mapped by samples consumed."
    )
