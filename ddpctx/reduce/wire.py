"""One wire: the buffer, and the collective, that a group of leaves travels in.

A :class:`Wire` holds the leaves of a result that share a reduction op and a
wire dtype (chosen by :mod:`ddpctx.reduce.packing`), each at a :class:`Slot`. It packs
their values into one new buffer (never a view of an input: the reduction
works in place) and cuts a reduced buffer back into leaves of their own kinds.

Integers in a float wire travel as *pieces*: ``bits_per_piece`` bits each,
non-negative, so ``world`` of them sum exactly in the float; the int64 sum is
put back together modulo 2**64, which is how int64 wraps.

Two layouts get a fast path, because they are what metrics usually are: all
0-d tensors of one dtype (one ``stack``, one ``unbind``), and all Python or
NumPy scalars (one ``torch.tensor``, one ``tolist``).

Example:
    >>> wire = Wire("sum", torch.float64, [Slot(0, 1, 1, 1, None, False)], 2, True, False, 51)
    >>> wire.prepare([leaf_of(2.5)], [float])
    >>> buffer = wire.pack([2.5], torch.device("cpu"))
    >>> buffer.tolist()
    [0.0, 2.5]
    >>> results = [None]
    >>> wire.unpack(buffer, results, 1, {})
    >>> results
    [2.5]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ddpctx.reduce.tree import PYTHON, TENSOR, Leaf, flatten
from ddpctx.reduce.values import (
    as_int64,
    as_number,
    divided,
    finish,
    from_numpy,
    mean_over_,
    rounded,
    scalar,
    times,
)

_INT64 = 2**64
_SIGN_BIT = -(2**63)  # as an int64: XOR with it adds 2**63 modulo 2**64


def leaf_of(value: Any) -> Leaf:
    """The :class:`~ddpctx.reduce.tree.Leaf` record of a single value (for examples and tests)."""
    return flatten(value)[0][0]


@dataclass
class Slot:
    """One leaf's place in a wire: ``count`` values from ``start``, as ``pieces`` pieces each."""

    leaf: int
    start: int
    count: int
    pieces: int  # 1: the value itself; k > 1: an int64 cut into k exact pieces
    weight: int | None  # weighted mean: multiplied by this leaf's value before sending
    mean: bool  # divided after the sum: by the world size, or by the total weight
    estimate: bool = False  # a Python int product's float64 estimate (see packing.exact_product)


