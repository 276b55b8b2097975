"""One entry of a DCP shard, its bytes already verified, to the value it holds -- never code.

:func:`weights_only_value` is ``torch.load(weights_only=True)`` of an entry;
:func:`in_place_tensor` the same for a tensor entry, built on the entry's
mapped bytes themselves (as ``torch.load(mmap=True)`` builds a whole file's),
so that loading it into a model copies its bytes once. Either way an entry
naming anything ``weights_only`` does not admit is refused (:func:`refused`:
:class:`~ddpctx.checkpoint.files.RefusedCheckpoint` naming the file and what
it holds) and one that does not read is :class:`~ddpctx.checkpoint.sums.Damaged`.

Example:
    >>> import io, torch
    >>> saved = io.BytesIO()
    >>> torch.save(torch.arange(3.0), saved)
    >>> in_place_tensor(memoryview(saved.getvalue()), 0, Path("s.distcp"), "w")
    tensor([0., 1., 2.])
"""

from __future__ import annotations

import functools
import inspect
import pickle
import platform
import warnings
from pathlib import Path
from typing import IO, Any, cast

import torch

from ddpctx.checkpoint.claims import check_torch_file, refusal
from ddpctx.checkpoint.files import RefusedCheckpoint
from ddpctx.checkpoint.mapped import View
from ddpctx.checkpoint.shape import check_loaded
from ddpctx.checkpoint.sums import Damaged


def refused(path: Path, what: str) -> RefusedCheckpoint:
    """The error for a checkpoint file that would run code (or read outside its directory)."""
    return RefusedCheckpoint(
        f"{str(path)!r} was refused as unsafe: it holds {what}. No checkpoint ddpctx writes "
        "holds that, so it was not loaded; nor was it skipped, since loading an older "
        "checkpoint instead would hide the tampering. Delete the checkpoint or restore it from "
        "a copy you trust; do not load it elsewhere with pickle or torch.load(weights_only=False)."
    )


def unreadable(path: Path, entry: str, error: Exception, verified: bool) -> Exception:
    """An entry that does not read: damaged, or refused when its checksum matched (not torn)."""
    said = f"{type(error).__name__}: {str(error)[:200]}"
    if verified:
        return refusal(path, f"an entry {entry!r} that does not read ({said})")
    return Damaged(str(path), f"{path.name!r}: its entry {entry!r} cannot be read ({said})")


def weigh(data: IO[bytes], length: int, path: Path, entry: str, verified: bool) -> None:
    """Refuse an entry that claims more than its ``length`` bytes allow (before it is loaded)."""
    try:
        check_torch_file(data, length, path)
    except ValueError as error:
        raise unreadable(path, entry, error, verified) from None
    finally:
        data.seek(0)


def weights_only_value(data: IO[bytes], path: Path, entry: str, verified: bool = False) -> Any:
    """``torch.load(weights_only=True)`` of one entry; refused or unreadable, said so.

    ``verified``: its checksum matched, so one that does not read is refused, not damaged.
    """
    data.seek(0, 2)
    length = data.tell()
    weigh(data, length, path, entry, verified)
    try:
        value = torch.load(data, map_location="cpu", weights_only=True)
    except Exception as error:
        if "Weights only load failed" in str(error):
            reason = str(error).split("WeightsUnpickler error:")[-1].strip().splitlines()[0]
            raise refused(
                path,
                f"pickled code in its entry {entry!r} ({reason}), which DCP's loader would run",
            ) from None
        raise unreadable(path, entry, error, verified) from None
    check_loaded(value, length, path)
    return value


#: Processors whose loads and stores need no alignment: a tensor may start at any byte there.
_ANY_ALIGNMENT = ("x86_64", "amd64", "i686", "aarch64", "arm64")


@functools.cache
def _in_place_loading() -> bool:
    """Whether this torch can build a loaded tensor on bytes given to it (torch's own
    ``mmap=True`` load does: ``overall_storage``), so a mapped entry is copied once."""
    load = getattr(torch.serialization, "_load", None)
    try:
        parameters = inspect.signature(load).parameters if load is not None else {}
    except (TypeError, ValueError):
        return False
    return (
        "overall_storage" in parameters
        and hasattr(torch.serialization, "_open_zipfile_reader")
        and hasattr(torch.serialization, "_weights_only_unpickler")
    )


def in_place_tensor(
    data: memoryview, offset: int, path: Path, entry: str, verified: bool = False
) -> Any:
    """``torch.load(weights_only=True)`` of one entry whose storage *is* ``data``; None where
    that cannot be done here (then :func:`weights_only_value` reads it, one copy more).

    What ``torch.load(mmap=True)`` does for a whole file, done for a stretch of one: the
    same restricted unpickler builds the tensor on the bytes already mapped (and already
    verified), so the one copy a load makes is the caller's ``copy_`` into the model, not
    mapped pages -> fresh storage -> model. The result is read-only memory: it is only ever
    copied from. Refusals and damage are reported as :func:`weights_only_value` reports them.
    """
    aligned = offset % 16 == 0 or platform.machine().lower() in _ANY_ALIGNMENT
    if not (aligned and _in_place_loading()) or bytes(data[:4]) != b"PK\x03\x04":
        return None  # a legacy (non-zip) entry, or a torch without the means
    weigh(cast(IO[bytes], View(data)), len(data), path, entry, verified)
    serialization: Any = torch.serialization
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not writable": it is only read
        storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    try:
        with serialization._open_zipfile_reader(View(data)) as archive:
            value = serialization._load(
                archive, "cpu", serialization._weights_only_unpickler, overall_storage=storage
            )
    except pickle.UnpicklingError as error:
        reason = (str(error).strip().splitlines() or ["a global it does not admit"])[0]
        raise refused(
            path, f"pickled code in its entry {entry!r} ({reason}), which DCP's loader would run"
        ) from None
    except Exception as error:
        raise unreadable(path, entry, error, verified) from None
    check_loaded(value, len(data), path)
    return value
