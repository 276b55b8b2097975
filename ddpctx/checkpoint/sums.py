"""Checksums of checkpoint files: recorded at save, verified by each rank for what it reads.

A flipped bit in a checkpoint -- a bad disk, a bad copy, a bug elsewhere --
must never be loaded as if it were the saved state. Every checkpoint
therefore carries a *manifest*: each file's size and checksum, written after
the files and before the checkpoint is published (renamed into place).

- A single-file checkpoint ``checkpoint-000007-epoch3.pt`` has its manifest
  beside it: ``checkpoint-000007-epoch3.pt.sums`` (copy both).
- A sharded checkpoint ``checkpoint-000008.dcp/`` holds ``ddpctx.sums``
  listing every other file in it (the shards, DCP's ``.metadata``,
  ``ddpctx.pt``). For each shard it also records the checksum of each entry
  DCP wrote into it (its *parts*: offset, length, checksum), so that a rank
  that reads some entries of a shard verifies exactly the bytes it reads, as
  it reads them, and never reads the rest only to verify them. A shard's
  parts cover it end to end, so its own checksum is ``"parts"``: the file
  is verified as its parts are (it is hashed once, entry by entry, as
  written).

The checksum is XXH3-64 (:mod:`ddpctx.utils.digest`: chosen by measurement,
about 12 GiB/s here against 2 GiB/s for ``zlib.crc32``; BENCHMARKS.md), or
CRC-32 where the ``xxhash`` package is missing (warned once). The manifest
names its algorithm (``"algorithm": "xxh3_64"``), and checkpoints whose
manifests record CRC-32 -- written by a ddpctx before XXH3-64 (format
``ddpctx-sums-1``) -- still verify, parts included. A manifest naming an
algorithm this ddpctx cannot compute is refused naming it (an error, not a
skip: nothing says the checkpoint is damaged). The manifest is JSON followed
by a line ``crc32 <8 hex digits>`` of the JSON itself, so a damaged manifest
is detected too.

Checksums are computed on the bytes as they are written: ``atomic_save``
hashes each byte it hands the file, and a sharded save hashes each shard as
DCP writes it (:mod:`ddpctx.checkpoint.shardwriter`); nothing is read back.

At load, **each rank verifies the files it reads itself** -- a damaged copy
on one host is caught by the rank on that host -- and the ranks then agree
on which checkpoint is whole (:mod:`ddpctx.checkpoint.together`). A
missing file, another size or another checksum makes the checkpoint
*damaged*: skipped like a torn one, with a warning naming the file, the rank
and both checksums; every rank loads the same older checkpoint. A file is
verified before it is unpickled, and every unpickling is restricted anyway
(``weights_only=True``, :mod:`ddpctx.checkpoint.dcpread`).

A checksum detects *damage*, not *tampering*: anyone who can write a
checkpoint can recompute its checksums, so a manifest that matches says
nothing about who wrote the files. What keeps a tampered checkpoint from
running code is that ddpctx never unpickles one with a general unpickler.

A checkpoint without a manifest (written by a ddpctx that did not record
checksums, or whose manifest was removed) still loads, with a warning that
it was not verified.

Pruning (``keep=``) never re-reads a whole checkpoint to decide whether it
counts: it checks that its files are there at their recorded sizes, and
counts none that a load in this process found damaged (:func:`found_damaged`).

Why one module: the manifest's format, the checksums it records and how a
file is verified against them are one rule set, read together; the messages
of a mismatch name what the manifest names.

Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> _ = (folder / "a.bin").write_bytes(b"saved")
    >>> write_manifest(folder / "ddpctx.sums", {"a.bin": file_sum(folder / "a.bin")})
    >>> damage(folder / "ddpctx.sums", folder) is None
    True
    >>> _ = (folder / "a.bin").write_bytes(b"sabed")
    >>> print(damage(folder / "ddpctx.sums", folder))
    'a.bin' has XXH3-64 c91634d599b421f6, and f029ce74977acead was recorded when it was saved
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ddpctx.checkpoint.regular import (
    NOT_REGULAR,
    NotRegular,
    describe,
    not_regular,
    open_regular,
)
from ddpctx.utils.atomic import fsync_directory, no_space_error, temporary_name
from ddpctx.utils.digest import NAMES, Hasher, UnknownAlgorithm, chosen, hasher
from ddpctx.utils.warn import warn_user

#: What manifests are written as: each file's ``digest`` in the manifest's ``algorithm``.
FORMAT = "ddpctx-sums-2"
#: What a ddpctx before XXH3-64 wrote: each file's ``crc32``, algorithm ``crc32``.
FORMAT_CRC32 = "ddpctx-sums-1"
SHARDED_MANIFEST = "ddpctx.sums"
_CHUNK = 8 << 20
_TRAILER = re.compile(r"^crc32 ([0-9a-f]{8})$")

#: A file's size and checksum (lowercase hex digits) in the algorithm of :func:`chosen`.
FileSum = tuple[int, str]
#: A span of a file: its offset, its length, and the checksum of its bytes.
Part = tuple[int, int, str]


class RefusedCheckpoint(RuntimeError):
    """A checkpoint file that reads but cannot be used: an error, never a silent skip."""


#: The ``digest`` of a file whose parts tile it, from its first byte to its last: the file is
#: verified as its parts are (a shard, hashed entry by entry as DCP wrote it).
OF_PARTS = "parts"


def tiles(parts: Iterable[Part], size: int) -> bool:
    """Whether ``parts`` cover bytes ``0..size`` exactly, end to end (a file of entries).

    >>> tiles([(0, 4, "a"), (4, 2, "b")], 6), tiles([(0, 4, "a")], 6)
    (True, False)
    """
    end = 0
    for offset, length, _ in sorted(parts):
        if offset != end:
            return False
        end += length
    return end == size and size > 0


@dataclass(frozen=True)
class Recorded:
    """What a manifest records of one file: its size, checksum, its parts' checksums, and
    the algorithm of them all (``"xxh3_64"`` or ``"crc32"``)."""

    size: int
    digest: str
    parts: tuple[Part, ...] = ()
    algorithm: str = field(default_factory=chosen)


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


def mismatch(name: str, algorithm: str, seen: str, recorded: str, what: str = "") -> str:
    """How a checksum that differs is said: ``'a.bin' has XXH3-64 ..., and ... was recorded``."""
    return (
        f"{name!r}{what} has {NAMES.get(algorithm, algorithm)} {seen}, and {recorded} was "
        "recorded when it was saved"
    )


def file_sum(path: Path) -> FileSum:
    """``path``'s size and checksum (the algorithm of :func:`chosen`), read in chunks."""
    record = file_record(path, ())
    return record.size, record.digest


