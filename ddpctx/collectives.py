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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddpctx.tree import NUMPY, PYTHON, TENSOR, Leaf, describe, flatten, signature

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
#: Structures a call site remembers before it starts over.
_PLANS_PER_SITE = 16

OpSpec = str | Mapping[str, str]


class ReductionError(RuntimeError):
    """Ranks could not reduce together: different structures, or another rank failed.

    Example (what every rank sees when rank 1 returned other keys)::

        ReductionError: all_reduced(evaluate): ranks returned different structures, so they
        cannot be reduced together: rank 1 lacks ['acc']; adds ['f1']. ...
    """


@dataclass
class Site:
    """One call site (a decorated function, a calling line): its agreed buffer capacity,
    and the plans it made for the structures it has seen (a cache, local to this rank)."""

    name: str
    capacity: int = DEFAULT_CAPACITY
    plans: dict[Any, _Plan] = field(default_factory=dict)


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
            if leaf.key != weight:
                raise ValueError(
                    f"{leaf.path}: the weight {weight!r} must be one number directly under "
                    f"its key, e.g. {{{weight!r}: 128}}, not inside a list or tuple."
                )
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
        if leaf.key == weight and leaf.parents:
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


def _target_dtype(leaf: Leaf, op: str) -> Any:
    """The dtype a leaf comes back with: its own, a float where "mean" needs one."""
    if leaf.kind == NUMPY:
        kind = leaf.native.kind
        if op == "mean" and kind in "biu":
            return np.dtype(np.float64)
        if op == "sum" and kind == "b":
            return np.dtype(np.int64)
        return leaf.native
    if leaf.kind == TENSOR:
        if op == "mean" and not leaf.native.is_floating_point:
            return torch.get_default_dtype()
        if op == "sum" and leaf.native == torch.bool:
            return torch.int64
        return leaf.native
    if op == "mean" or leaf.native is float:
        return float
    if leaf.native is bool and op in ("max", "min", "prod"):
        return bool
    return int


@dataclass
class _Group:
    """Leaves that travel in one buffer, and how to pack and unpack them quickly."""

    indices: list[int]
    leaves: list[Leaf]
    targets: list[Any]
    numels: list[int]
    same_tensors: bool  # all tensors of one dtype on one device: one stack/cat
    scalar_tensors: bool  # ...and all 0-d: one stack, one unbind
    one_target: tuple[Any, torch.device | None] | None  # one result dtype/device for all
    everything: bool  # the group holds every leaf, in order

    @classmethod
    def of(cls, indices: list[int], leaves: Sequence[Leaf], ops: Sequence[str]) -> _Group:
        chosen = [leaves[i] for i in indices]
        targets = [_target_dtype(leaves[i], ops[i]) for i in indices]
        kinds = {(leaf.kind, leaf.native, leaf.device) for leaf in chosen}
        same = len(kinds) == 1 and next(iter(kinds))[0] == TENSOR
        scalar = same and all(not leaf.shape for leaf in chosen)
        ends = {(target, leaf.device) for target, leaf in zip(targets, chosen, strict=True)}
        return cls(
            indices,
            chosen,
            targets,
            [math.prod(leaf.shape) for leaf in chosen],
            same,
            scalar,
            next(iter(ends)) if scalar and len(ends) == 1 else None,
            indices == list(range(len(leaves))),
        )

    def pack(self, values: list[Any], device: torch.device) -> torch.Tensor:
        """This group's values as one float64 vector on ``device``."""
        mine = values if self.everything else [values[i] for i in self.indices]
        if self.scalar_tensors:
            return torch.stack(mine).detach().to(device, torch.float64)
        if self.same_tensors:
            return torch.cat([v.detach().reshape(-1) for v in mine]).to(device, torch.float64)
        parts: list[torch.Tensor] = []
        scalars: list[float] = []
        for leaf, value in zip(self.leaves, mine, strict=True):
            if leaf.kind != TENSOR and not leaf.shape:
                scalars.append(float(value))
                continue
            if scalars:
                parts.append(torch.tensor(scalars, dtype=torch.float64, device=device))
                scalars = []
            tensor = value if leaf.kind == TENSOR else torch.from_numpy(np.asarray(value))
            parts.append(tensor.detach().reshape(-1).to(device, torch.float64))
        if scalars:
            parts.append(torch.tensor(scalars, dtype=torch.float64, device=device))
        if not parts:
            return torch.zeros(0, dtype=torch.float64, device=device)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def unpack(self, reduced: torch.Tensor, results: list[Any]) -> None:
        """Cut ``reduced`` (float64, in leaf order) back into leaves of their own kinds."""
        if self.one_target is not None:  # scalar tensors, one result dtype: one unbind
            dtype, device = self.one_target
            rounded = reduced if dtype.is_floating_point else reduced.round()
            unbound = rounded.to(device, dtype, copy=True).unbind(0)
            if self.everything:
                results[:] = unbound
            else:
                for index, value in zip(self.indices, unbound, strict=True):
                    results[index] = value
            return
        host = reduced.cpu()
        as_list = host.tolist() if host.numel() <= 4096 else None
        offset = 0
        for index, leaf, target, count in zip(
            self.indices, self.leaves, self.targets, self.numels, strict=True
        ):
            if leaf.kind == TENSOR:
                shaped = reduced[offset : offset + count].reshape(leaf.shape)
                if not target.is_floating_point:
                    shaped = shaped.round()
                results[index] = shaped.to(leaf.device, target, copy=True)
            elif leaf.shape:  # a NumPy array
                array = host[offset : offset + count].numpy().reshape(leaf.shape)
                results[index] = _cast_array(array, target)
            else:
                number = as_list[offset] if as_list is not None else host[offset].item()
                if leaf.kind == PYTHON:
                    results[index] = _python_number(number, target)
                else:
                    results[index] = target.type(_python_number(number, _py_type(target)))
            offset += count


