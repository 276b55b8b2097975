"""Nested metric results as flat lists of leaves, and back.

A metric result is a number, a tensor, a NumPy scalar or array, or a dict /
list / tuple / namedtuple nesting them. :func:`flatten` walks it once and
returns the leaves in a fixed order with their key paths, plus a ``rebuild``
that puts new leaf values back into the same structure. Anything else -- a
string, None, an object -- is a ``TypeError`` naming its key path.

:func:`describe` gives a canonical, process-independent description of the
structure (paths, kinds, dtypes, shapes, but not devices: ranks hold their
tensors on different GPUs), used to check that every rank sent the same thing.

Example:
    >>> leaves, rebuild = flatten({"loss": 0.5, "acc": [1, 2]})
    >>> [leaf.path for leaf in leaves]
    ["['loss']", "['acc'][0]", "['acc'][1]"]
    >>> rebuild([1.0, 3, 4])
    {'loss': 1.0, 'acc': [3, 4]}
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: Kinds of leaf: how a value is packed, and what it comes back as.
PYTHON, NUMPY, TENSOR = "python", "numpy", "tensor"


@dataclass(frozen=True)
class Leaf:
    """One numeric value in a result, and where it sits."""

    path: str  # e.g. "['val']['loss']" -- for messages
    keys: tuple[Hashable, ...]  # dict keys on the way down, innermost last
    parents: tuple[int, ...]  # ids of the enclosing dicts, innermost last
    value: Any
    kind: str
    dtype: str  # "int" / "float" / "bool" for Python numbers, else the dtype
    shape: tuple[int, ...]


def _leaf_kind(value: Any) -> tuple[str, str, tuple[int, ...]] | None:
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            return None
        return TENSOR, str(value.dtype), tuple(value.shape)
    if isinstance(value, bool):
        return PYTHON, "bool", ()
    if isinstance(value, int):
        return PYTHON, "int", ()
    if isinstance(value, float):
        return PYTHON, "float", ()
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype.kind not in "biuf":  # bool, int, unsigned, float
            return None
        return NUMPY, str(value.dtype), tuple(np.shape(value))
    return None


def flatten(obj: Any) -> tuple[list[Leaf], Callable[[Sequence[Any]], Any]]:
    """Leaves of ``obj`` in a fixed order, and a function rebuilding ``obj`` from new leaves."""
    leaves: list[Leaf] = []

    def walk(node: Any, path: str, keys: tuple[Hashable, ...], parents: tuple[int, ...]) -> Any:
        """Record the leaves; return a template: an index into leaves, or a container."""
        if isinstance(node, dict):
            inner = (*parents, id(node))
            return (
                type(node),
                [(k, walk(v, f"{path}[{k!r}]", (*keys, k), inner)) for k, v in node.items()],
            )
        if isinstance(node, (list, tuple)):
            children = [walk(v, f"{path}[{i}]", keys, parents) for i, v in enumerate(node)]
            return (type(node), children)
        kind = _leaf_kind(node)
        if kind is None:
            where = path or "the result"
            raise TypeError(
                f"{where} is {type(node).__name__} {_short(node)}, not a number, tensor or "
                "NumPy array; only numeric leaves can be reduced. Return it separately, "
                "or convert it (e.g. float(x))."
            )
        leaves.append(Leaf(path or "<result>", keys, parents, node, *kind))
        return len(leaves) - 1

    template = walk(obj, "", (), ())

    def rebuild(values: Sequence[Any]) -> Any:
        def build(node: Any) -> Any:
            if isinstance(node, int):
                return values[node]
            container, children = node
            if issubclass(container, dict):
                items = [(key, build(child)) for key, child in children]
                try:
                    return container(items)
                except TypeError:  # e.g. defaultdict: no plain constructor
                    return dict(items)
            built = [build(child) for child in children]
            if issubclass(container, tuple) and hasattr(container, "_fields"):
                return container(*built)
            return container(built)

        return build(template)

    return leaves, rebuild


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def describe(leaves: Sequence[Leaf], ops: Sequence[str]) -> list[str]:
    """One line per leaf, the same on every rank for the same structure."""
    return [
        f"{leaf.path} {leaf.kind}:{leaf.dtype}{list(leaf.shape)} {op}"
        for leaf, op in zip(leaves, ops, strict=True)
    ]