def file_record(
    path: Path, spans: Iterable[tuple[int, int]], algorithm: str | None = None
) -> Recorded:
    """``path``'s size, checksum and the checksum of each span (offset, length), in one read.

    ``algorithm``: the one of :func:`chosen` unless given.

    >>> import tempfile
    >>> from ddpctx.utils.digest import digest
    >>> where = Path(tempfile.mkdtemp()) / "f"
    >>> _ = where.write_bytes(b"abcdef")
    >>> record = file_record(where, [(0, 2), (2, 4)], "crc32")
    >>> record.parts == ((0, 2, digest(b"ab", "crc32")), (2, 4, digest(b"cdef", "crc32")))
    True
    """
    algorithm = algorithm or chosen()
    wanted = sorted(set(spans))
    sums: list[Hasher] = [hasher(algorithm) for _ in wanted]
    whole = hasher(algorithm)
    position, first = 0, 0
    with open_regular(path, buffering=0) as stream:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while count := stream.readinto(buffer):
            whole.update(view[:count])
            end = position + count
            while first < len(wanted) and sum(wanted[first]) <= position:
                first += 1  # spans wholly before this chunk are done
            for index in range(first, len(wanted)):
                offset, length = wanted[index]
                if offset >= end:
                    break
                low, high = max(offset, position), min(offset + length, end)
                if low < high:
                    sums[index].update(view[low - position : high - position])
            position = end
    parts = tuple(
        (offset, length, running.hexdigest())
        for (offset, length), running in zip(wanted, sums, strict=True)
        if offset + length <= position  # a span past the end is not a part of this file
    )
    return Recorded(position, whole.hexdigest(), parts, algorithm)


