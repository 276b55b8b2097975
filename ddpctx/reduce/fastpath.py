"""The steady state of a call site, for the results metric code returns every step.

Once every rank has agreed on a call site's structure (see
:mod:`ddpctx.reduce.collectives`), each further call only has to check that
this rank's result still has that structure, pack it, reduce it and read it
back. For the commonest results -- one 0-d tensor (a loss), a flat ``dict``
of 0-d tensors of one dtype on one device, one Python float or a flat
``dict`` of them, and a flat ``dict`` mixing floating 0-d CPU tensors and
Python floats summed or averaged (``{"loss": loss, "lr": 3e-4}``, and what
``ctx.log`` sends: the metrics and its step check) -- a :class:`FastPath`
does exactly that and nothing more:

- the check compares the dict's keys (one tuple comparison), the leaf types
  and dtypes; the shapes and devices are checked by ``torch.stack`` itself
  (it refuses tensors of different shapes or devices) and one look at the
  stacked shape and device -- or, for floating 0-d tensors on the CPU, by one
  C-level ``map`` each over ``dim`` and ``is_cpu``;
- the pack is one ``torch.stack`` (or one ``torch.tensor`` of the floats)
  with the protocol's lowered flag in front, converted once to the wire dtype.
  Floating 0-d tensors on the CPU are read with ``item()`` into one float64
  ``torch.tensor`` instead (4.7-9.0 us against 5.5-10.4 us for 1-16 leaves),
  and one such value alone (a loss, or a one-key dict) is one ``torch.full``:
  it travels as one element, whose flag rides in the value as NaN -- gloo's
  two-element all_reduce took 1.5-2x its one-element one here; a mixed
  dict is read the same way, a tensor by ``item()`` and a float as it is
  (the general path planned, cut and joined it every call: 280 against
  110 us of CPU a call for ``{"loss": loss, "lr": lr}`` at 2 ranks);
- the read-back starts from the one ``tolist()`` that reads the flag: the
  float64 sums are divided as Python floats (a mean) and rounded once to the
  leaves' dtype by one ``torch.tensor`` (slicing, dividing, converting and
  unbinding the buffer took 16 us), then one ``unbind`` -- no other per-leaf
  work beyond building the dict; up to :data:`FEW` values by one
  ``torch.scalar_tensor`` each (1.7 us, ``torch.tensor`` 3.7 us). A mixed
  dict's values are divided per leaf (a mean) or not (a sum) and each comes
  back as its own kind: a 0-d tensor of its dtype, or a float.

A buffer preallocated per site and filled in place is not cheaper on CPU
(32 float32 scalars, best of 9 x 1000 calls, 2 loaded cores):
``torch.stack(..., out=)`` into a float64 view costs 119-190 us against
23-36 us for a fresh ``stack`` and one conversion; stacking into a reused
float32 buffer and converting saves nothing measurable (22-31 us); and a
reused buffer could neither be in flight twice (``async_op=True``) nor hand
its views back as results.

One large floating tensor (summed, averaged or multiplied in its own dtype,
its flag riding in its first value) is packed as its clone -- the one copy a
hand-written ``clone``, ``all_reduce``, ``div_`` makes too -- and read back
by one element's ``item()`` for the flag and the division in place.

Anything else, and any result whose structure differs from the agreed one,
takes the general path, which raises the protocol's flag when needed: the
fast path never decides anything the general path would decide otherwise.

Why one module (past 400 lines): each kind's check-and-pack and its read-back
are two halves of one wire format, kept beside each other and beside the
rules (:func:`_whole`, :func:`_mixed`) that choose the kind from the agreed plan.

Example:
    >>> metrics = {"loss": torch.tensor(2.0), "acc": torch.tensor(0.5)}
    >>> plan, _ = Plan.make(metrics, "mean", None, world=2)
    >>> fast = FastPath.of(plan, metrics, "mean", None, world=2)
    >>> buffer = fast.pack(metrics)
    >>> buffer.tolist()  # the values: a raised flag would be a NaN in the first
    [2.0, 0.5]
    >>> fast.unpack(buffer.mul_(2), buffer.tolist())  # as if two ranks sent the same
    {'loss': tensor(2.), 'acc': tensor(0.5000)}

A single value (a loss) travels alone too.

    >>> plan, _ = Plan.make(torch.tensor(2.0), "mean", None, world=2)
    >>> FastPath.of(plan, torch.tensor(2.0), "mean", None, world=2).pack(torch.tensor(2.0))
    tensor([2.], dtype=torch.float64)
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch

from ddpctx.reduce.packing import OpSpec, Plan
from ddpctx.reduce.tree import PYTHON, TENSOR
from ddpctx.reduce.values import HALVES, mean_over_, rounded

_CPU = torch.device("cpu")
_TENSOR = {torch.Tensor}
_FLOAT = {float}
_ZERO_D = {0}
_TRUE = {True}
_dtype = attrgetter("dtype")
_is_cpu = attrgetter("is_cpu")
_dim = torch.Tensor.dim
_item = torch.Tensor.item
#: Up to this many leaves come back as one ``torch.scalar_tensor`` each (2 us a leaf);
#: more as one ``torch.tensor`` and ``unbind`` (6 us plus 0.6 us a leaf).
FEW = 3


class FastPath:
    """One agreed structure of one call site, packed and read back with the least Python."""

    __slots__ = (
        "bare",
        "comm",
        "device",
        "dtype",
        "dtypes",
        "flag",
        "flagged",
        "from_numbers",
        "items",
        "keys",
        "kinds",
        "loss",
        "mean",
        "means",
        "mixed",
        "move",
        "op",
        "plan",
        "shape",
        "target",
        "targets",
        "tensor_dtypes",
        "tensors",
        "weight",
        "whole",
        "wire",
        "world",
    )

    def __init__(
        self,
        plan: Plan,
        keys: tuple[Any, ...] | None,
        op: OpSpec,
        weight: str | None,
        world: int,
        device: torch.device,
        mixed: bool = False,
        whole: bool = False,
    ) -> None:
        wire = plan.wires[0]
        first = plan.leaves[0]
        self.plan, self.wire, self.op, self.weight, self.world = plan, wire, op, weight, world
        self.keys = keys
        self.bare = keys is None
        self.tensors = first.kind == TENSOR
        self.mean = wire.slots[0].mean
        self.target = plan.targets[0]
        self.dtype = first.native  # the leaves' own dtype (tensors)
        self.dtypes = {first.native}
        self.device = first.device  # the leaves' (tensors)
        self.comm = device  # the buffer's
        self.move = world > 1 and device != first.device  # back to the leaves' device
        self.from_numbers = (
            self.tensors and wire.dtype == torch.float64 and self.target.is_floating_point
        )
        self.shape: tuple[int, ...] = (len(plan.leaves),)
        # One large floating tensor on the comm device (see _whole): its clone is the buffer.
        self.whole = whole
        if whole:
            self.shape = tuple(first.shape)
        self.flagged = world > 1 and wire.flag  # a flag element in front (else none, or NaN)
        # Floating 0-d tensors on the CPU into a float64 wire: the buffer is built from
        # their values (item() each, then one torch.tensor), cheaper than stack + to at
        # every count (1 leaf 4.7 us vs 5.5 us, 16 leaves 9.0 us vs 10.4 us).
        self.items = (
            self.tensors
            and world > 1
            and wire.dtype == torch.float64
            and first.native.is_floating_point
            and first.device == _CPU
            and device == _CPU
        )
        # One such value alone (a loss, or a one-key dict of it): one torch.full.
        self.loss = self.items and not self.flagged and len(plan.leaves) == 1
        # A flat dict of floating 0-d CPU tensors and Python floats: each read as a number.
        self.mixed = mixed
        self.kinds = tuple(torch.Tensor if leaf.kind == TENSOR else float for leaf in plan.leaves)
        self.tensor_dtypes = tuple(
            (index, leaf.native) for index, leaf in enumerate(plan.leaves) if leaf.kind == TENSOR
        )
        self.means = tuple(slot.mean for slot in wire.slots)
        self.targets = tuple(plan.targets)
        self.flag = (
            torch.tensor(wire.flag_value(False), dtype=first.native, device=first.device)
            if self.tensors
            else wire.flag_value(False)
        )

    @classmethod
    def of(
        cls,
        plan: Plan,
        obj: Any,
        op: OpSpec,
        weight: str | None,
        world: int,
        device: torch.device = _CPU,
    ) -> FastPath | None:
        """A fast path for ``plan`` (made for ``obj``), or None if its structure has none."""
        if len(plan.wires) != 1 or weight is not None:
            return None
        wire = plan.wires[0]
        leaves = plan.leaves
        if type(obj) is dict:
            keys: tuple[Any, ...] | None = tuple(obj)
            if any(len(leaf.keys) != 1 or len(leaf.parents) != 1 for leaf in leaves):
                return None  # nested
        elif len(leaves) == 1 and not leaves[0].keys and not leaves[0].parents:
            keys = None
        else:
            return None
        if _whole(plan, world, device):
            if type(obj if keys is None else next(iter(obj.values()))) is not torch.Tensor:
                return None
            return cls(plan, keys, op, weight, world, device, whole=True)
        if wire.packing == "stack" and wire.unpacking == "tensors":
            if type(obj) is dict and not all(type(v) is torch.Tensor for v in obj.values()):
                return None
            if keys is None and type(obj) is not torch.Tensor:
                return None
            return cls(plan, keys, op, weight, world, device)
        if (
            wire.packing == "numbers"
            and all(leaf.kind == PYTHON and leaf.native is float for leaf in leaves)
            and wire.op in ("sum", "prod")  # max/min of floats carry a NaN marker
            and len({slot.mean for slot in wire.slots}) == 1  # divided alike, or not at all
        ):
            return cls(plan, keys, op, weight, world, device)
        if keys is not None and _mixed(plan, world, device):  # each leaf divided or not
            return cls(plan, keys, op, weight, world, device, mixed=True)
        return None

    def matches(self, op: OpSpec, weight: str | None) -> bool:
        return (self.op is op or self.op == op) and self.weight == weight

    def pack(self, obj: Any) -> torch.Tensor | None:
        """``obj`` as the wire's buffer (flag lowered), or None if its structure differs."""
        if self.bare:
            values = [obj]
        elif type(obj) is dict and tuple(obj) == self.keys:
            values = list(obj.values())
        else:
            return None
        if self.whole:
            (value,) = values
            if (
                type(value) is not torch.Tensor
                or value.dtype != self.dtype
                or value.shape != self.shape
                or value.device != self.device
                or value.layout != torch.strided
            ):
                return None
            # The snapshot a reduction needs anyway, and its buffer: as by hand, one copy (flat,
            # as every wire: a small one of a 2-rank gloo group travels as gathered rows).
            if value.requires_grad:
                value = value.detach()
            return value.clone(memory_format=torch.contiguous_format).view(-1)
        if self.loss:
            (value,) = values
            if (
                type(value) is not torch.Tensor
                or value.dtype != self.dtype
                or value.dim() != 0
                or not value.is_cpu
            ):
                return None
            # Half the cost of stack + to (2.1 us vs 4.4 us); the value converts exactly.
            return torch.full((1,), value.item(), dtype=torch.float64)
        if self.mixed:
            if tuple(map(type, values)) != self.kinds:
                return None
            for index, dtype in self.tensor_dtypes:
                value = values[index]
                if value.dtype != dtype or value.dim() != 0 or not value.is_cpu:
                    return None
            numbers = [
                value.item() if kind is torch.Tensor else value
                for value, kind in zip(values, self.kinds, strict=True)
            ]
            if self.flagged:
                numbers.insert(0, self.wire.flag_value(False))
            return torch.tensor(numbers, dtype=torch.float64)
        if self.items:
            if (
                set(map(type, values)) != _TENSOR
                or set(map(_dtype, values)) != self.dtypes
                or set(map(_dim, values)) != _ZERO_D
                or set(map(_is_cpu, values)) != _TRUE
            ):
                return None
            numbers = list(map(_item, values))  # exact in float64 from any floating dtype
            if self.flagged:
                numbers.insert(0, self.wire.flag_value(False))
            return torch.tensor(numbers, dtype=torch.float64)
        if self.tensors:
            # map/set run in C: a third of the cost of a Python loop over 32 leaves
            if set(map(type, values)) != _TENSOR or set(map(_dtype, values)) != self.dtypes:
                return None
            if self.flagged:
                values.insert(0, self.flag)
            try:
                stacked = torch.stack(values)
            except RuntimeError:  # another shape or device: the general path says which
                return None
            if stacked.shape != (len(values),) or stacked.device != self.device:
                return None
            if stacked.requires_grad:
                stacked = stacked.detach()
            return stacked.to(self.comm, self.wire.dtype) if self.world > 1 else stacked
        if set(map(type, values)) != _FLOAT:
            return None
        if self.flagged:
            values.insert(0, self.flag)
        return torch.tensor(values, dtype=self.wire.dtype, device=self.comm)

    def unpack(self, reduced: torch.Tensor, numbers: list[Any] | None = None) -> Any:
        """The result from the reduced buffer (``numbers``: its ``tolist()``, when read)."""
        world = self.world
        start = 1 if self.flagged else 0
        values: Any
        if self.whole:
            whole = (mean_over_(reduced, world) if self.mean else reduced).view(self.shape)
            return whole if self.bare else {self.keys[0]: whole}  # type: ignore[index]
        if self.mixed:
            if numbers is None:
                numbers = reduced.tolist()
            values = [
                (number / world if mean else number)
                if target is float
                else _scalar(number / world if mean else number, target, _CPU)
                for number, mean, target in zip(
                    numbers[start:], self.means, self.targets, strict=True
                )
            ]
            return dict(zip(self.keys, values, strict=True))  # type: ignore[arg-type]
        if self.tensors and numbers is not None and self.from_numbers:
            # float64 sums already read as Python floats: divided there (the same IEEE
            # division) and rounded once to the leaves' dtype by one torch.tensor --
            # a quarter of the cost of slicing, dividing and converting the buffer
            values = numbers[start:]
            if self.mean and world > 1:
                values = [number / world for number in values]
            if self.bare:
                return _scalar(values[0], self.target, self.device)
            if len(values) <= FEW:  # one 0-d tensor each: cheaper than tensor + unbind
                values = [_scalar(value, self.target, self.device) for value in values]
            elif self.target in HALVES:  # rounded once from float64, never via float32
                wide = torch.tensor(values, dtype=torch.float64, device=self.device)
                values = rounded(wide, self.target).unbind(0)
            else:
                values = torch.tensor(values, dtype=self.target, device=self.device).unbind(0)
        elif self.tensors:
            body = reduced[start:] if start else reduced
            if self.mean and world > 1:
                if not body.is_floating_point():
                    body = body.to(torch.float64)
                body = mean_over_(body, world)
            target = self.target
            if not target.is_floating_point and body.is_floating_point():
                body = body.round()
            body = rounded(body, target)
            values = (body.to(self.device) if self.move else body).unbind(0)
        else:
            if numbers is None:
                numbers = reduced.tolist()
            values = numbers[start:] if start else numbers
            if self.mean and world > 1:
                values = [number / world for number in values]
        if self.bare:
            return values[0]
        return dict(zip(self.keys, values, strict=True))  # type: ignore[arg-type]


