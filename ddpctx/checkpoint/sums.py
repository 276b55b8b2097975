"""Checksums of checkpoint files: recorded at save, verified before anything is loaded.

A flipped bit in a checkpoint -- a bad disk, a bad copy, a bug elsewhere --
must never be loaded as if it were the saved state. Every checkpoint
therefore carries a *manifest*: each file's size and CRC-32, written after
the files and before the checkpoint is published (renamed into place).

- A single-file checkpoint ``checkpoint-000007-epoch3.pt`` has its manifest
  beside it: ``checkpoint-000007-epoch3.pt.sums`` (copy both).
- A sharded checkpoint ``checkpoint-000008.dcp/`` holds ``ddpctx.sums``
  listing every other file in it (the shards, DCP's ``.metadata``,
  ``ddpctx.pt``).

The manifest is JSON followed by a line ``crc32 <8 hex digits>`` of the JSON
itself, so a damaged manifest is detected too. At load, before a file is
unpickled, every listed file is read and compared: a missing file, another
size or another CRC makes the checkpoint *damaged*, skipped like a torn one
(a warning naming the file, the recorded and the seen checksum; the next
older checkpoint is loaded).

A checkpoint without a manifest (written by a ddpctx that did not record
checksums, or whose manifest was removed) still loads, with a warning that
it was not verified. CRC-32 catches every error of up to 32 consecutive bits
and any other accident with odds of 1 in 4 billion; it is no defence against
someone who alters a checkpoint on purpose. Cost: one read of each file at
save (the shards, from the page cache) and one at load, at the speed measured
in BENCHMARKS.md.

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
from pathlib import Path

from ddpctx.utils.atomic import fsync_directory, no_space_error, temporary_name
from ddpctx.utils.warn import warn_user

FORMAT = "ddpctx-sums-1"
SHARDED_MANIFEST = "ddpctx.sums"
_CHUNK = 8 << 20
_TRAILER = re.compile(r"^crc32 ([0-9a-f]{8})$")

#: A file's size and CRC-32 (8 lowercase hex digits).
FileSum = tuple[int, str]


def file_sum(path: Path) -> FileSum:
    """``path``'s size and CRC-32, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as stream:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while count := stream.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
            size += count
    return size, f"{crc:08x}"


def sidecar(path: Path) -> Path:
    """The manifest of a single-file checkpoint: its name plus ``.sums``."""
    return path.with_name(path.name + ".sums")


def write_manifest(path: Path, sums: dict[str, FileSum]) -> None:
    """Write the manifest of ``sums`` (name in ``path``'s folder -> size, CRC) atomically."""
    body = json.dumps(
        {
            "format": FORMAT,
            "algorithm": "crc32",
            "files": {
                name: {"size": size, "crc32": crc} for name, (size, crc) in sorted(sums.items())
            },
        },
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


def read_manifest(path: Path) -> dict[str, FileSum] | str:
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
            name: (int(entry["size"]), str(entry["crc32"]))
            for name, entry in recorded["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"its manifest {path.name!r} is not a {FORMAT} manifest"


def damage(manifest: Path, folder: Path, must_list: tuple[str, ...] = ()) -> str | None:
    """None when every file ``manifest`` lists in ``folder`` is as saved; else what differs.

    ``must_list``: names the manifest has to list (a manifest of another checkpoint would not).
    """
    recorded = read_manifest(manifest)
    if isinstance(recorded, str):
        return recorded
    for name in must_list:
        if name not in recorded:
            return f"its manifest {manifest.name!r} does not list {name!r}"
    for name, (size, crc) in recorded.items():
        path = folder / name
        if not path.is_file():
            return f"{name!r} is missing (it was saved with {size} bytes)"
        seen_size = path.stat().st_size
        if seen_size != size:
            return f"{name!r} has {seen_size} bytes, and {size} were saved (torn or truncated)"
        _, seen = file_sum(path)
        if seen != crc:
            return f"{name!r} has CRC-32 {seen}, and {crc} was recorded when it was saved"
    return None


def unverified_warning(where: Path, manifest: Path) -> str:
    """What a checkpoint without a manifest is loaded with."""
    return (
        f"{str(where)!r} has no checksum manifest ({manifest.name}): it was written by a ddpctx "
        "that did not record checksums (or the manifest was removed), so it is loaded without "
        "verifying that its bytes are the ones saved. Checkpoints saved from now on are "
        "verified; save once to get one."
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
    warn_user(
        f"skipping {str(where)!r}: it is damaged: {reason}. It was altered or corrupted after "
        "it was saved, so it is not loaded; trying an older checkpoint. (If you changed it on "
        f"purpose, remove {str(manifest)!r} to load it unverified.)",
        RuntimeWarning,
    )
    return False
