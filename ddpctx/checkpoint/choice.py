"""Which checkpoint a reader in one process reads, read once, beside a writer or not.

``checkpoint_meta``, ``load_weights`` and the export (:mod:`ddpctx.checkpoint.weights`,
:mod:`ddpctx.checkpoint.export`) read the checkpoint :func:`chosen_checkpoint` picks
in a directory: ``load_checkpoint``'s for an unsharded model, from
:mod:`ddpctx.checkpoint.files` and :mod:`ddpctx.checkpoint.shardfiles` -- the
newest whose files are all there as saved (:mod:`ddpctx.checkpoint.listed`) and
that loads, torn or damaged ones skipped with a warning; of two with one number,
the one every reader takes (:func:`~ddpctx.checkpoint.files.say_alike`). A
checkpoint named directly is verified too; a damaged one is an error naming the
damage (there is no older one to fall back to: you chose it).

Choosing a checkpoint reads its small state -- a ``.pt`` memory-mapped, a sharded
checkpoint's ``ddpctx.pt`` -- to know that it loads: weighed first
(:mod:`ddpctx.checkpoint.claims`), unpickled, then walked
(:mod:`ddpctx.checkpoint.shape`). :class:`Chosen` hands that state on, so a
reader never reads it twice (each read is the cost of torch's unpickling again).

Beside a running job (:func:`read_chosen`): a job that saves with ``keep=``
removes its older checkpoints while a reader may be reading one. A read of a
directory whose failure or "skipping" warnings coincide with the directory's
checkpoints changing (one published, one removed) was overtaken by the
writer: its warnings are dropped (the checkpoint was removed, not damaged)
and the read starts over on the newest checkpoint as soon as the writer
publishes its next one, for :data:`PATIENCE_S` seconds and at least
:data:`ATTEMPTS` times (a busy machine slows a read past one save, not past
many). A read the directory did not change under is reported as before. A
checkpoint named directly that is removed while it is read is a
``FileNotFoundError`` naming it. Only ddpctx's errors escape: a
failure inside DCP's reader is a ``RuntimeError`` naming the checkpoint.

Example:
    >>> import tempfile
    >>> resolve(tempfile.mkdtemp()) is None
    True
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ddpctx.checkpoint.files import (
    ANY_NAME,
    FORMAT,
    RefusedCheckpoint,
    checkpoint_paths,
    newest_checkpoint,
    probe,
)
from ddpctx.checkpoint.shardfiles import (
    checkpoint_dirs,
    complete,
    newest_checkpoint_dir,
    newest_is_sharded,
)
from ddpctx.checkpoint.sums import intact, sidecar
from ddpctx.utils.warn import warn_user

__all__ = ["Chosen", "chosen_checkpoint", "read_chosen", "read_newest", "resolve"]

T = TypeVar("T")

#: A read a running job's saves overtook starts over at least ATTEMPTS times and for PATIENCE_S
#: seconds, each time after the writer's next save (waited for at most NEXT_SAVE_S seconds).
ATTEMPTS, PATIENCE_S, NEXT_SAVE_S = 8, 30.0, 0.5

#: What choosing read, by checkpoint: a ``.pt``'s state, or a sharded checkpoint's ``ddpctx.pt``.
Probed = dict[Path, dict[str, Any]]


@dataclass(frozen=True)
class Chosen:
    """A checkpoint chosen (``path``) and its small state (``small``), read while choosing it:
    the ``.pt`` memory-mapped (no tensor read), or a sharded checkpoint's ``ddpctx.pt``."""

    path: Path
    small: dict[str, Any]


def chosen_checkpoint(directory: Path, probed: Probed | None = None) -> Path | None:
    """The checkpoint ``load_checkpoint`` restores from ``directory`` into an unsharded model.

    The newest that loads (torn or damaged ones skipped with a warning), a
    ``.pt`` or a ``.dcp``; None when there is no checkpoint at all. ``probed``
    receives the small state read of it.
    """
    if newest_is_sharded(directory):
        return newest_checkpoint_dir(directory, probed)
    return newest_checkpoint(directory, probed)


