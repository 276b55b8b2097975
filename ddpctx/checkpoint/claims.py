"""What a pickled checkpoint file claims to hold, weighed against its size before it is unpickled.

``torch.load(weights_only=True)`` runs no code, but the globals it admits can
still allocate what a file *claims*: ``bytearray(3 << 30)`` in a 33 KB file,
``torch.FloatStorage(n)``, a quantized tensor's size, a tensor of 50 GB
expanded over 4 bytes (zero strides) that an export then materialises; and
``pickle`` itself allocates what ``BINBYTES8``/``BYTEARRAY8`` say before it
finds the bytes missing. A checksum is no defence (anyone can re-sign a
file). So before any checkpoint pickle is unpickled -- a ``.pt``'s
``data.pkl``, a shard entry's, DCP's ``.metadata`` -- :func:`check_pickle`
walks its opcodes (:mod:`ddpctx.checkpoint.opwalk`: no more than the bytes
there, in time linear in them) with a small model of the unpickler's stack, and refuses
(:class:`~ddpctx.checkpoint.sums.RefusedCheckpoint`, naming the file) when:

- what it would allocate -- each constructor's claimed size (a byte an
  element for ``bytearray``, a storage's dtype size, else 16 bytes, the
  widest), each tensor's elements times their size, a ``.pt``
  record's storage -- adds up to more than :data:`MULTIPLE` times the
  file's own size (tied weights, two names over one storage, count twice:
  a model of one tied embedding uses 2x);
- a storage claims more bytes than its record in the file (an expanded,
  zero-stride tensor is weighed at its full size, which an export
  materialises: a small broadcast buffer loads, a 50 GB one is refused);
- it uses out-of-band buffers (``NEXT_BUFFER``), the extension registry,
  or an opcode torch's unpickler does not know, or does not parse.

So no reader allocates more than about ``MULTIPLE + 1`` times a file's size
(the file itself, when it is read rather than mapped) before it decides.
Sparse and nested tensors are not weighed (their sizes are tensors).

Why one module: the opcodes' model and what each admitted global claims are
one rule set, and DCP's ``.metadata`` is weighed by the same measure.

Example:
    >>> import pickle
    >>> class Claim:
    ...     def __reduce__(self):
    ...         return bytearray, (3 << 30,)
    >>> check_pickle(pickle.dumps({"step": 3}), 100, Path("a.pt"))  # fine
    >>> try:
    ...     check_pickle(pickle.dumps(Claim()), 100, Path("a.pt"))
    ... except RefusedCheckpoint as error:
    ...     print(str(error)[:49])
    'a.pt' was refused: it holds builtins.bytearray()
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from ddpctx.checkpoint.opwalk import OPAQUE as _OPAQUE
from ddpctx.checkpoint.opwalk import Global as _Global
from ddpctx.checkpoint.opwalk import Refused as _Refused
from ddpctx.checkpoint.opwalk import ints as _ints
from ddpctx.checkpoint.opwalk import walk
from ddpctx.checkpoint.sums import Damaged, Recorded, RefusedCheckpoint

#: What a file may claim to allocate, as a multiple of its own size (see the module docstring).
MULTIPLE = 4
#: What any file may claim however small it is (a checkpoint of a tiny model).
FLOOR = 1 << 20

_TENSORS = {
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_qtensor",
}
_SHAPES = {  # no storage: the size is all they claim (materialised by an export)
    "torch._utils._rebuild_meta_tensor_no_storage": 1,
    "torch._utils._rebuild_wrapper_subclass": 2,
}
_HARMLESS = {  # callables whose int arguments allocate nothing
    "collections.OrderedDict",
    "collections.Counter",
    "builtins.set",
    "builtins.complex",
    "torch.device",
    "torch.serialization._get_layout",
    "_codecs.encode",
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
    "torch._utils._rebuild_device_tensor_from_cpu_tensor",
    "torch._utils._rebuild_device_tensor_from_numpy",
    "torch._utils._rebuild_sparse_tensor",
    "torch._utils._rebuild_nested_tensor",
}
_BYTES = {"builtins.bytearray", "builtins.bytes"}


@dataclass(frozen=True)
class _Storage:
    """A ``.pt`` storage (a persistent id): its elements and their size in bytes."""

    numel: int
    itemsize: int


@functools.cache
def _itemsizes() -> dict[str, int]:
    """``module.name`` -> element size, for every storage class and dtype torch's loader admits."""
    sizes: dict[str, int] = {}
    for name, thing in torch._weights_only_unpickler._get_allowed_globals().items():
        dtype = thing if isinstance(thing, torch.dtype) else getattr(thing, "dtype", None)
        if isinstance(dtype, torch.dtype):
            sizes[name] = dtype.itemsize
    return sizes


