"""DCP's files read as data, never as code; each entry's bytes verified as they are read.

``torch.distributed.checkpoint`` (DCP) writes a sharded checkpoint's
``.metadata`` with :mod:`pickle` and its own reader loads it with
``pickle.load``, which runs whatever a pickle names: a ``.metadata`` carrying
``os.system`` runs it. It also hands each non-tensor entry of a shard (an
optimizer's learning rate, say) to ``torch.load(weights_only=False)``. A
checkpoint is data a run may get from elsewhere (copied from another
cluster, downloaded), and its checksum manifest is no defence: anyone can
recompute a CRC. So ddpctx never lets DCP unpickle a checkpoint file:

- :func:`read_metadata` unpickles ``.metadata`` with an unpickler that admits
  only the classes DCP's metadata is made of (:func:`admitted`: DCP's
  metadata dataclasses, ``torch.Size``, torch's dtypes and layouts, paths)
  and refuses any other global -- a callable such as ``os.system``, any other
  class -- *before* it is called: :class:`~ddpctx.checkpoint.files.RefusedCheckpoint`
  naming the file and the global. The shard files it names must be plain
  names inside the checkpoint's directory. Its bytes are first checked
  against the manifest, when there is one.
- :class:`Reader` is DCP's ``FileSystemReader`` with that ``.metadata`` and
  its own ``read_data``: each entry's bytes are read once, their checksum
  compared with the manifest's record of that entry (a rank verifies exactly
  the bytes it reads, while reading them), then loaded with
  ``weights_only=True``: a tensor built on those mapped bytes themselves (as
  ``torch.load(mmap=True)`` builds a file's), so its one copy is the one into
  the model -- DCP's reader makes two -- and a non-tensor entry only if
  ``weights_only`` admits it (it reaches DCP's planner re-serialised from
  plain values). A damaged entry raises
  :class:`~ddpctx.checkpoint.sums.Damaged` on the rank that read it; the
  ranks' vote after the read (:mod:`ddpctx.checkpoint.shardload`) tells
  every rank.

A checkpoint whose manifest predates per-entry records (written by an older ddpctx) has each
shard file a rank reads verified whole, once, before its entries are read. Without a manifest
nothing is verified (the loader warns), but nothing is unpickled unrestricted either.

This module imports DCP (about a second); its users import it when first needed. Example:
    >>> ("torch", "Size") in admitted()
    True
    >>> ("os", "system") in admitted()
    False
"""

from __future__ import annotations

import functools
import io
import math
import os
import pathlib
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ddpctx.checkpoint.claims import check_metadata_claims, check_pickle, refusal
from ddpctx.checkpoint.entries import in_place_tensor, refused, weights_only_value
from ddpctx.checkpoint.files import RefusedCheckpoint
from ddpctx.checkpoint.mapped import View, entry_bytes
from ddpctx.checkpoint.regular import NotRegular, open_regular
from ddpctx.checkpoint.shape import check_loaded
from ddpctx.checkpoint.sums import Damaged, Recorded, file_damage, mismatch, verified_bytes
from ddpctx.utils.digest import hasher

METADATA_FILE = ".metadata"

_DCP_CLASSES = (
    "Metadata",
    "StorageMeta",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "_MEM_FORMAT_ENCODING",
)


@functools.cache
def admitted() -> dict[tuple[str, str], Any]:
    """The globals a ``.metadata`` may name, by (module, name): DCP's metadata and plain values."""
    found: dict[tuple[str, str], Any] = {}
    for thing in (
        *(getattr(dcp_metadata, name) for name in _DCP_CLASSES if hasattr(dcp_metadata, name)),
        _StorageInfo,
        torch.Size,
        OrderedDict,
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        pathlib.WindowsPath,
        pathlib.PureWindowsPath,
    ):
        found[(thing.__module__, thing.__qualname__)] = thing
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout)):
            found[("torch", name)] = value
    layout = getattr(torch.serialization, "_get_layout", None)
    if layout is not None:  # how a torch.layout pickles: _get_layout("torch.strided")
        found[("torch.serialization", "_get_layout")] = layout
    return found


