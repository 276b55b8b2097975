"""Checksums of checkpoint files: recorded at save, verified by each rank for what it reads.

A flipped bit in a checkpoint -- a bad disk, a bad copy, a bug elsewhere --
must never be loaded as if it were the saved state. Every checkpoint
therefore carries a *manifest*: each file's size and CRC-32, written after
the files and before the checkpoint is published (renamed into place).

- A single-file checkpoint ``checkpoint-000007-epoch3.pt`` has its manifest
  beside it: ``checkpoint-000007-epoch3.pt.sums`` (copy both).
- A sharded checkpoint ``checkpoint-000008.dcp/`` holds ``ddpctx.sums``
  listing every other file in it (the shards, DCP's ``.metadata``,
  ``ddpctx.pt``). For each shard it also records the CRC-32 of each entry
  DCP wrote into it (its *parts*: offset, length, CRC), so that a rank that
  reads some entries of a shard verifies exactly the bytes it reads, as it
  reads them, and never reads the rest only to verify it.

The manifest is JSON followed by a line ``crc32 <8 hex digits>`` of the JSON
itself, so a damaged manifest is detected too. A ddpctx that predates parts
reads the manifest as before (it ignores them) and verifies whole files.

At load, **each rank verifies the files it reads itself** -- a damaged copy
on one host is caught by the rank on that host -- and the ranks then agree
on which checkpoint is whole (:mod:`ddpctx.checkpoint.together`). A
missing file, another size or another CRC makes the checkpoint *damaged*:
skipped like a torn one, with a warning naming the file, the rank and both
checksums; every rank loads the same older checkpoint. A file is verified
before it is unpickled, and every unpickling is restricted anyway
(``weights_only=True``, :mod:`ddpctx.checkpoint.dcpread`).

A checksum detects *damage*, not *tampering*: anyone who can write a
checkpoint can recompute its CRCs, so a manifest that matches says nothing
about who wrote the files. What keeps a tampered checkpoint from running
code is that ddpctx never unpickles one with a general unpickler.

A checkpoint without a manifest (written by a ddpctx that did not record
checksums, or whose manifest was removed) still loads, with a warning that
it was not verified. CRC-32 catches every error of up to 32 consecutive bits
and any other accident with odds of 1 in 4 billion. Cost: one read of each
file at save (the shards, from the page cache) and, at load, a CRC over the
bytes each rank reads, at the speed measured in BENCHMARKS.md.

Pruning (``keep=``) never re-reads a whole checkpoint to decide whether it
counts: it checks that its files are there at their recorded sizes, and
counts none that a load in this process found damaged (:func:`found_damaged`).

Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "a.bin").write_bytes(b"saved")
    >>> write_manifest(folder / "ddpctx.sums", {"a.bin": file_sum(folder / "a.bin")})
    >>> damage(folder / "ddpctx.sums", folder) is None
    True
    >>> _ = (folder / "a.bin").write_bytes(b"sabed")
    >>> print(damage(folder / "ddpctx.sums", folder))
    'a.bin' has CRC-32 e2ccd889, and f9e3d325 was recorded when it was saved
"""

from __future__ import annotations

import errno
import json
import os
import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ddpctx.utils.atomic import fsync_directory, no_space_error, temporary_name
from ddpctx.utils.warn import warn_user

FORMAT = "ddpctx-sums-1"
SHARDED_MANIFEST = "ddpctx.sums"
_CHUNK = 8 << 20
_TRAILER = re.compile(r"^crc32 ([0-9a-f]{8})$")

#: A file's size and CRC-32 (8 lowercase hex digits).
FileSum = tuple[int, str]
#: A span of a file: its offset, its length, and the CRC-32 of its bytes.
Part = tuple[int, int, str]


@dataclass(frozen=True)
class Recorded:
    """What a manifest records of one file: its size, CRC-32, and the CRCs of its parts."""

    size: int
    crc32: str
    parts: tuple[Part, ...] = ()


class Damaged(RuntimeError):
    """A checkpoint file that is not the bytes saved: ``file`` (its path) and ``reason``.

    Raised by the rank that read it; pickles (it travels to the other ranks).

    >>> print(Damaged("/c/a.bin", "'a.bin' is missing"))
    '/c/a.bin' is damaged: 'a.bin' is missing
    """

    def __init__(self, file: str, reason: str) -> None:
        super().__init__(file, reason)
        self.file = file
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.file!r} is damaged: {self.reason}"