def resolve(path: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``path`` names: the chosen one of a directory, or the one given (verified).

    None for a directory without checkpoints, or not there yet (a run's first start).
    """
    found = choose(path)
    return None if found is None else found.path


def choose(path: str | os.PathLike[str]) -> Chosen | None:
    """:func:`resolve`, with the small state read while choosing (see :class:`Chosen`)."""
    where = Path(path)
    probed: Probed = {}
    if not where.exists():
        if where.suffix in (".pt", ".dcp"):
            raise FileNotFoundError(f"{str(where)!r} does not exist. Check the path.")
        return None  # a run's first start: no directory yet, as load_checkpoint sees it
    # A checkpoint-NNNNNN*.dcp folder is one sharded checkpoint, also with a file missing
    # (said below, by name), never the directory of checkpoints load_checkpoint takes.
    one_sharded = where.is_dir() and where.suffix == ".dcp" and ANY_NAME.match(where.name)
    if where.is_dir() and not one_sharded:
        chosen = chosen_checkpoint(where, probed)
        return None if chosen is None else Chosen(chosen, probed[chosen])
    if not ANY_NAME.match(where.name):
        raise ValueError(
            f"{str(where)!r} is not a ddpctx checkpoint (those are named checkpoint-NNNNNN*.pt, "
            "or checkpoint-NNNNNN*.dcp folders). An export (python -m ddpctx export) is read "
            "with torch.load(path, weights_only=True); otherwise pass a checkpoint, or the "
            "directory given to ctx.save_checkpoint to read the newest one that loads."
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        if one_sharded:
            good = complete(where, probed)
        else:
            verified = sidecar(where).exists()
            good = intact(sidecar(where), where.parent, (where.name,), where) and _probed(
                where, verified, probed
            )
    for warning in caught:
        if good:  # e.g. "no checksum manifest": said as loading would say it
            warn_user(warning.message, RuntimeWarning)
    if not good:
        said = "; ".join(str(w.message) for w in caught) or "it does not load"
        said = said.replace("; trying an older checkpoint", "").rstrip(".")  # it was named
        raise RuntimeError(
            f"{str(where)!r} cannot be read: {said.replace('skipping ', '', 1)}. Name an older "
            "checkpoint, or pass the directory to use the newest one that loads."
        )
    return Chosen(where, probed[where])


def _probed(path: Path, verified: bool, probed: Probed) -> bool:
    """Whether the one file named loads; not a ddpctx checkpoint (an export?) says so."""
    try:
        state = probe(path, verified)
    except RefusedCheckpoint as error:
        if "not a ddpctx checkpoint" not in str(error):
            raise
        raise ValueError(
            f"{str(path)!r} is not a ddpctx checkpoint (no format {FORMAT!r}). An export "
            "(python -m ddpctx export) is read with torch.load(path, weights_only=True)"
            "['model']; pass a checkpoint, or the directory given to ctx.save_checkpoint."
        ) from error
    if state is not None:
        probed[path] = state
    return state is not None


def listing(directory: Path) -> tuple[str, ...]:
    """The names of the checkpoints in ``directory``, files and folders (what a writer changes)."""
    return tuple(p.name for p in (*checkpoint_paths(directory), *checkpoint_dirs(directory)))


def one_checkpoint(where: Path) -> bool:
    """Whether ``where`` names one checkpoint (a ``.pt`` or ``.dcp``), not their directory."""
    return where.suffix in (".pt", ".dcp") and bool(ANY_NAME.match(where.name))


def read_newest(path: str | os.PathLike[str], read: Callable[[Path], T]) -> tuple[Path, T] | None:
    """``read`` of the checkpoint :func:`resolve` chooses (see :func:`read_chosen`)."""
    return read_chosen(path, lambda chosen: read(chosen.path))


def read_chosen(path: str | os.PathLike[str], read: Callable[[Chosen], T]) -> tuple[Path, T] | None:
    """``read`` of the checkpoint :func:`choose` chooses, started over if a writer overtook it.

    (the checkpoint, what ``read`` returned); None when there is no checkpoint. See the
    module docstring: a directory changed under a read that failed or skipped a
    checkpoint is read again, quietly, on its newest checkpoint.
    """
    where = Path(path)
    directory = where.parent if one_checkpoint(where) else where
    deadline = time.monotonic() + PATIENCE_S
    attempt = 0
    while attempt < ATTEMPTS or time.monotonic() < deadline:
        attempt += 1
        before, existed = listing(directory), where.exists()
        failure: Exception | None = None
        result: tuple[Path, T] | None = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                chosen = choose(where)
                result = None if chosen is None else (chosen.path, read(chosen))
            except RefusedCheckpoint:
                raise  # what it holds is refused, whoever writes beside it
            except (OSError, RuntimeError) as error:
                failure = error
        moved = (failure is not None or bool(caught)) and listing(directory) != before
        if moved and directory is where:
            _next_save(directory)
            continue  # overtaken by the writer: the newest checkpoint, again
        if failure is not None and directory is not where and existed:
            if moved:
                time.sleep(0.1)  # a folder being removed may still be there for a moment
            if not where.exists():
                raise FileNotFoundError(
                    f"{str(where)!r} was removed while it was read: a job saving to "
                    f"{str(directory)!r} with keep= pruned it (or it was deleted). Pass the "
                    "directory to read its newest checkpoint, or copy the checkpoint first."
                ) from None
        for warning in caught:
            warn_user(warning.message, warning.category)
        if failure is not None:
            raise failure
        return result
    raise RuntimeError(
        f"{str(directory)!r} changed under each of {attempt} reads of its newest checkpoint "
        f"in {PATIENCE_S:g} s: the job writing it saves, and prunes (keep=), faster than one "
        "checkpoint is read. "
        "Read it again, save with a larger keep= (each checkpoint then outlives a read), or "
        "copy a checkpoint out of the directory and read the copy."
    )


def _next_save(directory: Path) -> None:
    """Wait (at most :data:`NEXT_SAVE_S`) for the writer's next checkpoint and its pruning.

    A read started just after a save has the whole time until the next one, when
    ``keep=`` prunes it; one started at once may have only the end of that time.
    """
    now = listing(directory)
    give_up = time.monotonic() + NEXT_SAVE_S
    while listing(directory) == now and time.monotonic() < give_up:
        time.sleep(0.005)
    time.sleep(0.01)  # its pruning, right after it is published