class _Unsafe(Exception):
    """A global that :func:`admitted` does not list."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle`` that resolves only :func:`admitted` globals (and no persistent ids)."""

    def find_class(self, module: str, name: str) -> Any:
        found = admitted().get((module, name))
        if found is None:
            raise _Unsafe(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise _Unsafe(f"persistent id {pid!r:.60}")


def read_metadata(path: Path, manifest: dict[str, Recorded] | None) -> Any:
    """DCP's ``Metadata`` from ``path``, read once, verified against ``manifest``, restricted.

    ``manifest``: the checkpoint's (None: it has none). :class:`Damaged` when its bytes
    are not those saved, or (without a manifest) do not unpickle; ``RefusedCheckpoint``
    when it names any global :func:`admitted` does not list or a shard file outside its
    directory, claims more than the files hold
    (:func:`~ddpctx.checkpoint.claims.check_metadata_claims`), or -- its checksum
    matched, so it was written so -- does not read as DCP's metadata.
    """
    record = None if manifest is None else manifest.get(METADATA_FILE)
    if manifest is not None and record is None:
        raise Damaged(str(path), f"its manifest does not list {METADATA_FILE!r}")
    data = verified_bytes(path, record)
    verified = record is not None

    def bad(reason: str) -> Exception:
        return refusal(path, reason) if verified else Damaged(str(path), reason)

    check_pickle(data, len(data), path)  # what it claims, before pickle allocates it
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Unsafe as error:
        raise refused(
            path, f"pickled code ({error}), which a general unpickler would run"
        ) from None
    except Exception as error:
        raise bad(
            f"{path.name!r} does not read as DCP's metadata ({type(error).__name__}: "
            f"{str(error)[:200]})"
        ) from None
    check_loaded(metadata, len(data), path, expanded=False)  # its depth; no cycle
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(storage, dict):
        raise bad(f"{path.name!r} is not DCP's metadata (it holds a {type(metadata).__name__})")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str):
            raise bad(f"{path.name!r} lists an entry without a file name ({name!r:.60})")
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise refused(path, f"a shard file name outside the checkpoint ({name!r:.80})")
        if not all(isinstance(getattr(info, f), int) and getattr(info, f) >= 0 for f in _SPAN):
            raise bad(f"{path.name!r} lists an entry of {name!r} without an offset and length")
    check_metadata_claims(path, metadata, manifest)
    return metadata


_SPAN = ("offset", "length")  # what each entry of .metadata must give, as ints


def files_read(metadata: Any) -> set[str]:
    """The shard files a load may read: those holding an entry that is no empty chunk.

    A file of empty chunks alone (a rank's empty slices of small tensors) is in no rank's
    plan, so no load reads it; :mod:`ddpctx.checkpoint.listed` has it verified whole.
    """
    state = getattr(metadata, "state_dict_metadata", None) or {}
    return {
        info.relative_path
        for index, info in metadata.storage_data.items()
        if not _empty(state.get(index.fqn), index)
    }


def _empty(stored: Any, index: Any) -> bool:
    """Whether the entry ``index`` of the tensor ``stored`` is a chunk of no elements."""
    if not isinstance(stored, TensorStorageMetadata):
        return False
    chunk = _chunk_at(stored.chunks, index)
    return chunk is not None and math.prod(chunk.sizes) == 0


def cause_of(error: BaseException) -> Damaged | RefusedCheckpoint | None:
    """The first ``Damaged`` or refusal among a DCP ``CheckpointException``'s failures."""
    failures = getattr(error, "failures", None)
    for _, failure in sorted(failures.items()) if isinstance(failures, dict) else ():
        cause = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(cause, (Damaged, RefusedCheckpoint)):
            return cause
    return None