class Torn(Damaged):
    """A checkpoint file that cannot be read as what it should be (no manifest said more).

    >>> print(Torn("/c/a.pt", "not a torch file"))
    '/c/a.pt' is torn: not a torch file
    """

    def __str__(self) -> str:
        return f"{self.file!r} is torn: {self.reason}"


def crc(data: bytes | memoryview, start: int = 0) -> str:
    """CRC-32 of ``data`` (continuing ``start``) as 8 lowercase hex digits."""
    return f"{zlib.crc32(data, start):08x}"


def file_sum(path: Path) -> FileSum:
    """``path``'s size and CRC-32, read in chunks."""
    record = file_record(path, ())
    return record.size, record.crc32


def file_record(path: Path, spans: Iterable[tuple[int, int]]) -> Recorded:
    """``path``'s size, CRC-32 and the CRC-32 of each span (offset, length), in one read.

    >>> import tempfile
    >>> where = Path(tempfile.mkdtemp()) / "f"
    >>> _ = where.write_bytes(b"abcdef")
    >>> file_record(where, [(0, 2), (2, 4)]).parts == ((0, 2, crc(b"ab")), (2, 4, crc(b"cdef")))
    True
    """
    wanted = sorted(set(spans))
    sums = [0] * len(wanted)
    whole, position, first = 0, 0, 0
    with open(path, "rb", buffering=0) as stream:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while count := stream.readinto(buffer):
            whole = zlib.crc32(view[:count], whole)
            end = position + count
            while first < len(wanted) and sum(wanted[first]) <= position:
                first += 1  # spans wholly before this chunk are done
            for index in range(first, len(wanted)):
                offset, length = wanted[index]
                if offset >= end:
                    break
                low, high = max(offset, position), min(offset + length, end)
                if low < high:
                    sums[index] = zlib.crc32(view[low - position : high - position], sums[index])
            position = end
    parts = tuple(
        (offset, length, f"{value:08x}")
        for (offset, length), value in zip(wanted, sums, strict=True)
        if offset + length <= position  # a span past the end is not a part of this file
    )
    return Recorded(position, f"{whole:08x}", parts)


def sidecar(path: Path) -> Path:
    """The manifest of a single-file checkpoint: its name plus ``.sums``."""
    return path.with_name(path.name + ".sums")