def sidecar(path: Path) -> Path:
    """The manifest of a single-file checkpoint: its name plus ``.sums``."""
    return path.with_name(path.name + ".sums")


def write_manifest(
    path: Path, sums: Mapping[str, FileSum | Recorded], algorithm: str | None = None
) -> None:
    """Write the manifest of ``sums`` (name in ``path``'s folder -> its record) atomically.

    ``algorithm``: the one every checksum in ``sums`` was computed with (that of
    :func:`chosen` unless given); a :class:`Recorded` of another is a ``ValueError``.
    """
    algorithm = algorithm or chosen()
    files: dict[str, dict[str, object]] = {}
    for name, value in sorted(sums.items()):
        record = value if isinstance(value, Recorded) else Recorded(*value, (), algorithm)
        if record.algorithm != algorithm:
            raise ValueError(
                f"the checksum of {name!r} is {record.algorithm}, and the manifest {path.name!r} "
                f"is written as {algorithm}; compute every checksum of a manifest with one "
                "algorithm"
            )
        entry: dict[str, object] = {"size": record.size, "digest": record.digest}
        if record.parts:
            entry["parts"] = [list(part) for part in record.parts]
        files[name] = entry
    body = json.dumps(
        {"format": FORMAT, "algorithm": algorithm, "files": files},
        separators=(",", ":"),
        sort_keys=True,
    )
    # The manifest's own check stays CRC-32: it covers a few KiB, and old manifests have it.
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


def unverifiable(path: Path, error: UnknownAlgorithm) -> RefusedCheckpoint:
    """The error for a manifest whose checksums this ddpctx cannot compute (``error`` says why).

    Refused, not skipped: nothing says the checkpoint is damaged, and loading
    an older one instead would silently lose progress.
    """
    return RefusedCheckpoint(
        f"{str(path)!r} cannot be verified: {error}. It was not loaded, nor skipped (an "
        "older checkpoint would silently lose progress). Load it with a ddpctx that knows "
        f"{error.algorithm!r}, or remove {path.name!r} to load it unverified."
    )


def read_manifest(path: Path) -> dict[str, Recorded] | str:
    """The recorded sums, or why the manifest itself is damaged.

    Reads the manifests of this ddpctx (``ddpctx-sums-2``: XXH3-64 or CRC-32,
    as named) and of those before it (``ddpctx-sums-1``: CRC-32). One that names
    an algorithm this ddpctx cannot compute is :class:`RefusedCheckpoint` naming it.
    """
    try:
        with open_regular(path) as stream:
            text = stream.read().decode("utf-8")
    except NotRegular as error:  # a FIFO: damage, never a wait (opening one waits for a writer)
        return f"its manifest {error}"
    except (OSError, UnicodeDecodeError) as error:
        return f"its manifest {path.name!r} cannot be read ({type(error).__name__}: {error})"
    body, _, trailer = text.removesuffix("\n").rpartition("\n")
    match = _TRAILER.match(trailer)
    if match is None or match.group(1) != f"{zlib.crc32(body.encode()):08x}":
        return f"its manifest {path.name!r} is damaged (its own CRC-32 does not match)"
    try:
        recorded = json.loads(body)
        form, algorithm = recorded["format"], recorded["algorithm"]
        if form == FORMAT_CRC32 and algorithm == "crc32":
            key = "crc32"
        elif form == FORMAT and isinstance(algorithm, str):
            key = "digest"
        else:
            raise ValueError(form)
        files = recorded["files"].items()
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"its manifest {path.name!r} is not a {FORMAT} (or {FORMAT_CRC32}) manifest"
    try:
        hasher(algorithm)  # an algorithm it cannot compute is refused, never skipped
    except UnknownAlgorithm as error:
        raise unverifiable(path, error) from None
    try:
        return {
            str(name): Recorded(
                int(entry["size"]),
                str(entry[key]),
                tuple((int(o), int(n), str(c)) for o, n, c in entry.get("parts", ())),
                algorithm,
            )
            for name, entry in files
        }
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"its manifest {path.name!r} is not a {FORMAT} (or {FORMAT_CRC32}) manifest"


