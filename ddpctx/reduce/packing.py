"""Turning a metric result into wire buffers, and reduced buffers back into the result.

For each structure a call site sees, a :class:`Plan` is made once: every
leaf's op (from ``op=``), its weight leaf (``weight=``), the canonical
description the protocol in :mod:`ddpctx.reduce.collectives` compares across ranks,
and the :class:`Wire` buffers it travels in. A wire is one collective: one op
("sum" carries the "mean" and "sum" leaves) and one dtype.

How leaves travel (the *layout*, a function of the structure alone):

- large float32 and float64 leaves (``SMALL`` elements or more) in their own
  dtype, so their bytes are not doubled and a sum is summed as torch's own
  ``all_reduce`` of that dtype sums it (at 3 or more ranks the order of the
  additions, and so the last bits, depends on where an element lies in the
  buffer: gloo's ring starts each chunk's sum on another rank); smaller ones
  (scalar metrics, short vectors), and float16 and bfloat16 leaves of any
  size, as float64, where the sum over ranks is exact before it is rounded
  once to the leaf's dtype, sharing the wire of the Python floats and
  ``np.float64`` scalars;
- integers and bools exactly, as int64. Under "mean"/"sum" they ride inside
  the float64 (else float32) sum wire as a few exact pieces of
  ``bits_per_piece`` bits (a piece summed over every rank stays an exact
  integer in that float), so a dict of floats and counts is still ONE
  collective. Integer tensors and arrays come back in their own dtype,
  wrapped as torch's (and NumPy's) arithmetic in that dtype wraps. Python
  ints under "mean"/"sum" always travel as pieces in the float64 wire, so
  their sum is exact, also beyond int64 (Python ints do not wrap);
- weighted "mean" leaves as float64 (float32 tensors as float32): the
  product with the weight is formed in float64 first;
- "max"/"min" of floats carry one more element: whether any rank held a NaN.
  When one did (rare), a second collective marks which elements, and those
  come back NaN: NaN propagates whichever rank holds it.

The first wire also carries the *flag* element of the protocol (one element,
exact in any dtype: it is 0 or 1 per rank) -- except where the one wire is a
floating sum or product whose first leaf is a plain floating value (a loss,
one large tensor, a dict of scalar metrics) at 2+ ranks: there the flag is a
NaN in that first value. gloo's latency grows with the element count in
steps (2 ranks, float64: 1 element 0.27 ms, 2 elements 0.40 ms, 3 to 64
elements 0.6-1.3 ms), so ``{"loss": ..., "acc": ...}`` travels as 2
elements, not 3; and a large tensor's buffer is then its one copy, with
nothing in front.

Example:
    >>> plan, values = Plan.make({"loss": 1.5, "count": 2}, "mean", "count", world=2)
    >>> [leaf.path for leaf in plan.leaves], plan.ops
    (["['loss']", "['count']"], ['mean', 'sum'])
    >>> [(wire.op, str(wire.dtype), wire.length) for wire in plan.wires]
    [('sum', 'torch.float64', 4)]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ddpctx.reduce.tree import NUMPY, PYTHON, TENSOR, Leaf, containers, describe, flatten
from ddpctx.reduce.wire import Slot, Wire

#: The reductions: "mean" and "sum" share the summed wire; the others use torch's ops.
OPS = ("mean", "sum", "max", "min", "prod")

OpSpec = str | Mapping[str, str]

#: Floating leaves with fewer elements travel as float64 (see ``_wire_float``).
SMALL = 1024
#: Wire order: the first wire present carries the protocol's flag.
_WIRE_OPS = ("sum", "max", "min", "prod")
_FLOAT_ORDER = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_MANTISSA = {torch.float64: 53, torch.float32: 24}  # where exact integer pieces fit
_HALVES = (torch.float16, torch.bfloat16)


def leaf_ops(leaves: Sequence[Leaf], op: OpSpec, weight: str | None) -> list[str]:
    """The op of every leaf: the innermost of its keys named in ``op``, else "mean".

    A key named in ``op`` applies to every leaf below it unless a key further in
    is named too: with ``op={"val": "max", "loss": "mean"}``, ``val.loss`` is a
    mean and ``val.peak`` a max.
    """
    mapping = op if isinstance(op, Mapping) else {}
    default = "mean" if isinstance(op, Mapping) else op
    seen: set[Any] = set()
    ops = []
    for leaf in leaves:
        chosen = None
        for key in reversed(leaf.keys):
            if isinstance(key, str) and key in mapping:
                seen.add(key)
                if chosen is None:
                    chosen = mapping[key]
        chosen = chosen or default
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
    unused = set(mapping) - seen
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


def _torch_dtype(leaf: Leaf) -> torch.dtype:
    """The leaf's own dtype as a torch dtype (Python numbers: float64 / int64)."""
    if leaf.kind == TENSOR:
        dtype: torch.dtype = leaf.native
        return dtype
    if leaf.kind == NUMPY:
        kind = leaf.native.kind
        if kind == "f":
            return {2: torch.float16, 4: torch.float32}.get(leaf.native.itemsize, torch.float64)
        return torch.int64
    return torch.float64 if leaf.native is float else torch.int64