def write_manifest(path: Path, sums: Mapping[str, FileSum | Recorded]) -> None:
    """Write the manifest of ``sums`` (name in ``path``'s folder -> its record) atomically."""
    files: dict[str, dict[str, object]] = {}
    for name, value in sorted(sums.items()):
        record = value if isinstance(value, Recorded) else Recorded(*value)
        entry: dict[str, object] = {"size": record.size, "crc32": record.crc32}
        if record.parts:
            entry["parts"] = [list(part) for part in record.parts]
        files[name] = entry
    body = json.dumps(
        {"format": FORMAT, "algorithm": "crc32", "files": files},
        separators=(",", ":"),
        sort_keys=True,
    )
    text = f"{body}\ncrc32 {zlib.crc32(body.encode()):08x}\n".encode()
    temporary = temporary_name(path)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        try:
            view = memoryview(text)
            while view:
                view = view[os.write(descriptor, view) :]
            os.fsync(descriptor)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise no_space_error(path, error, len(text) - len(view)) from error
            raise
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def read_manifest(path: Path) -> dict[str, Recorded] | str:
    """The recorded sums, or why the manifest itself is damaged."""
    try:
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        return f"its manifest {path.name!r} cannot be read ({type(error).__name__})"
    body, _, trailer = text.removesuffix("\n").rpartition("\n")
    match = _TRAILER.match(trailer)
    if match is None or match.group(1) != f"{zlib.crc32(body.encode()):08x}":
        return f"its manifest {path.name!r} is damaged (its own CRC-32 does not match)"
    try:
        recorded = json.loads(body)
        if recorded["format"] != FORMAT or recorded["algorithm"] != "crc32":
            raise ValueError(recorded["format"])
        return {
            str(name): Recorded(
                int(entry["size"]),
                str(entry["crc32"]),
                tuple((int(o), int(n), str(c)) for o, n, c in entry.get("parts", ())),
            )
            for name, entry in recorded["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"its manifest {path.name!r} is not a {FORMAT} manifest"


def file_damage(path: Path, recorded: Recorded) -> str | None:
    """None when the file at ``path`` has the recorded size and CRC-32 (one read); else how not."""
    name = path.name
    try:
        seen_size = path.stat().st_size
    except FileNotFoundError:
        return f"{name!r} is missing (it was saved with {recorded.size} bytes)"
    if seen_size != recorded.size:
        return f"{name!r} has {seen_size} bytes, and {recorded.size} were saved (torn or truncated)"
    _, seen = file_sum(path)
    if seen != recorded.crc32:
        return f"{name!r} has CRC-32 {seen}, and {recorded.crc32} was recorded when it was saved"
    return None


def verified_bytes(path: Path, recorded: Recorded | None) -> bytes:
    """The bytes of the (small) file ``path``, read once and checked against ``recorded``.

    :class:`Damaged` when they are not the bytes saved, or cannot be read.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError as error:
        raise Damaged(str(path), f"{path.name!r} is missing") from error
    except OSError as error:
        raise Damaged(str(path), f"{path.name!r} cannot be read ({error})") from error
    if recorded is None:
        return data
    if len(data) != recorded.size:
        raise Damaged(
            str(path),
            f"{path.name!r} has {len(data)} bytes, and {recorded.size} were saved "
            "(torn or truncated)",
        )
    if (seen := crc(data)) != recorded.crc32:
        raise Damaged(
            str(path),
            f"{path.name!r} has CRC-32 {seen}, and {recorded.crc32} was recorded when it was saved",
        )
    return data


def damage(manifest: Path, folder: Path, must_list: tuple[str, ...] = ()) -> str | None:
    """None when every file ``manifest`` lists in ``folder`` is as saved; else what differs.

    ``must_list``: names the manifest has to list (a manifest of another checkpoint would not).
    Reads every listed file: for one process that reads the whole checkpoint.
    """
    recorded = read_manifest(manifest)
    if isinstance(recorded, str):
        return recorded
    for name in must_list:
        if name not in recorded:
            return f"its manifest {manifest.name!r} does not list {name!r}"
    for name, record in recorded.items():
        if reason := file_damage(folder / name, record):
            return reason
    return None


def sizes_differ(manifest: Path, folder: Path, must_list: tuple[str, ...]) -> str | None:
    """Like :func:`damage`, reading no file but the manifest: missing files and sizes only."""
    recorded = read_manifest(manifest)
    if isinstance(recorded, str):
        return recorded
    for name in must_list:
        if name not in recorded:
            return f"its manifest {manifest.name!r} does not list {name!r}"
    for name, record in recorded.items():
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            return f"{name!r} is missing"
        if size != record.size:
            return f"{name!r} has {size} bytes, and {record.size} were saved"
    return None


def unverified_warning(where: Path, manifest: Path) -> str:
    """What a checkpoint without a manifest is loaded with."""
    return (
        f"{str(where)!r} has no checksum manifest ({manifest.name}): it was written by a ddpctx "
        "that did not record checksums (or the manifest was removed), so it is loaded without "
        "verifying that its bytes are the ones saved. Checkpoints saved from now on are "
        "verified; save once to get one."
    )


def damaged_warning(
    where: Path, reason: str, manifest: Path, rank: int | None = None, also: str = ""
) -> str:
    """The warning a checkpoint skipped as damaged is skipped with (``rank``: who found it)."""
    found = "" if rank is None else f" (found by rank {rank}, reading its copy{also})"
    return (
        f"skipping {str(where)!r}: it is damaged: {reason}{found}. It was altered or corrupted "
        "after it was saved, so it is not loaded; trying an older checkpoint. (If you changed "
        f"it on purpose, remove {str(manifest)!r} to load it unverified.)"
    )


def intact(manifest: Path, folder: Path, must_list: tuple[str, ...], where: Path) -> bool:
    """Whether the checkpoint ``where`` may be loaded: verified, or without a manifest (warned).

    A damaged one is skipped with a warning naming the file and both checksums.
    """
    if not manifest.exists():
        warn_user(unverified_warning(where, manifest), RuntimeWarning)
        return True
    reason = damage(manifest, folder, must_list)
    if reason is None:
        return True
    warn_user(damaged_warning(where, reason, manifest), RuntimeWarning)
    return False


#: Checkpoints a load in this process found damaged: (path, device, inode).
_FOUND_DAMAGED: set[tuple[str, int, int]] = set()


def _identity(path: Path) -> tuple[str, int, int] | None:
    try:
        status = path.stat()
    except OSError:
        return None
    return str(path.absolute()), status.st_dev, status.st_ino


def remember_damaged(path: Path) -> None:
    """Record that a load found the checkpoint ``path`` damaged (pruning will not count it)."""
    if (identity := _identity(path)) is not None:
        _FOUND_DAMAGED.add(identity)


def found_damaged(path: Path) -> bool:
    """Whether a load in this process found ``path`` damaged (the same file, not a new copy)."""
    identity = _identity(path)
    return identity is not None and identity in _FOUND_DAMAGED
