"""Running hashes of checkpoint bytes: XXH3-64 where ``xxhash`` is installed, else CRC-32.

A checkpoint's checksum is computed while its bytes pass -- as they are
written, as they are read -- so it has to run at memory speed and continue a
running sum over many pieces. Measured on the machine ddpctx is developed on
(a 256 MiB buffer, best of 5, BENCHMARKS.md "Checkpoint checksums"): XXH3-64
(``xxhash``) about 12 GiB/s, fed in pieces too; hardware CRC32C (``crc32c``,
``google-crc32c``) 6-7 GiB/s; ``zlib.crc32`` about 2 GiB/s. So new checksums are XXH3-64;
``xxhash`` is a dependency of ddpctx. Where it cannot be imported, ddpctx
records ``zlib.crc32`` instead, with one warning that says so.

A manifest names its algorithm, and :func:`hasher` makes one of either, so
checksums recorded with CRC-32 (by an older ddpctx, or without ``xxhash``)
verify as before. Neither is a defence against tampering: both detect
accidental damage (XXH3-64 misses a random change with odds of 1 in 2**64,
CRC-32 with 1 in 2**32 and never one of up to 32 consecutive bits).

Example:
    >>> running = hasher("crc32")
    >>> running.update(b"sa"); running.update(b"ved")
    >>> running.hexdigest() == digest(b"saved", "crc32")
    True
    >>> NAMES["xxh3_64"]
    'XXH3-64'
"""

from __future__ import annotations

import functools
import importlib
import zlib
from types import ModuleType
from typing import Protocol

from ddpctx.utils.warn import warn_user

#: Every algorithm a manifest may name -> how messages name it.
NAMES = {"xxh3_64": "XXH3-64", "crc32": "CRC-32"}


class Hasher(Protocol):
    """A running hash: ``update`` with each piece, ``hexdigest`` of all of them so far."""

    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32:
    """``zlib.crc32`` as a running hash (8 lowercase hex digits)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes | bytearray | memoryview, /) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


@functools.cache
def _xxhash() -> ModuleType | None:
    """The ``xxhash`` module, or None where it cannot be imported (warned once per process)."""
    try:
        return importlib.import_module("xxhash")
    except ImportError:
        warn_user(
            "ddpctx records checkpoint checksums with XXH3-64 from the 'xxhash' package, which "
            "cannot be imported here, so it records zlib's CRC-32 instead (about 6x slower "
            "on large checkpoints; they still verify). Install it: pip install xxhash",
            RuntimeWarning,
        )
        return None


def chosen() -> str:
    """The algorithm new checksums are recorded with: ``"xxh3_64"``, or ``"crc32"`` without xxhash.

    >>> chosen() in NAMES
    True
    """
    return "xxh3_64" if _xxhash() is not None else "crc32"


class UnknownAlgorithm(ValueError):
    """A manifest names an algorithm this ddpctx cannot compute (``algorithm``: the name)."""

    def __init__(self, algorithm: str, why: str) -> None:
        super().__init__(algorithm, why)
        self.algorithm = algorithm
        self.why = why

    def __str__(self) -> str:
        return self.why


def hasher(algorithm: str) -> Hasher:
    """A new running hash of ``algorithm`` (a key of :data:`NAMES`).

    :class:`UnknownAlgorithm` for any other name, and for ``"xxh3_64"`` where
    ``xxhash`` cannot be imported (the message says to install it).
    """
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "xxh3_64":
        module = _xxhash()
        if module is None:
            raise UnknownAlgorithm(
                algorithm,
                "its checksums are XXH3-64, and the 'xxhash' package that computes them "
                "cannot be imported here: pip install xxhash",
            )
        running: Hasher = module.xxh3_64()
        return running
    raise UnknownAlgorithm(
        algorithm,
        f"it names the checksum algorithm {algorithm!r}, which this ddpctx does not know "
        f"(it knows {', '.join(map(repr, NAMES))}); it was written by another program or a "
        "newer ddpctx: upgrade ddpctx to load it",
    )


def digest(data: bytes | bytearray | memoryview, algorithm: str) -> str:
    """The ``algorithm`` hash of ``data`` as lowercase hex digits."""
    running = hasher(algorithm)
    running.update(data)
    return running.hexdigest()
