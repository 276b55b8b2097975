"""Reducing nested metrics in one collective; broadcasting and gathering objects.

The reduction protocol
----------------------
Every "mean" and "sum" leaf (and the weight leaves) travel in ONE float64
buffer and ONE ``all_reduce``; "max", "min" and "prod" add one collective each,
only when used. float64 keeps integer sums exact up to 2**53.

Two facts shape the buffer (measured on torch 2.13 / gloo):

- gloo, given buffers of different lengths on different ranks, returns
  garbage on one rank and aborts another with SIGABRT. So a buffer's length
  must never depend on what a rank happens to return. Each call site keeps an
  agreed *capacity*; the payload is padded to it. The capacity only changes
  from information every rank received in the same reduction, so it stays
  identical on every rank.
- A structure fingerprint must be stable across processes (``hash()`` of a
  string is not), so it is a CRC of a canonical description.

The buffer is ``[header | payload | padding]``. The header is summed with the
rest: ``1`` (counts the ranks), two fingerprints ``h`` and their squares
``h*h`` (``sum(h)**2 == n * sum(h*h)`` exactly when every ``h`` is equal), a
failure flag, an overflow flag and the payload length. After the one
``all_reduce`` every rank reads the same header and takes the same branch:

- a rank failed to pack (e.g. a string leaf): every rank raises; the failing
  rank its own ``TypeError``, the others a :class:`ReductionError` naming it;
- fingerprints differ: every rank raises a :class:`ReductionError` listing
  which keys or shapes differ on which rank;
- a payload did not fit: the capacity grows to the payload length and the
  reduction is repeated (once per change of structure, never in the steady
  state).

The diagnostic paths gather the details with object collectives; they run
only after every rank has learned, from the same header, that they are needed.

Layering: this module knows ``torch.distributed`` and nothing of
:mod:`ddpctx.context`; callers pass the :class:`Site`.

Example:
    >>> all_reduce_tree({"loss": 2.0, "count": 4}, weight="count", site=Site("doc"))
    {'loss': 2.0, 'count': 4}
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddpctx.tree import NUMPY, PYTHON, TENSOR, Leaf, describe, flatten

OPS = ("mean", "sum", "max", "min", "prod")
_TORCH_OPS = {
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}
_HEADER = 8
_ONES, _H1, _H1SQ, _H2, _H2SQ, _FAILED, _OVERFLOW, _LENGTH = range(_HEADER)
_FINGERPRINT_RANGE = 2**20 - 1  # keeps h*h summed over ranks exact in float64

#: Payload elements a call site starts with; 32 metrics fit without a resize.
DEFAULT_CAPACITY = 64

OpSpec = str | Mapping[str, str]


class ReductionError(RuntimeError):
    """Ranks could not reduce together: different structures, or another rank failed."""


@dataclass
class Site:
    """The agreed buffer capacity of one call site (one decorated function, one line)."""

    name: str
    capacity: int = DEFAULT_CAPACITY


def check_op(op: object) -> None:
    """Refuse an unknown op before any communication."""
    names = op.values() if isinstance(op, Mapping) else [op]
    for name in names:
        if name not in OPS:
            raise ValueError(
                f"op={op!r}: {name!r} is not a reduction. Use one of "
                f"{', '.join(map(repr, OPS))}, or a dict mapping result keys to them."
            )


def _leaf_ops(leaves: Sequence[Leaf], op: OpSpec, weight: str | None) -> list[str]:
    """The op of every leaf: the innermost of its keys named in ``op``, else "mean"."""
    mapping = op if isinstance(op, Mapping) else {}
    default = "mean" if isinstance(op, Mapping) else op
    unused = set(mapping)
    ops = []
    for leaf in leaves:
        chosen = default
        for key in reversed(leaf.keys):
            if isinstance(key, str) and key in mapping:
                chosen = mapping[key]
                unused.discard(key)
                break
        if weight is not None and leaf.keys and leaf.keys[-1] == weight:
            if chosen not in ("sum", "mean"):
                raise ValueError(
                    f"{leaf.path} is the weight leaf (weight={weight!r}); it is always summed, "
                    f"so op {chosen!r} cannot apply to it. Drop it from op=."
                )
            chosen = "sum"
        ops.append(chosen)
    if unused:
        keys = sorted({str(k) for leaf in leaves for k in leaf.keys})
        raise ValueError(
            f"op={dict(mapping)!r} names {sorted(unused)!r}, which the result does not contain "
            f"(its keys: {keys}). Fix the key or drop it."
        )
    return ops


def _weights(leaves: Sequence[Leaf], ops: Sequence[str], weight: str) -> list[int | None]:
    """For each "mean" leaf, the index of the weight leaf in its nearest enclosing dict."""
    by_parent: dict[int, int] = {}
    for index, leaf in enumerate(leaves):
        if leaf.keys and leaf.keys[-1] == weight and leaf.parents:
            if math.prod(leaf.shape) != 1:
                raise ValueError(
                    f"{leaf.path} (the weight) has shape {list(leaf.shape)}; a weight must be a "
                    "single number per result, e.g. the number of samples."
                )
            by_parent[leaf.parents[-1]] = index
    result: list[int | None] = []
    for leaf, op in zip(leaves, ops, strict=True):
        found = None
        if op == "mean":
            found = next((by_parent[p] for p in reversed(leaf.parents) if p in by_parent), None)
            if found is None:
                raise ValueError(
                    f"weight={weight!r} but {leaf.path} has no {weight!r} leaf beside it or "
                    f"above it. Return e.g. {{'loss': ..., {weight!r}: n}}."
                )
        result.append(found)
    return result


def _fingerprints(lines: Sequence[str], site: str, weight: str | None) -> tuple[int, int]:
    text = "\n".join([site, repr(weight), *lines]).encode()
    first = zlib.crc32(text) % _FINGERPRINT_RANGE + 1
    second = zlib.adler32(text) % _FINGERPRINT_RANGE + 1
    return first, second


def _as_float64(leaves: Sequence[Leaf], device: torch.device) -> torch.Tensor:
    """The leaves' values, flattened into one float64 vector on ``device``."""
    tensors = [leaf.value for leaf in leaves if leaf.kind == TENSOR]
    if len(tensors) == len(leaves) and tensors:
        first = tensors[0]
        if all(t.dtype == first.dtype and t.device == first.device for t in tensors):
            if all(t.dim() == 0 for t in tensors):
                return torch.stack(tensors).detach().to(device, torch.float64)
            flat = [t.detach().reshape(-1) for t in tensors]
            return torch.cat(flat).to(device, torch.float64)
    parts: list[torch.Tensor] = []
    scalars: list[float] = []
    for leaf in leaves:
        if leaf.kind == PYTHON or (leaf.kind == NUMPY and not leaf.shape):
            scalars.append(float(leaf.value))
            continue
        if scalars:
            parts.append(torch.tensor(scalars, dtype=torch.float64, device=device))
            scalars = []
        value = leaf.value if leaf.kind == TENSOR else torch.from_numpy(np.asarray(leaf.value))
        parts.append(value.detach().reshape(-1).to(device, torch.float64))
    if scalars:
        parts.append(torch.tensor(scalars, dtype=torch.float64, device=device))
    if not parts:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _numels(leaves: Sequence[Leaf]) -> list[int]:
    return [math.prod(leaf.shape) for leaf in leaves]


