"""Where sharded checkpoints live: their directory names, which one is newest, pruning.

The on-disk layout of :mod:`ddpctx.checkpoint.sharded`, as
:mod:`ddpctx.checkpoint.files` is that of single-file checkpoints: a
sharded checkpoint is a directory ``checkpoint-NNNNNN[-epochE][-stepS].dcp/``
numbered in the same sequence as the files, complete when DCP's
``.metadata`` and ddpctx's ``ddpctx.pt`` are both there and every file
matches the checksum manifest ``ddpctx.sums`` (:mod:`ddpctx.checkpoint.sums`).

- :func:`candidates`: what rank 0 lists for ``load_checkpoint`` (names only:
  each rank then verifies its own copy, :mod:`ddpctx.checkpoint.shardload`).
- :func:`newest_checkpoint_dir` / :func:`complete`: the choice for one
  process that reads the whole checkpoint (``load_weights``): every file
  verified, DCP's ``.metadata`` unpickled restricted
  (:mod:`ddpctx.checkpoint.dcpread`; one carrying code is an error).
- :func:`prune_dirs` reads no shard to decide what counts as loading
  (:func:`loads`).

Example:
    >>> checkpoint_dirs(Path("/nonexistent"))
    []
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpctx.checkpoint.files import (
    RefusedCheckpoint,
    beyond_keep,
    checkpoint_paths,
    label_of,
    next_name,
    number_of,
    probe,
    quietly,
    refuse_a_file,
    say_alike,
)
from ddpctx.checkpoint.listed import short_shard
from ddpctx.checkpoint.regular import not_regular
from ddpctx.checkpoint.sums import (
    SHARDED_MANIFEST,
    Damaged,
    damaged_warning,
    found_damaged,
    intact,
    read_manifest,
    sizes_differ,
)
from ddpctx.utils.atomic import is_abandoned
from ddpctx.utils.warn import warn_user

STATE_FILE = "ddpctx.pt"
METADATA_FILE = ".metadata"
_NAME = re.compile(r"^checkpoint-(\d{6,})(-[a-z0-9-]+)?\.dcp$")


def checkpoint_dirs(directory: Path) -> list[Path]:
    """The sharded checkpoint directories in ``directory``, newest (highest number) first."""
    if not directory.is_dir():
        return []
    numbered = []
    for path in directory.iterdir():
        if (match := _NAME.match(path.name)) and path.is_dir():
            numbered.append((int(match.group(1)), path.name, path))
        elif match and path.is_symlink():  # a loop, or its target gone: not silently ignored
            warn_user(
                f"ignoring {str(path)!r}: it is named like a sharded checkpoint but is a "
                "symbolic link that leads to no directory (a loop, or its target is gone). "
                "Point it at the checkpoint directory, or remove it.",
                RuntimeWarning,
            )
    return [path for _, _, path in sorted(numbered, reverse=True)]


def next_checkpoint_dir(directory: Path, epoch: object = None, step: int | None = None) -> Path:
    """One past the highest number of any checkpoint here (file or directory), labelled.

    >>> import tempfile
    >>> next_checkpoint_dir(Path(tempfile.mkdtemp()), epoch=2, step=40).name
    'checkpoint-000001-epoch2-step40.dcp'
    """
    return next_name(directory, epoch, step, ".dcp")


def lacks_files(path: Path) -> bool:
    """Whether the directory lacks ``ddpctx.pt`` or DCP's ``.metadata`` (warned: it is skipped).

    One that is there but no regular file (a FIFO) is damage, said as what it is.
    """
    for name in (STATE_FILE, METADATA_FILE):
        if why := not_regular(path / name):
            warn_user(damaged_warning(path, why, path / SHARDED_MANIFEST), RuntimeWarning)
            return True
    missing = [name for name in (STATE_FILE, METADATA_FILE) if not (path / name).is_file()]
    if not missing:
        return False
    names = " and ".join(f"DCP's {n}" if n == METADATA_FILE else n for n in missing)
    warn_user(
        f"skipping {str(path)!r}: it lacks {names} (incomplete, or altered after it was "
        "written); trying an older checkpoint.",
        RuntimeWarning,
    )
    return True


def complete(path: Path, probed: dict[Path, dict[str, Any]] | None = None) -> bool:
    """Whether the directory holds a whole, undamaged checkpoint; warns (and says why) if not.

    For one process that reads the whole checkpoint (``load_weights``): every
    file is verified against the manifest before anything in it is unpickled,
    and DCP's ``.metadata`` is unpickled restricted (a refused one is an error).
    ``probed`` receives its ``ddpctx.pt``'s state, by ``path``.
    """
    from ddpctx.checkpoint.dcpread import read_metadata

    if lacks_files(path):
        return False
    manifest = path / SHARDED_MANIFEST
    if not intact(manifest, path, (STATE_FILE, METADATA_FILE), path):
        return False
    recorded = read_manifest(manifest) if manifest.exists() else None
    if isinstance(recorded, str):  # changed since it was verified just now
        warn_user(
            f"skipping {str(path)!r}: {recorded}; trying an older checkpoint.", RuntimeWarning
        )
        return False
    try:
        metadata = read_metadata(path / METADATA_FILE, recorded)
    except Damaged as error:
        warn_user(
            f"skipping {str(path)!r}: it is torn: {error.reason}; trying an older checkpoint.",
            RuntimeWarning,
        )
        return False
    if recorded is None and (why := short_shard(path, metadata)):
        warn_user(
            f"skipping {str(path)!r}: it is torn: {why}; trying an older checkpoint.",
            RuntimeWarning,
        )
        return False
    state = probe(path / STATE_FILE, verified=recorded is not None)
    if state is not None and probed is not None:
        probed[path] = state
    return state is not None


def newest_is_sharded(directory: Path) -> bool:
    """Whether the highest-numbered checkpoint in ``directory`` is a sharded one (loaded or not).

    What ``load_checkpoint`` of an unsharded model decides by: it then reads sharded checkpoints.
    A sharded one and a file of one number (copied in, see
    :func:`~ddpctx.checkpoint.files.say_alike`): the sharded one, which every model loads.
    """
    dirs, files = checkpoint_dirs(directory), checkpoint_paths(directory)
    return bool(dirs) and (not files or number_of(dirs[0]) >= number_of(files[0]))


def newest_checkpoint_dir(
    directory: Path, probed: dict[Path, dict[str, Any]] | None = None
) -> Path | None:
    """The newest complete sharded checkpoint; None when there is no checkpoint at all.

    For one process that reads the whole checkpoint (every file verified). A
    single-file checkpoint newer than it (the run went on unsharded) is an
    error: loading the older sharded one would silently go back in time.
    ``probed`` receives its ``ddpctx.pt``'s state (:func:`complete`).
    """
    refuse_a_file(directory)
    found = checkpoint_dirs(directory)
    files = [path.name for path in checkpoint_paths(directory)]
    for path in found:
        if complete(path, probed):
            refuse_newer_file(directory, path, files)
            say_alike(directory, path)
            return path
    if found or files:
        raise none_loads(directory, [path.name for path in found], files)
    return None


def prune_dirs(directory: Path, keep: int, newest_good: Path) -> None:
    """Delete directories older than the newest ``keep`` that load, never ``newest_good``.

    As for single-file checkpoints (:func:`~ddpctx.checkpoint.files.prune`),
    a damaged or torn directory does not count towards ``keep``, and older
    ones labelled with the same epoch and step as ``newest_good`` are
    superseded by it and deleted first.
    """
    label = label_of(newest_good, _NAME)
    if label:
        for older in checkpoint_dirs(directory):
            if older != newest_good and label_of(older, _NAME) == label:
                shutil.rmtree(older, ignore_errors=True)
    for old in beyond_keep(checkpoint_dirs(directory), keep, newest_good, loads):
        shutil.rmtree(old, ignore_errors=True)
    for stale in directory.glob(".checkpoint-*.dcp.*.tmp"):
        if is_abandoned(stale):  # a killed save's leftovers; never a live writer's
            shutil.rmtree(stale, ignore_errors=True)


def loads(path: Path) -> bool:
    """Whether the sharded checkpoint ``path`` counts as one that loads, for pruning (no warning).

    Reads none of its shards: its files are there, at their recorded sizes, its
    ``ddpctx.pt`` reads (memory-mapped), and no load in this process found it damaged.
    """
    return quietly(_looks_whole, path)


def _looks_whole(path: Path) -> bool:
    if found_damaged(path) or lacks_files(path):
        return False
    manifest = path / SHARDED_MANIFEST
    if manifest.exists():
        if sizes_differ(manifest, path, (STATE_FILE, METADATA_FILE)) is not None:
            return False
    else:
        from ddpctx.checkpoint.dcpread import read_metadata

        try:
            if short_shard(path, read_metadata(path / METADATA_FILE, None)):
                return False
        except Damaged:
            return False
    return probe(path / STATE_FILE) is not None


@dataclass(frozen=True)
class Candidates:
    """What rank 0 sees in a checkpoint directory for a sharded load (names, newest first)."""

    dirs: list[str]  # sharded checkpoints with ddpctx.pt and .metadata, to try in turn
    found: list[str]  # every sharded checkpoint directory, whole or not
    files: list[str]  # single-file checkpoints


def candidates(directory: Path) -> Candidates:
    """The sharded checkpoints to try, newest first (those lacking files skipped, warned)."""
    refuse_a_file(directory)
    found = checkpoint_dirs(directory)
    dirs = [path.name for path in found if not lacks_files(path)]
    files = [path.name for path in checkpoint_paths(directory)]
    return Candidates(dirs, [path.name for path in found], files)


def refuse_newer_file(directory: Path, chosen: Path, files: list[str]) -> None:
    """A single-file checkpoint newer than the sharded one ``chosen`` is an error (see below)."""
    newer = [name for name in files if number_of(Path(name)) > number_of(chosen)]
    if newer:
        raise RefusedCheckpoint(
            f"{str(directory)!r}: the newest checkpoint, {newer[0]}, is a "
            f"single-file checkpoint written from an unsharded model, newer than the "
            f"newest sharded one ({chosen.name}), and this model is sharded. Load it into "
            "the unsharded model (then ctx.shard it and save again), or move the newer "
            "files away to resume from the sharded checkpoint."
        )


def none_loads(directory: Path, found: list[str], files: list[str]) -> Exception:
    """The error when no sharded checkpoint in ``directory`` loads (``found``: their names)."""
    if found:
        return RuntimeError(
            f"{str(directory)!r} holds {len(found)} sharded checkpoint(s) "
            f"({', '.join(found[:5])}) and none of them loads (each is torn or damaged: see "
            "the warnings). Refusing to start over silently: restore a good checkpoint, or "
            "move the directory away to start a new run."
        )
    return RefusedCheckpoint(
        f"{str(directory)!r} holds only single-file checkpoints ({files[0]}, ...), "
        "written from an unsharded model, and this model is sharded. Load it into the "
        "unsharded model first (then ctx.shard it and save again), or use another directory."
    )
