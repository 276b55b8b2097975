"""Turning a metric result into float64 buffers, and reduced buffers back into the result.

For each structure a call site sees, a :class:`Plan` is made once: every leaf's
op (from ``op=``), its weight leaf (``weight=``), the canonical description and
fingerprints that the protocol in :mod:`ddpctx.collectives` compares across
ranks, and one :class:`Group` per buffer ("mean"/"sum" together, then one each
for "max", "min", "prod") that knows how to pack its leaves into one float64
vector and unpack a reduced vector into leaves of the original kinds (an int
under "mean" becomes a float; a tensor stays a tensor on its device). Later
calls with the same structure reuse the plan, so the per-call work is the
pack, the collective and the unpack.

Split out of :mod:`ddpctx.collectives`, which owns the communication.

Example:
    >>> plan, values = Plan.make({"loss": 1.5, "count": 2}, "mean", "count", "doc")
    >>> [leaf.path for leaf in plan.leaves], plan.ops
    (["['loss']", "['count']"], ['mean', 'sum'])
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ddpctx.tree import NUMPY, PYTHON, TENSOR, Leaf, describe, flatten

#: The reductions: "mean" and "sum" share the summed buffer; the others use torch's ops.
OPS = ("mean", "sum", "max", "min", "prod")
_FINGERPRINT_RANGE = 2**20 - 1  # keeps h*h summed over ranks exact in float64

#: The ops that get a buffer (and a collective) of their own, when used.
SEPARATE_OPS = ("max", "min", "prod")

OpSpec = str | Mapping[str, str]


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
class Group:
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
    def of(cls, indices: list[int], leaves: Sequence[Leaf], ops: Sequence[str]) -> Group:
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
class Plan:
    """Everything about reducing one structure that does not depend on its values."""

    leaves: list[Leaf]
    rebuild: Callable[[Sequence[Any]], Any]
    ops: list[str]
    weights: list[int | None]
    summed: Group  # mean and sum leaves (and weights): the one buffer with the header
    others: dict[str, Group]  # "max" / "min" / "prod": one buffer each, only when used
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
    def make(cls, obj: Any, op: OpSpec, weight: str | None, site: str) -> tuple[Plan, list[Any]]:
        leaves, values, rebuild = flatten(obj)
        ops = _leaf_ops(leaves, op, weight)
        weights: list[int | None] = [None] * len(leaves)
        if weight is not None:
            weights = _weights(leaves, ops, weight)
        lines = describe(leaves, ops)
        others = {
            name: Group.of([i for i, o in enumerate(ops) if o == name], leaves, ops)
            for name in SEPARATE_OPS
            if name in ops
        }
        plan = cls(
            leaves,
            rebuild,
            ops,
            weights,
            Group.of([i for i, o in enumerate(ops) if o in ("mean", "sum")], leaves, ops),
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


def plan_key(structure: Any, op: OpSpec, weight: str | None) -> Any:
    ops = tuple(sorted(op.items())) if isinstance(op, Mapping) else op
    return (structure, ops, weight)


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