def failures_said(error: BaseException) -> str:
    """What each rank's failure in a DCP ``CheckpointException`` was, as one line."""
    failures = getattr(error, "failures", None)
    said = []
    for rank, failure in sorted(failures.items()) if isinstance(failures, dict) else ():
        cause = failure[0] if isinstance(failure, tuple) and failure else failure
        said.append(f"rank {rank}: {type(cause).__name__}: {cause}")
    return "; ".join(said) or str(error)


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The part of a stored chunk a read wants (as DCP's ``narrow_tensor_by_index``)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=False)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


class Reader(FileSystemReader):
    """DCP's file reader: restricted ``.metadata``, each entry verified as read, ``weights_only``.

    ``metadata``: already read by :func:`read_metadata` (None: read it here);
    ``recorded``: the manifest (None: the checkpoint has none, nothing is verified).
    """

    def __init__(
        self, path: str | Path, metadata: Any = None, recorded: dict[str, Recorded] | None = None
    ) -> None:
        super().__init__(path)
        self._metadata = metadata
        self._recorded = recorded
        self._whole_verified: set[str] = set()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The checkpoint's one ``.metadata`` (ddpctx writes no rank-local ones)."""
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("ddpctx checkpoints hold one .metadata, none per rank")
        if self._metadata is None:
            where = Path(self.path) / METADATA_FILE
            self._metadata = read_metadata(where, self._recorded)
        metadata = self._metadata
        storage_meta = getattr(dcp_metadata, "StorageMeta", None)
        if storage_meta is not None and getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = storage_meta()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan's entries, file by file, each verified and then loaded."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for name, items in per_file.items():
            self._read_file(Path(self.path) / name, items, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _record_of(self, path: Path) -> Recorded | None:
        if self._recorded is None:
            return None
        record = self._recorded.get(path.name)
        if record is None:
            raise Damaged(str(path), f"its manifest does not list {path.name!r}")
        return record

    def _read_file(self, path: Path, items: list[ReadItem], planner: LoadPlanner) -> None:
        record = self._record_of(path)
        parts = (
            {(offset, length): value for offset, length, value in record.parts} if record else {}
        )
        spans = [self.storage_data[item.storage_index] for item in items]
        if record and any((s.offset, s.length) not in parts for s in spans):
            self._verify_whole(path, record)  # a manifest without this file's parts
        try:
            stream = open_regular(path)  # a FIFO: said, never waited on; closed below
        except FileNotFoundError:
            raise Damaged(str(path), f"{path.name!r} is missing") from None
        except NotRegular as error:
            raise Damaged(str(path), str(error)) from None
        with stream:
            size = _size(stream)
            if record is not None and size != record.size:
                raise Damaged(
                    str(path),
                    f"{path.name!r} has {size} bytes, and {record.size} were saved "
                    "(torn or truncated)",
                )
            entries: list[tuple[ReadItem | None, Any, str]] = [
                (item, info, item.storage_index.fqn)
                for item, info in zip(items, spans, strict=True)
            ]
            if record is not None:  # what no rank reads is verified by the ranks here
                entries += [(None, info, fqn) for fqn, info in self._unread(path.name)]
            for item, info, entry in sorted(entries, key=lambda e: int(e[1].offset)):
                with entry_bytes(stream, size, info.offset, info.length) as data:
                    if len(data) != info.length:
                        raise Damaged(
                            str(path),
                            f"{path.name!r} ends before its entry {entry!r} does (torn or "
                            "truncated)",
                        )
                    expected = parts.get((info.offset, info.length))
                    if expected is not None and record is not None:
                        self._check(path, record, info, entry, data, expected)
                    if item is not None:
                        self._load(item, info, data, path, planner, record is not None)

    def _unread(self, name: str) -> list[tuple[str, Any]]:
        """The entries of the shard ``name`` that no rank's plan reads: chunks of no elements
        (an empty tensor, a rank's empty slice of a small one). Their bytes are in the file,
        so the ranks reading it verify them too -- a flipped bit there is damage as well."""
        state = getattr(self._metadata, "state_dict_metadata", None) or {}
        return [
            (index.fqn, info)
            for index, info in self.storage_data.items()
            if info.relative_path == name and _empty(state.get(index.fqn), index)
        ]

    @staticmethod
    def _check(
        path: Path, record: Recorded, info: Any, entry: str, data: memoryview, expected: str
    ) -> None:
        running = hasher(record.algorithm)
        running.update(data)
        if (seen := running.hexdigest()) != expected:
            where = f" bytes {info.offset}-{info.offset + info.length} (entry {entry!r})"
            raise Damaged(str(path), mismatch(path.name, record.algorithm, seen, expected, where))

    def _verify_whole(self, path: Path, record: Recorded) -> None:
        if path.name not in self._whole_verified:
            if reason := file_damage(path, record):
                raise Damaged(str(path), reason)
            self._whole_verified.add(path.name)

    def _load(
        self,
        item: ReadItem,
        info: Any,
        data: memoryview,
        path: Path,
        planner: LoadPlanner,
        verified: bool,
    ) -> None:
        stream: IO[bytes] = cast(IO[bytes], View(data))
        descriptors = getattr(info, "transform_descriptors", None) or ()
        transforms = getattr(self, "transforms", None)
        if descriptors and transforms is not None:
            stream = transforms.transform_load_stream(item, descriptors, io.BytesIO(data))
            if not stream.seekable():
                stream = io.BytesIO(stream.read())
        entry = item.storage_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            plain = io.BytesIO()
            value = weights_only_value(stream, path, entry, verified)
            torch.save(value, plain)  # DCP would unpickle it unrestricted
            plain.seek(0)
            planner.load_bytes(item, plain)
            return
        loaded = None if descriptors else in_place_tensor(data, info.offset, path, entry, verified)
        if loaded is None:
            loaded = weights_only_value(stream, path, entry, verified)
        tensor = _narrow(loaded, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise ValueError(
                f"{str(path)!r}: its entry {entry!r} holds a tensor of size "
                f"{tuple(tensor.size())}, and the state being loaded has {tuple(target.size())} "
                "there. Load it into the model it was saved from (the same shapes)."
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def _chunk_at(chunks: Any, index: Any) -> Any:
    """The chunk a storage index names: by its position when given, else by its offsets."""
    position = getattr(index, "index", None)
    if position is not None and 0 <= position < len(chunks):
        return chunks[position]
    offsets = tuple(getattr(index, "offset", None) or ())
    return next((chunk for chunk in chunks if tuple(chunk.offsets) == offsets), None)


def _size(stream: IO[bytes]) -> int:
    return os.fstat(stream.fileno()).st_size