def _size(value: Any, what: str) -> int:
    """The elements a size (a tuple of non-negative ints) holds; refused if it is none."""
    if not isinstance(value, (tuple, list)) or any(
        isinstance(item, bool) or not isinstance(item, int) or item < 0 for item in value
    ):
        raise _Refused(f"a {what} whose size is not a tuple of non-negative ints")
    return math.prod(value)


class _Claims:
    """The running total of what a pickle claims, against its budget."""

    def __init__(self, budget: int, records: dict[str, int] | None) -> None:
        self.budget = budget
        self.total = 0
        self.records = records

    def add(self, size: int, what: str) -> None:
        self.total += size
        if self.total > self.budget:
            raise _Refused(
                f"{what}, bringing what it claims to {self.total} bytes, more than {MULTIPLE}x "
                f"the file's size allows ({self.budget} bytes)"
            )

    def storage(self, pid: Any) -> Any:
        """A persistent id: a ``.pt`` storage, its claimed bytes within its record."""
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"):
            return _OPAQUE
        _, kind, key, _, numel = pid[:5]  # a legacy file's have a sixth: a view's
        itemsize = _itemsizes().get(str(kind), 1) if isinstance(kind, _Global) else 1
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise _Refused(f"a storage of {numel!r:.40} elements")
        if self.records is None:  # a legacy file: the storage is allocated, then read
            self.add(numel * itemsize, f"a storage of {numel * itemsize} bytes")
        else:
            held = self.records.get(str(key))
            if held is None:
                record = f"data/{key}"
                raise _Refused(
                    f"a storage of {numel * itemsize} bytes whose record {record!r:.80} is not "
                    "in the file (a torch file holds a record for each storage)"
                )
            if numel * itemsize > held:
                raise _Refused(f"a storage of {numel * itemsize} bytes in a record of {held} bytes")
        return _Storage(numel, itemsize)

    def call(self, callee: Any, args: Any) -> Any:
        """What calling ``callee`` with ``args`` claims; the result as the model follows it."""
        if not isinstance(callee, _Global) or not isinstance(args, tuple):
            return _OPAQUE
        name = str(callee)
        if name == "torch.Size":
            return tuple(args[0]) if args and isinstance(args[0], (tuple, list)) else _OPAQUE
        if name == "torch._tensor._rebuild_from_type_v2" and len(args) >= 3:
            return self.call(args[0], args[2])
        if name in _TENSORS:
            storage = args[0] if args else None
            if not isinstance(storage, _Storage) or len(args) < 4:
                raise _Refused(f"a tensor ({name}) without a storage of the file")
            elements = _size(args[2], "tensor")
            # An expanded (zero-stride) tensor counts at its full size: an export materialises it.
            # A small one is a user's to save (a broadcast buffer); a huge one fails the budget.
            what = f"a tensor of {elements} elements"
            if elements > storage.numel:
                what += f" over a storage of {storage.numel} (expanded, materialised at full size)"
            self.add(elements * storage.itemsize, what)
            return _OPAQUE
        if name in _SHAPES:
            where = _SHAPES[name]
            elements = _size(args[where] if len(args) > where else None, "tensor")
            self.add(elements * 16, f"a tensor without storage of {elements} elements")
            return _OPAQUE
        if name not in _HARMLESS:  # bytearray(n), torch.FloatStorage(n), torch.Tensor(a, b)...
            elements = math.prod(max(0, n) for arg in args for n in _ints(arg))
            # Bytes a byte, a storage its dtype's size; anything else the widest (16).
            each = 1 if name in _BYTES else _itemsizes().get(name, 16)
            self.add(elements * each, f"{name}() of {elements} elements ({each} bytes each)")
        return _OPAQUE


def refusal(path: Path, what: str) -> RefusedCheckpoint:
    """The error for a file that claims what it cannot hold (``what``), or does not read."""
    return RefusedCheckpoint(
        f"{str(path)!r} was refused: it holds {what}. No checkpoint ddpctx writes holds that, "
        "and its checksum (if it has one) matched, so it was written so -- not torn. It was not "
        "loaded, nor skipped for an older checkpoint (that would hide it). Move the checkpoint "
        "out of the directory to resume from the one before it, or restore it from a copy you "
        "trust."
    )