def file_damage(path: Path, recorded: Recorded) -> str | None:
    """None when the file at ``path`` has the recorded size and checksum (one read); else why."""
    name = path.name
    try:
        status = path.stat()
    except FileNotFoundError:
        return f"{name!r} is missing (it was saved with {recorded.size} bytes)"
    if not stat.S_ISREG(status.st_mode):  # a FIFO's size is 0: never "0 bytes", never opened
        return describe(path, status.st_mode)
    seen_size = status.st_size
    if seen_size != recorded.size:
        return f"{name!r} has {seen_size} bytes, and {recorded.size} were saved (torn or truncated)"
    if recorded.digest == OF_PARTS:  # a shard: each of its entries' checksums, one read
        if not tiles(recorded.parts, recorded.size):
            return f"its manifest records parts of {name!r} that do not cover it"
        spans = [(offset, length) for offset, length, _ in recorded.parts]
        seen_parts = file_record(path, spans, recorded.algorithm).parts
        for (offset, length, seen), (_, _, saved) in zip(
            seen_parts, sorted(recorded.parts), strict=True
        ):
            if seen != saved:
                where = f" bytes {offset}-{offset + length}"
                return mismatch(name, recorded.algorithm, seen, saved, where)
        return None
    seen = file_record(path, (), recorded.algorithm).digest
    if seen != recorded.digest:
        return mismatch(name, recorded.algorithm, seen, recorded.digest)
    return None


def verified_bytes(path: Path, recorded: Recorded | None) -> bytes:
    """The bytes of the (small) file ``path``, read once and checked against ``recorded``.

    :class:`Damaged` when they are not the bytes saved, or cannot be read.
    """
    try:
        with open_regular(path) as stream:
            data = stream.read()
    except FileNotFoundError as error:
        raise Damaged(str(path), f"{path.name!r} is missing") from error
    except NotRegular as error:  # a FIFO: damage, never a wait
        raise Damaged(str(path), str(error)) from error
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
    running = hasher(recorded.algorithm)
    running.update(data)
    if (seen := running.hexdigest()) != recorded.digest:
        raise Damaged(str(path), mismatch(path.name, recorded.algorithm, seen, recorded.digest))
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
            status = (folder / name).stat()
        except FileNotFoundError:
            return f"{name!r} is missing"
        if not stat.S_ISREG(status.st_mode):
            return describe(folder / name, status.st_mode)
        size = status.st_size
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
    if NOT_REGULAR in reason and not reason.startswith("its manifest"):
        return (  # removing the manifest would not help: the file is no checkpoint's
            f"skipping {str(where)!r}: it is damaged: {reason}{found}. A checkpoint's files are "
            "regular files, so it is not loaded (nor opened: that would wait); trying an older "
            f"checkpoint. Put the file saved in its place, or move {str(where)!r} out of the "
            "directory."
        )
    return (
        f"skipping {str(where)!r}: it is damaged: {reason}{found}. It was altered or corrupted "
        "after it was saved, so it is not loaded; trying an older checkpoint. (If you changed "
        f"it on purpose, remove {str(manifest)!r} to load it unverified.)"
    )


def intact(manifest: Path, folder: Path, must_list: tuple[str, ...], where: Path) -> bool:
    """Whether the checkpoint ``where`` may be loaded: verified, or without a manifest (warned).

    A damaged one is skipped with a warning naming the file and both checksums.
    """
    for name in must_list:  # a FIFO named like its file: damage, said as what it is
        if why := not_regular(folder / name):
            warn_user(damaged_warning(where, why, manifest), RuntimeWarning)
            return False
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