@dataclass
class _Plan:
    """Everything about reducing one structure that does not depend on its values."""

    leaves: list[Leaf]
    rebuild: Callable[[Sequence[Any]], Any]
    ops: list[str]
    weights: list[int | None]
    summed: _Group  # mean and sum leaves (and weights): the one buffer with the header
    others: dict[str, _Group]  # "max" / "min" / "prod": one buffer each, only when used
    lines: list[str]
    fingerprints: tuple[int, int]
    weighted: bool
    uniform: str | None  # "mean" or "sum" when every summed leaf is that, unweighted
    constants: dict[Any, torch.Tensor] = field(default_factory=dict)  # headers, padding

    def constant(self, key: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A tensor that only depends on ``key`` (made once; never mutated)."""
        tensor = self.constants.get(key)
        if tensor is None:
            tensor = self.constants[key] = make()
        return tensor

    @classmethod
    def make(cls, obj: Any, op: OpSpec, weight: str | None, site: str) -> tuple[_Plan, list[Any]]:
        leaves, values, rebuild = flatten(obj)
        ops = _leaf_ops(leaves, op, weight)
        weights: list[int | None] = [None] * len(leaves)
        if weight is not None:
            weights = _weights(leaves, ops, weight)
        lines = describe(leaves, ops)
        others = {
            name: _Group.of([i for i, o in enumerate(ops) if o == name], leaves, ops)
            for name in _TORCH_OPS
            if name in ops
        }
        plan = cls(
            leaves,
            rebuild,
            ops,
            weights,
            _Group.of([i for i, o in enumerate(ops) if o in ("mean", "sum")], leaves, ops),
            others,
            lines,
            _fingerprints(lines, site, weight),
            any(w is not None for w in weights),
            _uniform([ops[i] for i, w in enumerate(weights) if ops[i] in ("mean", "sum")], weights),
        )
        return plan, values

    def divisors(self, reduced: torch.Tensor, world: int) -> torch.Tensor | float:
        """What each reduced sum is divided by: 1 (sum), the world size or the total weight."""
        group = self.summed
        ops = [self.ops[i] for i in group.indices]
        if self.uniform == "mean":
            return float(world)
        if self.uniform == "sum":
            return 1.0
        starts = dict(zip(group.indices, np.cumsum([0, *group.numels[:-1]]).tolist(), strict=True))
        weight_starts = [starts[w] for i in group.indices if (w := self.weights[i]) is not None]
        totals = iter(reduced[weight_starts].tolist() if weight_starts else [])
        per_leaf = [
            1.0 if op == "sum" else float(world) if self.weights[i] is None else next(totals)
            for i, op in zip(group.indices, ops, strict=True)
        ]
        factors = torch.tensor(per_leaf, dtype=torch.float64, device=reduced.device)
        return torch.repeat_interleave(factors, torch.tensor(group.numels, device=reduced.device))


def _uniform(summed_ops: list[str], weights: list[int | None]) -> str | None:
    """ "mean" or "sum" when one unweighted divisor fits every summed leaf (or there are none)."""
    if not summed_ops:
        return "sum"
    if any(w is not None for w in weights) or len(set(summed_ops)) != 1:
        return None
    return summed_ops[0]


def _plan_key(structure: Any, op: OpSpec, weight: str | None) -> Any:
    ops = tuple(sorted(op.items())) if isinstance(op, Mapping) else op
    return (structure, ops, weight)


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
    world = group_size(group)
    device = comm_device(group)
    values: list[Any] = []
    structure = signature(obj, values)
    key = _plan_key(structure, op, weight) if structure is not None else None
    plan = site.plans.get(key) if key is not None else None
    if plan is None:
        try:
            check_op(op)
            plan, values = _Plan.make(obj, op, weight, site.name)
        except (TypeError, ValueError) as error:
            report_failure(error, site, group)
            raise
        if key is not None:
            if len(site.plans) >= _PLANS_PER_SITE:
                site.plans.clear()
            site.plans[key] = plan
    payload = plan.summed.pack(values, device)
    if plan.weighted:
        factors = [
            1.0 if w is None else float(values[w])
            for w in map(plan.weights.__getitem__, plan.summed.indices)
        ]
        counts = torch.tensor(plan.summed.numels, device=device)
        payload = payload * torch.repeat_interleave(
            torch.tensor(factors, dtype=torch.float64, device=device), counts
        )
    results: list[Any] = [None] * len(plan.leaves)
    if world > 1:  # the reduced slice is ours alone: divide it in place
        payload = _reduce_with_header(payload, plan, site, device, group)
        payload.div_(plan.divisors(payload, world))  # a total weight of 0: 0/0 = NaN
    else:  # the payload may share memory with the caller's tensor
        payload = payload / plan.divisors(payload, world)
    if plan.summed.indices:
        plan.summed.unpack(payload, results)
    for name, others in plan.others.items():
        packed = others.pack(values, device)
        if world > 1:
            dist.all_reduce(packed, op=_TORCH_OPS[name], group=group)
        others.unpack(packed, results)
    return plan.rebuild(results)


def _reduce_with_header(
    payload: torch.Tensor, plan: _Plan, site: Site, device: torch.device, group: Any
) -> torch.Tensor:
    first, second = plan.fingerprints
    length = payload.numel()
    while True:
        fits = length <= site.capacity
        header = [1.0, first, first * first, second, second * second, 0.0, float(not fits), length]
        parts = [plan.constant(("header", device, fits, length), _float64(header, device))]
        if fits:
            parts.append(payload)
        padding = site.capacity - (length if fits else 0)
        if padding:
            parts.append(
                plan.constant(("padding", device, padding), _float64([0.0] * padding, device))
            )
        buffer = torch.cat(parts)
        dist.all_reduce(buffer, group=group)
        totals = [int(x) for x in buffer[:_HEADER].tolist()]
        ranks = totals[_ONES]
        if totals[_FAILED]:
            _raise_for_failed_rank(None, group)
        if totals[_H1] ** 2 != ranks * totals[_H1SQ] or totals[_H2] ** 2 != ranks * totals[_H2SQ]:
            _raise_for_mismatch(plan.lines, site, group)
        if not totals[_OVERFLOW]:
            return buffer[_HEADER : _HEADER + length]
        site.capacity = max(site.capacity, totals[_LENGTH] // ranks)  # same on every rank


def _float64(numbers: list[float], device: torch.device) -> Callable[[], torch.Tensor]:
    return lambda: torch.tensor(numbers, dtype=torch.float64, device=device)


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