def check_pickle(
    data: bytes | memoryview, size: int, path: Path, records: dict[str, int] | None = None
) -> None:
    """Refuse (:func:`refusal`) a pickle that claims more than ``size`` bytes of file allow.

    ``size``: the bytes of the file the pickle is in; ``records``: a ``.pt``'s storage
    records (key -> bytes) its persistent ids must fit in (None: no storages expected).
    """
    claims = _Claims(max(FLOOR, MULTIPLE * size), records)
    try:
        walk(bytes(data) if isinstance(data, memoryview) else data, claims, 0, size)
    except _Refused as error:
        raise refusal(path, str(error)) from None
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as error:
        said = f"a pickle that does not parse ({type(error).__name__}: {error})"
        raise refusal(path, said) from None


def _check_legacy(source: IO[bytes], size: int, path: Path) -> None:
    """A torch file of the legacy (pre-zip) format: its five pickles (magic number,
    protocol, system info, the data, the storage keys), each storage weighed as allocated."""
    claims = _Claims(max(FLOOR, MULTIPLE * size), None)
    data, position = source.read(), 0  # torch reads a legacy file whole too
    try:
        for _ in range(5):
            position = walk(data, claims, position, size)
    except _Refused as error:
        raise refusal(path, str(error)) from None
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as error:
        raise ValueError(f"not a torch file ({type(error).__name__}: {error})") from error


def check_torch_file(source: IO[bytes], size: int, path: Path) -> None:
    """Refuse a torch zip file (a ``.pt``, or a shard entry: ``source``) that claims too much.

    Reads the zip's directory and its ``data.pkl`` (at most ``MULTIPLE`` times ``size``
    bytes) and nothing else. ``ValueError`` when it is no zip file (the caller decides
    whether that is torn or refused).
    """
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        source.seek(0)
        if source.read(2) != b"\x80\x02":
            raise ValueError(f"not a torch file ({error})") from error
        source.seek(0)
        _check_legacy(source, size, path)
        return
    with archive:
        records: dict[str, int] = {}
        offsets: dict[str, int] = {}
        pickles = []
        _refuse_alike_names(archive, path)
        for info in archive.infolist():
            parts = info.filename.split("/")
            if len(parts) == 3 and parts[1] == "data":
                records[parts[2]] = info.file_size
                offsets[f"data/{parts[2]}"] = info.header_offset
            elif len(parts) == 2 and parts[1] == "data.pkl":
                pickles.append(info)
                offsets["data.pkl"] = info.header_offset
        if len(pickles) != 1:
            raise refusal(path, f"{len(pickles)} data.pkl records (a torch file has one)")
        _refuse_unweighed(source, offsets, path)
        limit = max(FLOOR, MULTIPLE * size)
        info = pickles[0]
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > limit:
            raise refusal(path, f"a data.pkl of {info.file_size} bytes, compressed in the file")
        # Read as stored (torch writes it so), past its local header; zipfile's own reader
        # would check a CRC-32 that torch's writer does not always record.
        source.seek(info.header_offset)
        header = source.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise ValueError("its data.pkl has no local header")
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        source.seek(info.header_offset + 30 + name_length + extra_length)
        data = source.read(info.file_size)
    check_pickle(data, size, path, records)


def _refuse_alike_names(archive: zipfile.ZipFile, path: Path) -> None:
    """Refuse a zip holding two records whose names differ at most in case.

    torch's zip reader (miniz) looks a name up ignoring case, and which of the two
    it returns depends on the layout: the one weighed might not be the one loaded.
    """
    seen: dict[str, str] = {}
    for info in archive.infolist():
        folded = info.filename.lower()
        if folded in seen:
            raise refusal(
                path,
                f"two records named {seen[folded]!r:.80} and {info.filename!r:.80}, alike but "
                "for case (torch's zip reader may read either; a torch file has one of each)",
            )
        seen[folded] = info.filename


