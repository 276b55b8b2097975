"""Where sharded checkpoints live: their directory names, which one is newest, pruning.

The on-disk layout of :mod:`ddpctx.checkpoint.sharded`, as
:mod:`ddpctx.checkpoint.files` is that of single-file checkpoints: a
sharded checkpoint is a directory ``checkpoint-NNNNNN[-epochE][-stepS].dcp/``
numbered in the same sequence as the files, complete when DCP's
``.metadata`` and ddpctx's ``ddpctx.pt`` are both there and every file
matches the checksum manifest ``ddpctx.sums`` (:mod:`ddpctx.checkpoint.sums`).

Example:
    >>> checkpoint_dirs(Path("/nonexistent"))
    []
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

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
)
from ddpctx.checkpoint.sums import SHARDED_MANIFEST, intact
from ddpctx.utils.atomic import is_abandoned
from ddpctx.utils.warn import warn_user

STATE_FILE = "ddpctx.pt"
_NAME = re.compile(r"^checkpoint-(\d{6,})(-[a-z0-9-]+)?\.dcp$")


def checkpoint_dirs(directory: Path) -> list[Path]:
    """The sharded checkpoint directories in ``directory``, newest (highest number) first."""
    if not directory.is_dir():
        return []
    numbered = [
        (int(match.group(1)), path.name, path)
        for path in directory.iterdir()
        if (match := _NAME.match(path.name)) and path.is_dir()
    ]
    return [path for _, _, path in sorted(numbered, reverse=True)]


def next_checkpoint_dir(directory: Path, epoch: object = None, step: int | None = None) -> Path:
    """One past the highest number of any checkpoint here (file or directory), labelled.

    >>> import tempfile
    >>> next_checkpoint_dir(Path(tempfile.mkdtemp()), epoch=2, step=40).name
    'checkpoint-000001-epoch2-step40.dcp'
    """
    return next_name(directory, epoch, step, ".dcp")


def complete(path: Path) -> bool:
    """Whether the directory holds a whole, undamaged checkpoint; warns (and says why) if not.

    The checksums are verified before anything in it is unpickled.
    """
    missing = [name for name in (STATE_FILE, ".metadata") if not (path / name).is_file()]
    if missing:
        names = " and ".join(f"DCP's {n}" if n == ".metadata" else n for n in missing)
        warn_user(
            f"skipping {str(path)!r}: it lacks {names} (incomplete, or altered after it was "
            "written); trying an older checkpoint.",
            RuntimeWarning,
        )
        return False
    if not (path / SHARDED_MANIFEST).exists() and (why := short_shard(path)):
        warn_user(
            f"skipping {str(path)!r}: it is torn: {why}; trying an older checkpoint.",
            RuntimeWarning,
        )
        return False
    if not intact(path / SHARDED_MANIFEST, path, (STATE_FILE, ".metadata"), path):
        return False
    return probe(path / STATE_FILE) is not None


def short_shard(path: Path) -> str | None:
    """Without a manifest: a shard shorter than DCP's ``.metadata`` says it is; None if none is.

    DCP reads ``.metadata`` with pickle when it loads, so reading it here trusts nothing more.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    try:
        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as error:
        return f"its .metadata cannot be read ({type(error).__name__}: {str(error)[:200]})"
    needed: dict[str, int] = {}
    for info in storage.values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        shard = path / name
        seen = shard.stat().st_size if shard.is_file() else None
        if seen is None or seen < size:
            have = "is missing" if seen is None else f"has {seen} bytes"
            return f"{name!r} {have}, and DCP's .metadata needs {size}"
    return None


def newest_is_sharded(directory: Path) -> bool:
    """Whether the highest-numbered checkpoint in ``directory`` is a sharded one (loaded or not).

    What ``load_checkpoint`` of an unsharded model decides by: it then reads sharded checkpoints.
    """
    dirs, files = checkpoint_dirs(directory), checkpoint_paths(directory)
    return bool(dirs) and (not files or number_of(dirs[0]) > number_of(files[0]))


def newest_checkpoint_dir(directory: Path) -> Path | None:
    """The newest complete sharded checkpoint; None when there is no checkpoint at all.

    A single-file checkpoint newer than it (the run went on unsharded) is an
    error: loading the older sharded one would silently go back in time.
    """
    refuse_a_file(directory)
    found = checkpoint_dirs(directory)
    for path in found:
        if complete(path):
            newer = [f for f in checkpoint_paths(directory) if number_of(f) > number_of(path)]
            if newer:
                raise RefusedCheckpoint(
                    f"{str(directory)!r}: the newest checkpoint, {newer[0].name}, is a "
                    f"single-file checkpoint written from an unsharded model, newer than the "
                    f"newest sharded one ({path.name}), and this model is sharded. Load it into "
                    "the unsharded model (then ctx.shard it and save again), or move the newer "
                    "files away to resume from the sharded checkpoint."
                )
            return path
    if found:
        raise RuntimeError(
            f"{str(directory)!r} holds {len(found)} sharded checkpoint(s) "
            f"({', '.join(p.name for p in found[:5])}) and none of them loads (each is torn or "
            "damaged: see the warnings). Refusing to start over silently: restore a good "
            "checkpoint, or move the directory away to start a new run."
        )
    files = checkpoint_paths(directory)
    if files:
        raise RefusedCheckpoint(
            f"{str(directory)!r} holds only single-file checkpoints ({files[0].name}, ...), "
            "written from an unsharded model, and this model is sharded. Load it into the "
            "unsharded model first (then ctx.shard it and save again), or use another directory."
        )
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
    """Whether the sharded checkpoint ``path`` is complete and matches its manifest (no warning)."""
    return quietly(complete, path)