def _target(leaf: Leaf, op: str) -> Any:
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
class Plan:
    """Everything about reducing one structure that does not depend on its values."""

    leaves: list[Leaf]
    rebuild: Callable[[Sequence[Any]], Any]
    ops: list[str]
    weights: list[int | None]
    wires: list[Wire]
    lines: list[str]  # the canonical description every rank compares
    targets: list[Any]
    fast: Any = None  # its :class:`~ddpctx.reduce.fastpath.FastPath`, where it has one

    @classmethod
    def make(cls, obj: Any, op: OpSpec, weight: str | None, world: int) -> tuple[Plan, list[Any]]:
        leaves, values, rebuild = flatten(obj)
        ops = leaf_ops(leaves, op, weight)
        weights: list[int | None] = [None] * len(leaves)
        if weight is not None:
            weights = _weights(leaves, ops, weight)
        lines = [f"weight={weight!r}", *containers(obj), *describe(leaves, ops)]
        wires = _layout(leaves, ops, weights, world)
        targets = [_target(leaf, o) for leaf, o in zip(leaves, ops, strict=True)]
        for wire in wires:
            wire.prepare(leaves, targets)
        return cls(leaves, rebuild, ops, weights, wires, lines, targets), values

    def pack(self, values: Sequence[Any], device: torch.device) -> list[torch.Tensor]:
        """One new buffer per wire. A weight that is negative, NaN or infinite is refused:
        a weighted mean over it would be a number, silently wrong, on every rank."""
        for index in {w for w in self.weights if w is not None}:
            weight = float(values[index])
            if not (math.isfinite(weight) and weight >= 0):
                leaf = self.leaves[index]
                raise ValueError(
                    f"{leaf.path} = {weight!r} is the weight (weight={leaf.key!r}) of a "
                    "weighted mean; it counts samples, so it must be a finite number >= 0. "
                    "Return this rank's number of samples (0 for a rank with none)."
                )
        return [wire.pack(values, device) for wire in self.wires]

    def unpack(self, reduced: Sequence[torch.Tensor], world: int) -> Any:
        """The result, rebuilt from every wire's reduced buffer."""
        totals: dict[int, float] = {}  # a total weight of 0: 0/0 = NaN
        for weight in {w for w in self.weights if w is not None}:
            for wire, buffer in zip(self.wires, reduced, strict=True):
                for slot in wire.slots:
                    if slot.leaf == weight:
                        totals[weight] = wire.total(buffer, slot, world)
        results: list[Any] = [None] * len(self.leaves)
        for wire, buffer in zip(self.wires, reduced, strict=True):
            wire.unpack(buffer, results, world, totals)
        for wire, buffer in zip(self.wires, reduced, strict=True):
            for slot in wire.estimates:
                estimate = float(buffer[slot.start])
                results[slot.leaf] = exact_product(
                    results[slot.leaf], estimate, world, self.leaves[slot.leaf].path
                )
        return self.rebuild(results)


def exact_product(wrapped: int, estimate: float, world: int, path: str) -> int:
    """A product of Python ints, exact: its int64 product (wrapped) and its float64 one.

    The float64 product is within ``2 * world`` roundings of the exact one, so
    while that error is below 2**63 it names the one multiple of 2**64 that the
    int64 product lost. Beyond that, an :class:`OverflowError` (on every rank:
    they all hold the same two numbers).

    >>> exact_product(0, 2.0**64, world=2, path="x")
    18446744073709551616
    """
    if math.isfinite(estimate) and abs(estimate) * 4 * world * 2.0**-53 < 2.0**62:
        return wrapped + round((estimate - wrapped) / 2.0**64) * 2**64
    raise OverflowError(
        f"{path}: the product of the Python ints over {world} ranks is about {estimate:.3g}, "
        "too large to compute exactly. Reduce it as a float (float(x)) or its logarithm."
    )