def _refuse_unweighed(source: IO[bytes], offsets: dict[str, int], path: Path) -> None:
    """Refuse a zip where torch's own reader would pick another record than the one weighed.

    ``offsets``: each weighed record's name (``data.pkl``, ``data/<key>``) -> its local
    header. Asked of the reader ``torch.load`` uses, so no difference between two zip
    parsers (a second directory, duplicate names) can put an unweighed record in its way.
    """
    source.seek(0)
    try:
        reader: Any = torch._C.PyTorchFileReader(source)
        picked = {name: reader.get_record_header_offset(name) for name in offsets}
    except (RuntimeError, ValueError, OSError) as error:
        raise ValueError(f"not a torch file ({error})") from error
    for name, offset in picked.items():
        if offset != offsets[name]:
            raise refusal(
                path,
                f"a record {name!r:.80} that torch's zip reader finds at byte {offset} and "
                f"the zip's directory at byte {offsets[name]} (two records, one weighed)",
            )


def check_metadata_claims(path: Path, metadata: Any, manifest: dict[str, Recorded] | None) -> None:
    """Refuse a ``.metadata`` whose entries or tensors claim more than the shards hold.

    Each entry must lie within its shard as the manifest records it; each tensor's
    elements times their size must fit in the entries that hold its chunks (what a
    reader allocates for it). Without a manifest, a shard shorter than its entries
    is torn (``listed.short_shard``); the tensors are weighed all the same.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    held: dict[str, int] = {}
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        fqn = getattr(index, "fqn", None)
        held[str(fqn)] = held.get(str(fqn), 0) + int(info.length)
        record = None if manifest is None else manifest.get(info.relative_path)
        if manifest is not None and record is None:
            raise Damaged(str(path), f"its manifest does not list {info.relative_path!r}")
        spans.setdefault(info.relative_path, []).append((info.offset, info.length, str(fqn)))
        if record is not None and info.offset + info.length > record.size:
            raise refusal(
                path,
                f"an entry {str(fqn)!r:.80} at bytes {info.offset}-{info.offset + info.length} "
                f"of {info.relative_path!r}, which holds {record.size} bytes",
            )
    _refuse_overlaps(path, spans)
    state = getattr(metadata, "state_dict_metadata", None)
    for fqn, stored in state.items() if isinstance(state, dict) else ():
        if not isinstance(stored, TensorStorageMetadata):
            continue
        size = getattr(stored, "size", None)
        dtype = getattr(getattr(stored, "properties", None), "dtype", None)
        if not isinstance(size, tuple) or not isinstance(dtype, torch.dtype):
            raise refusal(path, f"a tensor {str(fqn)!r:.80} without a size and dtype")
        if any(not isinstance(n, int) or n < 0 for n in size):
            raise refusal(path, f"a tensor {str(fqn)!r:.80} of size {size!r:.80}")
        _refuse_outside(path, str(fqn), size, getattr(stored, "chunks", None))
        claimed = math.prod(size) * dtype.itemsize
        if claimed > held.get(str(fqn), 0):
            raise refusal(
                path,
                f"a tensor {str(fqn)!r:.80} of size {tuple(size)} ({claimed} bytes), and its "
                f"entries in the shards hold {held.get(str(fqn), 0)} bytes",
            )


def _refuse_overlaps(path: Path, spans: dict[str, list[tuple[int, int, str]]]) -> None:
    """Refuse entries that share bytes of one shard file (DCP writes each once, apart)."""
    for name, found in spans.items():
        found.sort()
        for (start, length, fqn), (after, _, other) in itertools.pairwise(found):
            if after < start + length:
                raise refusal(
                    path,
                    f"entries {fqn!r:.80} and {other!r:.80} over the same bytes of {name!r} "
                    f"(from {after}): DCP writes each entry once, apart from the others",
                )


def _refuse_outside(path: Path, fqn: str, size: tuple[int, ...], chunks: Any) -> None:
    """Refuse a tensor's chunks that do not lie within it (negative offsets, past its end)."""
    for chunk in chunks if isinstance(chunks, list) else ():
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        fits = (
            isinstance(offsets, tuple)
            and isinstance(sizes, tuple)
            and len(offsets) == len(sizes) == len(size)
            and all(isinstance(n, int) for n in (*offsets, *sizes))
            and all(
                at >= 0 and n >= 0 and at + n <= whole
                for at, n, whole in zip(offsets, sizes, size, strict=True)
            )
        )
        if not fits:
            raise refusal(
                path,
                f"a chunk of tensor {fqn!r:.80} at {offsets!r:.60} of size {sizes!r:.60}, "
                f"outside the tensor's size {tuple(size)}",
            )
