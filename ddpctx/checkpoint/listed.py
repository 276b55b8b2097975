"""Every file a checkpoint's manifest lists must be there: what each reader requires, of whom.

A checkpoint's manifest (:mod:`ddpctx.checkpoint.sums`) lists its files: a
``.pt``'s lists the file; a sharded checkpoint's lists every shard, DCP's
``.metadata`` and ``ddpctx.pt``. A listed file that is gone (deleted, not
copied), there at another size, or no regular file (a FIFO,
:mod:`ddpctx.checkpoint.regular`) makes the checkpoint *damaged*: every reader
skips it, warning with the file's name, and reads the next older one. Who must
hold the file differs, since ranks may not share a file system:

- A reader in one process (``checkpoint_meta``, ``load_weights``, the export)
  reads the checkpoint as one host sees it, and requires every listed file
  there, as saved: each is verified (:func:`~ddpctx.checkpoint.sums.damage`).
- ``load_checkpoint`` requires every listed file of the *job*. Each rank looks
  for each listed file in its own view (:func:`check_listed`: a ``stat``;
  nothing is read but what no rank reads anyway, below) and the ranks agree
  in the vote each load takes already (:mod:`ddpctx.checkpoint.together`): a
  file that **no rank** holds is missing, and every rank skips the checkpoint
  together, warned naming the file. A file that one rank lacks and another
  holds (a shard on the host of the rank that wrote it) is no damage by
  itself: a rank that needs it finds it missing as it reads, and that is.
- Bytes are verified by whoever reads them: each rank the entries it reads
  (:mod:`ddpctx.checkpoint.dcpread`). A listed file that no load reads --
  a shard of empty chunks alone, a file DCP's metadata does not name -- is
  verified whole by each rank that holds it, as a one-process reader does.

Where every rank sees the same directory (a shared file system, as a sharded
save needs: rank 0 renames the directory it wrote into place), the four
readers therefore pick the same checkpoint. Where ranks see different
directories, a one-process reader can judge only the one it reads.

Example:
    >>> import tempfile
    >>> from ddpctx.checkpoint.sums import Recorded
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "a.bin").write_bytes(b"saved")
    >>> listed = {"a.bin": Recorded(5, "?"), "b.bin": Recorded(3, "?")}
    >>> check_listed(listed, folder, read={"a.bin", "b.bin"})
    ('b.bin',)
"""

from __future__ import annotations

import stat
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from ddpctx.checkpoint.regular import describe, not_regular
from ddpctx.checkpoint.sums import Damaged, Recorded, file_damage

METADATA_FILE = ".metadata"


def check_listed(
    recorded: Mapping[str, Recorded], folder: Path, read: Collection[str]
) -> tuple[str, ...]:
    """The files ``recorded`` lists that this rank's view of ``folder`` lacks, sorted.

    :class:`~ddpctx.checkpoint.sums.Damaged` for one that is there at another size or
    is no regular file, or that no load reads (not in ``read``) and whose bytes are not
    those saved (read whole, here).
    """
    lacking = []
    for name, record in sorted(recorded.items()):
        path = folder / name
        try:
            status = path.stat()
        except FileNotFoundError:
            lacking.append(name)
            continue
        if not stat.S_ISREG(status.st_mode):
            raise Damaged(str(path), describe(path, status.st_mode))
        if status.st_size != record.size:
            raise Damaged(
                str(path),
                f"{name!r} has {status.st_size} bytes, and {record.size} were saved "
                "(torn or truncated)",
            )
        if name not in read and (reason := file_damage(path, record)):
            raise Damaged(str(path), reason)
    return tuple(lacking)


def missing_said(names: Collection[str], world_size: int) -> str:
    """How files listed and held by no rank are said: ``'a' is missing on every rank``."""
    where = " on every rank" if world_size > 1 else ""
    said = ", ".join(repr(name) for name in sorted(names))
    verb, them = ("is", "it") if len(names) == 1 else ("are", "them")
    return f"{said} {verb} missing{where}, though its manifest lists {them}"


def shard_spans(metadata: Any) -> dict[str, int]:
    """Each shard file ``metadata`` names -> the bytes it must hold at least."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    return needed


def short_shard(path: Path, metadata: Any) -> str | None:
    """A shard of the checkpoint ``path`` shorter than ``metadata`` says, missing, or no
    regular file; else None.

    What tells a torn checkpoint without a manifest (file sizes only; nothing is read).
    """
    for name, size in sorted(shard_spans(metadata).items()):
        if why := not_regular(path / name):
            return why
        try:
            seen: int | None = (path / name).stat().st_size
        except FileNotFoundError:
            seen = None
        if seen is None or seen < size:
            have = "is missing" if seen is None else f"has {seen} bytes"
            return f"{name!r} {have}, and DCP's {METADATA_FILE} needs {size}"
    return None