def _layout(
    leaves: Sequence[Leaf], ops: Sequence[str], weights: Sequence[int | None], world: int
) -> list[Wire]:
    """Which leaves travel in which wire, in which dtype: a function of the structure only."""
    # (op, dtype) -> [(leaf, pieces, whether it is a product's float64 estimate)]
    members: dict[tuple[str, torch.dtype], list[tuple[int, int, bool]]] = {}
    summed_floats = {
        _wire_float(leaf)
        for leaf, op, w in zip(leaves, ops, weights, strict=True)
        if op in ("mean", "sum") and w is None and _torch_dtype(leaf).is_floating_point
    }
    if any(w is not None for w in weights) or any(
        leaf.kind == PYTHON and op in ("mean", "sum") for leaf, op in zip(leaves, ops, strict=True)
    ):  # Python ints sum exactly only as pieces (beyond int64 too)
        summed_floats.add(torch.float64)
    host = next((d for d in (torch.float64, torch.float32) if d in summed_floats), None)
    for index, (leaf, op, weight) in enumerate(zip(leaves, ops, weights, strict=True)):
        own = _torch_dtype(leaf)
        wire_op = "sum" if op in ("mean", "sum") else op
        pieces = 1
        if weight is not None:
            dtype = torch.float32 if _wire_float(leaf) == torch.float32 else torch.float64
        elif own.is_floating_point:
            dtype = _wire_float(leaf)
        elif wire_op == "sum" and host is not None:
            dtype, pieces = host, _pieces(host, world)
        else:
            dtype = torch.int64
        members.setdefault((wire_op, dtype), []).append((index, pieces, False))
        if wire_op == "prod" and leaf.kind == PYTHON and leaf.native is int:
            # its float64 product too, to tell the exact product from the int64 one
            members.setdefault(("prod", torch.float64), []).append((index, 1, True))
    order = [
        (wire_op, dtype)
        for wire_op in _WIRE_OPS
        for dtype in (*_FLOAT_ORDER, torch.int64)
        if (wire_op, dtype) in members
    ]
    if order and order[0][0] == "prod" and not order[0][1].is_floating_point:
        order.insert(0, ("sum", torch.float64))  # 2**ranks would overflow an int64 flag
        members[("sum", torch.float64)] = []
    if not order:
        order, members = [("sum", torch.float64)], {("sum", torch.float64): []}
    wires = []
    for position, (wire_op, dtype) in enumerate(order):
        flag = position == 0
        start = int(flag)
        slots = []
        bits = _bits(dtype, world)
        plain_first = sorted(members[(wire_op, dtype)], key=lambda member: member[1] > 1)
        for index, pieces, estimate in plain_first:  # integers in pieces last: cut, joined at once
            count = math.prod(leaves[index].shape)
            mean = ops[index] == "mean"
            slots.append(Slot(index, start, count, pieces, weights[index], mean, estimate))
            start += count * pieces
        nan_marker = wire_op in ("max", "min") and dtype.is_floating_point
        wires.append(Wire(wire_op, dtype, slots, start + nan_marker, flag, nan_marker, bits))
    return _flag_in_nan(wires, world)


def _flag_in_nan(wires: list[Wire], world: int) -> list[Wire]:
    """One floating sum or product wire: its flag rides in its first value, as NaN.

    A sum or product is NaN on every rank when any rank sent NaN, so a raised
    flag needs no element of its own; a NaN in the first element of the
    result is resolved by one more 1-element collective, which only a raised
    flag or a NaN/inf there in the data costs (a step check placed first, a
    number never NaN, costs nothing even then). gloo's latency grows with the
    element count in steps (2 ranks: 1 element 0.27 ms, 2 elements 0.40 ms,
    3 or more 0.6-1.3 ms), so a loss travels as one element and two metrics
    as two. A large tensor (a 1M-element float32 mean) travels the same way:
    a flag element in front would make its buffer one element longer than
    the tensor, so packing it would be a ``cat`` into a new buffer and
    dividing it a pass over a view one element off its start, where without
    one the buffer is the tensor's one copy (the ``clone`` its snapshot needs
    anyway), reduced and divided in place.

    The first leaf must be a plain value (not a weighted mean, not integer
    pieces, not a product's estimate): its NaN is the flag.
    """
    if world < 2 or len(wires) != 1:
        return wires
    (wire,) = wires
    if wire.op not in ("sum", "prod") or not wire.dtype.is_floating_point or wire.nan_marker:
        return wires
    if not wire.slots:
        return wires
    first = wire.slots[0]
    if first.count < 1 or first.pieces != 1 or first.weight is not None or first.estimate:
        return wires
    moved = [dataclasses.replace(slot, start=slot.start - 1) for slot in wire.slots]
    bits = wire.bits_per_piece
    return [Wire(wire.op, wire.dtype, moved, wire.length - 1, False, False, bits, flag_in_nan=True)]


def _wire_float(leaf: Leaf) -> torch.dtype:
    """A floating leaf's wire dtype: its own, or float64 for a small or half-precision one.

    Small leaves (scalars, short vectors) cost latency, not bandwidth: in
    float64 their sum over ranks is exact before it is rounded once to the
    leaf's dtype, and they share one wire with the Python floats and counts.
    float16 and bfloat16 leaves travel as float64 at every size: summed in
    their own dtype, each partial sum of gloo's ring is rounded (at 3 ranks,
    a bfloat16 sum came back 200.0 for an exact 200.75), while their float64
    sum is exact (float16 always, bfloat16 unless the ranks' values lie 2**40
    or more apart) and is then rounded once. Four times the bytes, for the
    correctly rounded sum.
    """
    own = _torch_dtype(leaf)
    if own in _HALVES or math.prod(leaf.shape) < SMALL:
        return torch.float64
    return own


def _bits(dtype: torch.dtype, world: int) -> int:
    """Bits per piece such that ``world`` pieces sum exactly in ``dtype``."""
    return _MANTISSA.get(dtype, 0) - world.bit_length()


def _pieces(dtype: torch.dtype, world: int) -> int:
    return -(-64 // _bits(dtype, world))


def plan_key(structure: Any, op: OpSpec, weight: str | None, world: int) -> Any:
    ops = tuple(sorted(op.items())) if isinstance(op, Mapping) else op
    return (structure, ops, weight, world)