def group_size(group: Any = None) -> int:
    """World size of ``group``, or 1 with no process group."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def comm_device(group: Any = None) -> torch.device:
    """Where buffers must live for the group's backend: the current GPU for NCCL, else CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_tree(
    obj: Any,
    op: OpSpec = "mean",
    weight: str | None = None,
    *,
    site: Site,
    group: Any = None,
) -> Any:
    """Reduce every numeric leaf of ``obj`` across ranks; same structure and leaf kinds back."""
    check_op(op)
    world = group_size(group)
    device = comm_device(group)
    try:
        leaves, rebuild = flatten(obj)
        ops = _leaf_ops(leaves, op, weight)
        weights = _weights(leaves, ops, weight) if weight is not None else [None] * len(leaves)
    except (TypeError, ValueError) as error:
        report_failure(error, site, group)
        raise
    summed = [i for i, o in enumerate(ops) if o in ("mean", "sum")]
    payload = _as_float64([leaves[i] for i in summed], device)
    numels = _numels([leaves[i] for i in summed])
    weighted = [weights[i] for i in summed]
    if any(w is not None for w in weighted):
        per_leaf = [1.0 if w is None else float(leaves[w].value) for w in weighted]
        factors = torch.tensor(per_leaf, dtype=torch.float64, device=device)
        payload = payload * torch.repeat_interleave(factors, torch.tensor(numels, device=device))
    lines = describe(leaves, ops)
    if world > 1:
        payload = _reduce_with_header(payload, lines, site, weight, device, group)
    results: list[Any] = [None] * len(leaves)
    _unpack_summed(leaves, ops, weights, summed, numels, payload, world, results)
    for name, reduce_op in _TORCH_OPS.items():
        chosen = [i for i, o in enumerate(ops) if o == name]
        if chosen:
            values = _as_float64([leaves[i] for i in chosen], device)
            if world > 1:
                dist.all_reduce(values, op=reduce_op, group=group)
            _restore_all([leaves[i] for i in chosen], [name] * len(chosen), values, results, chosen)
    return rebuild(results)