def _whole(plan: Plan, world: int, device: torch.device) -> bool:
    """Whether ``plan`` is one floating tensor, on ``device``, summed, averaged or multiplied
    in its own dtype in one wire whose flag rides in its first value (at 2+ ranks).

    Then its buffer is its clone, reduced as it is and divided in place: the
    general path's cut-and-join cost ~0.3 ms of CPU a call over a 1M-element
    float32 tensor (1.25 against 0.91 ms by hand, 2 ranks), a flat copy and
    a slow flag read among it.
    """
    if world < 2 or len(plan.leaves) != 1:
        return False
    (wire,), (leaf,) = plan.wires, plan.leaves
    if leaf.kind != TENSOR or leaf.device != device or not wire.flag_in_nan:
        return False
    if wire.dtype != leaf.native or len(wire.slots) != 1 or wire.first_pieces != 1:
        return False
    (slot,) = wire.slots
    return (
        slot.start == 0
        and slot.count == wire.length
        and slot.pieces == 1
        and slot.weight is None
        and not slot.estimate
    )


def _mixed(plan: Plan, world: int, device: torch.device) -> bool:
    """Whether ``plan`` is a flat dict of floating 0-d CPU tensors and Python floats, each
    summed or averaged, in one float64 wire (at 2+ ranks), its flag in front or in NaN."""
    (wire,) = plan.wires
    if world < 2 or device != _CPU or wire.op != "sum" or wire.dtype != torch.float64:
        return False
    if wire.nan_marker or wire.first_pieces != len(wire.slots):
        return False
    offset = int(wire.flag)
    for index, (leaf, slot) in enumerate(zip(plan.leaves, wire.slots, strict=True)):
        if slot.leaf != index or slot.start != index + offset or slot.count != 1:
            return False
        if slot.weight is not None or slot.estimate:
            return False
        if leaf.kind == TENSOR:
            if not leaf.native.is_floating_point or leaf.shape != () or leaf.device != _CPU:
                return False
        elif not (leaf.kind == PYTHON and leaf.native is float):
            return False
    return True


def _scalar(value: float, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    """``torch.tensor(value, dtype=dtype, device=device)`` in half the time (1.7 us vs 3.7 us).

    ``torch.scalar_tensor`` rounds as ``torch.tensor`` does (the same on 60,000
    values, random bit patterns among them, in float32/float64) but refuses a
    value outside the dtype's range, which ``torch.tensor`` makes an infinity:
    that rare case takes ``torch.tensor``. float16 and bfloat16 are rounded
    once by :func:`~ddpctx.reduce.values.rounded` (torch rounds through float32).
    """
    if dtype in HALVES:  # rounded once from float64, never via float32
        return rounded(torch.tensor(value, dtype=torch.float64, device=device), dtype)
    try:
        return torch.scalar_tensor(value, dtype=dtype, device=device)
    except RuntimeError:  # overflow: +-inf, as torch.tensor rounds it
        return torch.tensor(value, dtype=dtype, device=device)
