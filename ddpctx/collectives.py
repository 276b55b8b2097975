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
:mod:`ddpctx.context`; callers pass the :class:`Site`. Turning results into
buffers and back (ops, weights, fingerprints, leaf kinds) is
:mod:`ddpctx.packing`'s job.

Example:
    >>> all_reduce_tree({"loss": 2.0, "count": 4}, weight="count", site=Site("doc"))
    {'loss': 2.0, 'count': 4}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ddpctx.packing import OPS, OpSpec, Plan, plan_key
from ddpctx.tree import signature

_TORCH_OPS = {
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}
_HEADER = 8
_ONES, _H1, _H1SQ, _H2, _H2SQ, _FAILED, _OVERFLOW, _LENGTH = range(_HEADER)

#: Payload elements a call site starts with; 32 metrics fit without a resize.
DEFAULT_CAPACITY = 64
#: Structures a call site remembers before it starts over.
_PLANS_PER_SITE = 16


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
    plans: dict[Any, Plan] = field(default_factory=dict)


def check_op(op: object) -> None:
    """Refuse an unknown op before any communication."""
    names = op.values() if isinstance(op, Mapping) else [op]
    for name in names:
        if name not in OPS:
            raise ValueError(
                f"op={op!r}: {name!r} is not a reduction. Use one of "
                f"{', '.join(map(repr, OPS))}, or a dict mapping result keys to them."
            )


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
    key = plan_key(structure, op, weight) if structure is not None else None
    plan = site.plans.get(key) if key is not None else None
    if plan is None:
        try:
            check_op(op)
            plan, values = Plan.make(obj, op, weight, site.name)
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
    payload: torch.Tensor, plan: Plan, site: Site, device: torch.device, group: Any
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