def _reduce_with_header(
    payload: torch.Tensor,
    lines: list[str],
    site: Site,
    weight: str | None,
    device: torch.device,
    group: Any,
) -> torch.Tensor:
    first, second = _fingerprints(lines, site.name, weight)
    length = payload.numel()
    while True:
        fits = length <= site.capacity
        header = [1.0, first, first * first, second, second * second, 0.0, 0.0 if fits else 1.0]
        buffer = torch.zeros(_HEADER + site.capacity, dtype=torch.float64, device=device)
        buffer[: _HEADER - 1] = torch.tensor(header, dtype=torch.float64)
        buffer[_LENGTH] = length
        if fits:
            buffer[_HEADER : _HEADER + length] = payload
        dist.all_reduce(buffer, group=group)
        totals = [int(x) for x in buffer[:_HEADER].tolist()]
        ranks = totals[_ONES]
        if totals[_FAILED]:
            _raise_for_failed_rank(None, group)
        if totals[_H1] ** 2 != ranks * totals[_H1SQ] or totals[_H2] ** 2 != ranks * totals[_H2SQ]:
            _raise_for_mismatch(lines, site, group)
        if not totals[_OVERFLOW]:
            return buffer[_HEADER : _HEADER + length]
        site.capacity = max(site.capacity, totals[_LENGTH] // ranks)  # same on every rank


def report_failure(error: Exception, site: Site, group: Any = None) -> None:
    """Tell the other ranks, through the reduction they are waiting in, that this rank failed.

    Call it where this rank would have called :func:`all_reduce_tree` but
    cannot; then raise ``error``. The others raise a :class:`ReductionError`
    naming this rank. Errors while communicating are swallowed: ``error`` is
    the one worth raising.
    """
    if group_size(group) == 1:
        return
    buffer = torch.zeros(_HEADER + site.capacity, dtype=torch.float64, device=comm_device(group))
    buffer[_ONES] = 1.0
    buffer[_FAILED] = 1.0
    try:
        dist.all_reduce(buffer, group=group)
        _raise_for_failed_rank(error, group)
    except Exception:  # a broken group: nothing more can be told
        return


def _raise_for_failed_rank(error: Exception | None, group: Any) -> None:
    reports: list[Any] = [None] * group_size(group)
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(reports, mine, group=group)
    if error is not None:
        return  # the caller re-raises this rank's own error
    failed = [(rank, text) for rank, text in enumerate(reports) if text is not None]
    details = "; ".join(f"rank {rank}: {text}" for rank, text in failed)
    raise ReductionError(
        f"rank {failed[0][0]} could not reduce its result, so no rank can ({details}). "
        "Fix the error on that rank."
    )


def _raise_for_mismatch(lines: list[str], site: Site, group: Any) -> None:
    everyone: list[Any] = [None] * group_size(group)
    dist.all_gather_object(everyone, lines, group=group)
    problems = [
        f"rank {rank} {_difference(everyone[0], theirs)}"
        for rank, theirs in enumerate(everyone)
        if rank > 0 and theirs != everyone[0]
    ]
    raise ReductionError(
        f"{site.name}: ranks returned different structures, so they cannot be reduced "
        f"together: {'; '.join(problems)}. Return the same keys, types and shapes on every "
        "rank (use a zero count for a rank with no data)."
    )


def _difference(reference: list[str], theirs: list[str]) -> str:
    """How one rank's structure description differs from rank 0's, in words."""
    ours = dict(line.split(" ", 1) for line in reference)
    other = dict(line.split(" ", 1) for line in theirs)
    parts = [f"lacks {path}" for path in ours if path not in other]
    parts += [f"adds {path}" for path in other if path not in ours]
    parts += [
        f"has {path} as {other[path]} (rank 0: {ours[path]})"
        for path in ours
        if path in other and other[path] != ours[path]
    ]
    return "; ".join(parts) or "orders its leaves differently"


def _unpack_summed(
    leaves: Sequence[Leaf],
    ops: Sequence[str],
    weights: Sequence[int | None],
    summed: Sequence[int],
    numels: Sequence[int],
    reduced: torch.Tensor,
    world: int,
    results: list[Any],
) -> None:
    """Turn the reduced sums into sums, means and weighted means, in place in ``results``."""
    if not summed:
        return
    starts = dict(zip(summed, np.cumsum([0, *numels[:-1]]).tolist(), strict=True))
    weight_starts = [starts[w] for i in summed if (w := weights[i]) is not None]
    totals = iter(reduced[weight_starts].tolist() if weight_starts else [])
    divisors = [
        1.0 if ops[i] == "sum" else float(world) if weights[i] is None else next(totals)
        for i in summed
    ]
    if any(divisor != 1.0 for divisor in divisors):
        factors = torch.tensor(divisors, dtype=torch.float64, device=reduced.device)
        counts = torch.tensor(numels, device=reduced.device)
        reduced = reduced / torch.repeat_interleave(factors, counts)  # 0/0 -> NaN, never 0
    _restore_all([leaves[i] for i in summed], [ops[i] for i in summed], reduced, results, summed)


def _target_dtype(leaf: Leaf, op: str) -> Any:
    """The dtype a leaf comes back with: its own, a float where "mean" needs one."""
    if leaf.kind == NUMPY:
        kind = np.dtype(leaf.dtype).kind
        if op == "mean" and kind in "biu":
            return np.dtype(np.float64)
        if op == "sum" and kind == "b":
            return np.dtype(np.int64)
        return np.dtype(leaf.dtype)
    if leaf.kind == TENSOR:
        dtype = leaf.value.dtype
        if op == "mean" and not dtype.is_floating_point:
            return torch.get_default_dtype()
        if op == "sum" and dtype == torch.bool:
            return torch.int64
        return dtype
    if op == "mean" or leaf.dtype == "float":
        return float
    if leaf.dtype == "bool" and op in ("max", "min", "prod"):
        return bool
    return int


def _restore_all(
    leaves: Sequence[Leaf],
    ops: Sequence[str],
    values: torch.Tensor,
    results: list[Any],
    positions: Sequence[int],
) -> None:
    """Cut ``values`` (float64, in leaf order) back into leaves of their original kinds."""
    dtypes = [_target_dtype(leaf, op) for leaf, op in zip(leaves, ops, strict=True)]
    if all(leaf.kind == TENSOR and not leaf.shape for leaf in leaves):
        targets = {(dtype, leaf.value.device) for dtype, leaf in zip(dtypes, leaves, strict=True)}
        if len(targets) == 1:  # the common case: scalar tensors of one dtype on one device
            dtype, device = targets.pop()
            rounded = values if dtype.is_floating_point else values.round()
            for position, value in zip(positions, rounded.to(device, dtype).unbind(0), strict=True):
                results[position] = value
            return
    host = values.cpu()
    small = host.numel() <= 4096
    as_list = host.tolist() if small else None
    offset = 0
    for position, leaf, dtype in zip(positions, leaves, dtypes, strict=True):
        count = math.prod(leaf.shape)
        if leaf.kind == TENSOR:
            shaped = values[offset : offset + count].reshape(leaf.shape)
            if not dtype.is_floating_point:
                shaped = shaped.round()
            results[position] = shaped.to(leaf.value.device, dtype)
        elif leaf.shape:  # a NumPy array
            array = host[offset : offset + count].numpy().reshape(leaf.shape)
            results[position] = _cast_array(array, dtype)
        else:
            number = as_list[offset] if as_list is not None else host[offset].item()
            if leaf.kind == PYTHON:
                results[position] = _python_number(number, dtype)
            else:
                results[position] = dtype.type(_python_number(number, _py_type(dtype)))
        offset += count


def _py_type(dtype: np.dtype[Any]) -> type:
    return bool if dtype.kind == "b" else int if dtype.kind in "iu" else float


def _python_number(value: float, kind: Any) -> Any:
    if kind is float or not math.isfinite(value):
        return float(value)
    if kind is bool:
        return bool(value)
    return round(value)


def _cast_array(array: np.ndarray[Any, Any], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    result: np.ndarray[Any, Any]
    if dtype.kind in "iub" and np.isfinite(array).all():
        result = np.rint(array).astype(dtype)
    else:  # NaN or inf cannot become integers: keep floats
        result = array.astype(dtype if dtype.kind == "f" else np.float64)
    return result


@dataclass(frozen=True)
class _OnGpu:
    """A CUDA tensor in transit, sent as a CPU copy; it lands on the receiver's GPU."""

    tensor: torch.Tensor


def _portable(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor) and obj.is_cuda:
        return _OnGpu(obj.detach().cpu())
    if isinstance(obj, dict):
        return type(obj)((k, _portable(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(type(obj), "_fields"):
        return type(obj)(_portable(v) for v in obj)
    return obj


def _landed(obj: Any) -> Any:
    if isinstance(obj, _OnGpu):
        return obj.tensor.to(torch.device("cuda", torch.cuda.current_device()))
    if isinstance(obj, dict):
        return type(obj)((k, _landed(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(type(obj), "_fields"):
        return type(obj)(_landed(v) for v in obj)
    return obj


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` from rank ``src`` on every rank: any picklable object, of any size.

    CPU tensors arrive on the CPU, CUDA tensors on the receiver's own GPU.
    """
    world = group_size(group)
    if not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(f"src={src!r} is not a rank of this group; use 0..{world - 1}.")
    if world == 1:
        return obj
    rank = dist.get_rank(group)
    box = [_portable(obj) if rank == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return obj if rank == src else _landed(box[0])


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank; sizes may differ between ranks."""
    world = group_size(group)
    if world == 1:
        return [obj]
    rank = dist.get_rank(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, _portable(obj), group=group)
    return [obj if r == rank else _landed(value) for r, value in enumerate(gathered)]