@dataclass
class Wire:
    """One buffer and one collective: every leaf sharing an op and a wire dtype."""

    op: str
    dtype: torch.dtype
    slots: list[Slot]
    length: int  # elements, flag and NaN marker included
    flag: bool  # element 0 is the protocol's flag
    nan_marker: bool  # the last element says whether a rank held a NaN (float max/min)
    bits_per_piece: int
    packing: str = "general"  # or "stack" (0-d tensors) or "numbers" (Python/NumPy scalars)
    unpacking: str = "general"  # or "tensors" or "numbers"
    leaves: list[Leaf] = field(default_factory=list)
    targets: list[Any] = field(default_factory=list)  # per slot
    first_pieces: int = 0  # slots from here on are integers in pieces
    int_scalars: str = ""  # those integers: all 0-d tensors (TENSOR), all numbers (PYTHON)
    estimates: list[Slot] = field(default_factory=list)  # read by the plan, not unpacked here
    # No flag element: a raised flag is a NaN in the first value (see flag_unclear)
    flag_in_nan: bool = False
    _flags: dict[Any, torch.Tensor] = field(default_factory=dict)

    def prepare(self, leaves: Sequence[Leaf], targets: Sequence[Any]) -> None:
        """Pick the fast paths this wire's leaves allow (once, when the plan is made)."""
        mine = [leaves[slot.leaf] for slot in self.slots]
        self.leaves = mine
        self.first_pieces = next(
            (i for i, slot in enumerate(self.slots) if slot.pieces > 1), len(self.slots)
        )
        ints = mine[self.first_pieces :]
        if ints and all(leaf.kind == TENSOR and not leaf.shape for leaf in ints):
            self.int_scalars = TENSOR if len({leaf.native for leaf in ints}) == 1 else ""
        elif ints and all(leaf.kind != TENSOR and not leaf.shape for leaf in ints):
            self.int_scalars = PYTHON
        self.targets = [targets[slot.leaf] for slot in self.slots]
        self.estimates = [slot for slot in self.slots if slot.estimate]
        plain = all(s.pieces == 1 and s.weight is None for s in self.slots)
        if not self.slots or self.nan_marker:
            return
        scalar_tensors = all(leaf.kind == TENSOR and not leaf.shape for leaf in mine)
        if plain and scalar_tensors and len({leaf.native for leaf in mine}) == 1:
            self.packing = "stack"
        if all(leaf.kind != TENSOR and not leaf.shape for leaf in mine):
            self.packing = "numbers" if plain else self.packing
            self.unpacking = "numbers"
        elif (
            plain
            and scalar_tensors
            and len({(t, leaf.device) for t, leaf in zip(self.targets, mine, strict=True)}) == 1
            and len({s.mean for s in self.slots}) == 1
        ):
            self.unpacking = "tensors"

    def flag_value(self, raised: bool) -> float:
        """What this rank puts in the flag element: any rank's 1 survives the wire's op."""
        if self.op == "min":
            return -float(raised)
        if self.op == "prod":
            return 1.0 + float(raised)
        return float(raised)

    def flag_raised(self, reduced: float) -> bool:
        """Whether a rank raised the flag (for a flag carried as NaN: see :meth:`flag_unclear`)."""
        if self.flag_in_nan:
            return False
        if self.op == "min":
            return reduced < -0.5
        if self.op == "prod":
            return reduced > 1.5
        return reduced > 0.5

    def flag_unclear(self, reduced: float) -> bool:
        """A flag carried as NaN whose reduced value is NaN: raised, or a NaN in the data.

        A sum or product is NaN on every rank when any rank sent one, in any
        order, so every rank asks the same question (one more collective).
        """
        return self.flag_in_nan and reduced != reduced

    def empty(self, device: torch.device, raised: bool) -> torch.Tensor:
        """A buffer of this wire's length holding only the flag (a rank that cannot pack)."""
        neutral = 1.0 if self.op == "prod" else 0.0
        if self.flag_in_nan and raised:
            neutral = math.nan
        buffer = torch.full((self.length,), neutral, dtype=self.dtype, device=device)
        if self.flag:
            buffer[0] = self.flag_value(raised)
        return buffer

    def pack(
        self, values: Sequence[Any], device: torch.device, hide_nans: bool = True
    ) -> torch.Tensor:
        """This wire's values as one new buffer (never a view of an input).

        In a float max/min wire, NaNs are replaced by the op's identity and
        flagged in the last element; ``hide_nans=False`` leaves them in place.
        """
        if self.packing == "stack":
            mine = [values[slot.leaf] for slot in self.slots]
            if self.flag:
                mine.insert(0, self._flag(mine[0]))
            with torch.no_grad():
                return torch.stack(mine).to(device, self.dtype)
        if self.packing == "numbers":
            numbers = [as_number(values[slot.leaf], self.dtype) for slot in self.slots]
            if self.flag:
                numbers.insert(0, self.flag_value(False))
            return torch.tensor(numbers, dtype=self.dtype, device=device)
        with torch.no_grad():
            return self._pack(values, device, hide_nans)

    def _flag(self, like: torch.Tensor) -> torch.Tensor:
        """A lowered flag as a 0-d tensor of ``like``'s dtype and device (0 or 1: exact in any
        dtype), so that stacking it with the values needs no type promotion (a slow path)."""
        key = (like.dtype, like.device)
        flag = self._flags.get(key)
        if flag is None:
            flag = torch.tensor(self.flag_value(False), dtype=like.dtype, device=like.device)
            self._flags[key] = flag
        return flag

    def _pack(self, values: Sequence[Any], device: torch.device, hide_nans: bool) -> torch.Tensor:
        parts: list[torch.Tensor] = []
        if self.flag:
            parts.append(torch.tensor([self.flag_value(False)], dtype=self.dtype, device=device))
        numbers: list[Any] = []
        for slot in self.slots[: self.first_pieces]:
            value = values[slot.leaf]
            if slot.weight is not None:
                value = times(value, values[slot.weight])
            if isinstance(value, torch.Tensor):
                if numbers:
                    parts.append(torch.tensor(numbers, dtype=self.dtype, device=device))
                    numbers = []
                parts.append(value.detach().reshape(-1).to(device, self.dtype))
            elif isinstance(value, np.ndarray):
                if numbers:
                    parts.append(torch.tensor(numbers, dtype=self.dtype, device=device))
                    numbers = []
                parts.append(from_numpy(value).reshape(-1).to(device, self.dtype))
            else:
                numbers.append(as_number(value, self.dtype))
        if numbers:
            parts.append(torch.tensor(numbers, dtype=self.dtype, device=device))
        if self.first_pieces < len(self.slots):
            parts.append(self._cut(self._ints(values, device)))
        if not self.nan_marker:
            return torch.cat(parts)  # a copy, also of a single part
        payload = torch.cat(parts)
        if not hide_nans:
            return torch.cat([payload, payload.new_zeros(1)])
        start = 1 if self.flag else 0
        body = payload[start:]
        nan = torch.isnan(body)
        body.masked_fill_(nan, -math.inf if self.op == "max" else math.inf)
        marker = nan.any().to(self.dtype).reshape(1)
        return torch.cat([payload, marker if self.op == "max" else -marker])

    def _ints(self, values: Sequence[Any], device: torch.device) -> torch.Tensor:
        """Every integer leaf of this wire that travels in pieces, as one int64 vector."""
        mine = [values[slot.leaf] for slot in self.slots[self.first_pieces :]]
        if self.int_scalars == TENSOR:
            return torch.stack(mine).to(device, torch.int64)
        if self.int_scalars:
            return torch.tensor([as_number(v, torch.int64) for v in mine], device=device)
        return torch.cat([as_int64(value, device) for value in mine])

    def _cut(self, ints: torch.Tensor) -> torch.Tensor:
        """An int64 vector as exact non-negative pieces, ``pieces`` per value.

        Each value ``v`` is cut as ``v + 2**63`` (the sign bit flipped), which
        lies in ``[0, 2**64)``: the pieces summed over ``n`` ranks then give
        the exact sum plus ``n * 2**63``, so a sum beyond int64 is known
        exactly, not only modulo 2**64.
        """
        bits = self.bits_per_piece
        pieces = self.slots[-1].pieces
        shifts = torch.arange(0, bits * pieces, bits, device=ints.device)
        masks = torch.tensor(  # the top piece holds only what is left of the 64 bits
            [(1 << min(bits, 64 - bits * k)) - 1 for k in range(pieces)], device=ints.device
        )
        offset = ints ^ _SIGN_BIT
        return ((offset.unsqueeze(1) >> shifts) & masks).reshape(-1).to(self.dtype)

    def _join(self, reduced: torch.Tensor, world: int) -> torch.Tensor:
        """The int64 sums of every pieces slot, from the reduced pieces (wrapping like int64)."""
        pieces = self.slots[-1].pieces
        start = self.slots[self.first_pieces].start
        exact = reduced[start:].reshape(-1, pieces).to(torch.int64)
        shifts = torch.arange(0, self.bits_per_piece * pieces, self.bits_per_piece)
        total = (exact << shifts.to(exact.device)).sum(dim=1)  # modulo 2**64, like int64
        return total ^ _SIGN_BIT if world % 2 else total  # minus world * 2**63, modulo 2**64

    def nan_seen(self, reduced: torch.Tensor) -> bool:
        if not self.nan_marker:
            return False
        value = float(reduced[-1])
        return value > 0.5 if self.op == "max" else value < -0.5

    def values(
        self, reduced: torch.Tensor, slot: Slot, world: int, joined: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One leaf's reduced values, flat: in the wire dtype, or int64 for pieces."""
        start = slot.start
        if slot.pieces == 1:
            return reduced[start : start + slot.count]
        if joined is None:
            joined = self._join(reduced, world)
        first = (start - self.slots[self.first_pieces].start) // slot.pieces
        return joined[first : first + slot.count]

    def unpack(
        self, reduced: torch.Tensor, results: list[Any], world: int, totals: dict[int, float]
    ) -> None:
        """Put this wire's leaves, reduced and divided, as their own kinds into ``results``."""
        if self.unpacking == "tensors":
            start = int(self.flag)
            body = reduced[start : start + len(self.slots)]
            if self.slots[0].mean and world > 1:
                if not body.is_floating_point():  # a mean of integer tensors is a float
                    body = body.to(torch.float64)
                body = mean_over_(body, world)  # the buffer is ours: in place
            target, leaf = self.targets[0], self.leaves[0]
            if not target.is_floating_point and body.is_floating_point():
                body = body.round()
            values = rounded(body, target).to(leaf.device).unbind(0)
            for slot, value in zip(self.slots, values, strict=True):
                results[slot.leaf] = value
            return
        if self.unpacking == "numbers":
            numbers = reduced.tolist()
            for slot, leaf, target in zip(self.slots, self.leaves, self.targets, strict=True):
                if slot.estimate:
                    continue
                number: Any = numbers[slot.start]
                if slot.pieces > 1:
                    number = self._joined(numbers[slot.start : slot.start + slot.pieces], world)
                if slot.mean:
                    number = divided(number, world if slot.weight is None else totals[slot.weight])
                results[slot.leaf] = scalar(leaf, target, number)
            return
        joined = self._join(reduced, world) if self.first_pieces < len(self.slots) else None
        for slot, leaf, target in zip(self.slots, self.leaves, self.targets, strict=True):
            if slot.estimate:
                continue
            if slot.pieces > 1 and leaf.kind == PYTHON:  # exact, also beyond int64
                pieces = reduced[slot.start : slot.start + slot.pieces].tolist()
                number = self._joined(pieces, world)
                if slot.mean:
                    number = divided(number, world if slot.weight is None else totals[slot.weight])
                results[slot.leaf] = scalar(leaf, target, number)
                continue
            value = self.values(reduced, slot, world, joined)
            if slot.mean:  # the buffer (or the joined pieces) is ours: divide in place
                if not value.is_floating_point():
                    value = value.to(torch.float64)
                if slot.weight is None:
                    value = mean_over_(value, world)
                else:
                    value = value.div_(totals[slot.weight])
            results[slot.leaf] = finish(leaf, target, value)

    def _joined(self, pieces: Sequence[float], world: int) -> int:
        """The exact sum of a value cut into pieces on every rank (see :meth:`_cut`)."""
        offset = sum(round(piece) << (self.bits_per_piece * k) for k, piece in enumerate(pieces))
        return offset - world * 2**63

    def total(self, reduced: torch.Tensor, slot: Slot, world: int) -> float:
        """A weight leaf's reduced value, as a float."""
        if slot.pieces > 1:
            return float(
                self._joined(reduced[slot.start : slot.start + slot.pieces].tolist(), world)
            )
        return float(reduced[slot.start])
