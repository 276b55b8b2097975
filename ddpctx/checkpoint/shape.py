"""What an unpickled checkpoint value expands to, weighed before anything walks it.

A pickle's memo lets a small file build a value far larger than itself once
walked: 22 levels of lists, each holding the one below twice, are 18 KB on
disk and 2^22 paths to every reader that copies, compares or serialises it
(an export's JSON: 2 GB, then a crash); and a list nested 300,000 deep (600 KB)
unpickles fine, then ends any recursive walk in a bare ``RecursionError``.
Neither is caught while the opcodes are weighed (:mod:`ddpctx.checkpoint.claims`):
the first allocates little, the second nothing at all.

So every value a reader unpickles from a checkpoint file -- a ``.pt``, a
sharded checkpoint's ``ddpctx.pt``, a shard entry, DCP's ``.metadata`` -- goes
through :func:`check_loaded` before anything else touches it. It walks the value
once, iteratively (no recursion), each container once (memoised by ``id``), and
computes each container's expanded size and depth without expanding it: the
numbers grow, memory does not. It refuses
(:class:`~ddpctx.checkpoint.sums.RefusedCheckpoint`, naming the file) when

- containers nest more than :data:`MAX_DEPTH` deep (a ddpctx checkpoint with an
  optimizer, scheduler and scaler nests 5 deep; a user's meta adds its own);
- the value holds itself (a cycle: no reader could copy or export it);
- it expands to more than ``claims.MULTIPLE`` times the file's size
  (``claims.FLOOR`` at least): each value counts one, a string or bytes its
  length, a tensor its elements times their size, counted at every place it is
  referenced from (tied weights twice, as the claims count them).

The cost is one visit per container: about a millisecond for a 50-layer model
with AdamW state.

Example:
    >>> check_loaded({"meta": {"epoch": 3}, "w": [1.0, 2.0]}, 100, Path("a.pt"))
    >>> deep: list[object] = []
    >>> for _ in range(200):
    ...     deep = [deep]
    >>> try:
    ...     check_loaded(deep, 100, Path("a.pt"))
    ... except RefusedCheckpoint as error:
    ...     print(str(error)[:62])
    'a.pt' was refused: it holds a value nested more than 100 deep
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ddpctx.checkpoint.claims import FLOOR, MULTIPLE, refusal
from ddpctx.checkpoint.sums import RefusedCheckpoint

__all__ = ["MAX_DEPTH", "RefusedCheckpoint", "check_loaded"]

#: How deep containers may nest in a checkpoint's value (ddpctx's own nest 5 deep).
MAX_DEPTH = 100


def _children(value: Any) -> Iterable[Any] | None:
    """The values ``value`` holds, or None when it is a leaf."""
    if isinstance(value, (str, bytes, bytearray, int, float, complex, torch.Tensor)):
        return None
    if isinstance(value, dict):
        return itertools.chain(value.keys(), value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, field.name, None) for field in dataclasses.fields(value)]
    return None


def _weight(value: Any) -> int:
    """What a leaf counts for when it is expanded."""
    if isinstance(value, (str, bytes, bytearray)):
        return 1 + len(value)
    if isinstance(value, torch.Tensor) and value.layout == torch.strided:
        return 1 + value.numel() * value.element_size()
    return 1


def _too_deep(path: Path) -> RefusedCheckpoint:
    return refusal(
        path,
        f"a value nested more than {MAX_DEPTH} deep (containers inside containers; ddpctx's "
        f"own state nests 5 deep: keep a checkpoint's meta under {MAX_DEPTH} levels)",
    )


def check_loaded(value: Any, size: int, path: Path, expanded: bool = True) -> None:
    """Refuse (:func:`~ddpctx.checkpoint.claims.refusal`) a value unpickled from ``path``
    (``size`` bytes) that nests too deep, holds itself, or expands past the budget.

    ``expanded``: weigh its expanded size too (False for DCP's ``.metadata``, which no
    reader expands: its claims are weighed by ``check_metadata_claims``).
    """
    budget = max(FLOOR, MULTIPLE * size)
    done: dict[int, tuple[int, int]] = {}  # id -> (expanded size, height)
    open_: set[int] = set()  # the containers on the current path (a cycle meets one)
    # (a container, its depth, and once opened: what its leaves weigh and its container kids)
    stack: list[tuple[Any, int, int, list[Any] | None]] = [(value, 1, 0, None)]
    if _children(value) is None:
        return
    while stack:
        node, depth, leaves, kids = stack.pop()
        key = id(node)
        if kids is not None:  # all of its kids are done: weigh it
            open_.discard(key)
            total, height = 1 + leaves, 0
            for kid in kids:
                grown, tall = done[id(kid)]
                total += grown
                if tall > height:
                    height = tall
            done[key] = (total, height + 1)
            if expanded and total > budget:
                raise refusal(
                    path,
                    f"a value that expands to {total} bytes and items when its shared parts are "
                    f"counted at each place they are referenced from (as any copy or export "
                    f"makes them), more than {MULTIPLE}x the file's size allows ({budget})",
                )
            continue
        if key in done:
            if depth - 1 + done[key][1] > MAX_DEPTH:
                raise _too_deep(path)
            continue
        if key in open_:
            raise refusal(path, "a value that holds itself (a cycle: it cannot be copied)")
        if depth > MAX_DEPTH:
            raise _too_deep(path)
        open_.add(key)
        leaves, kids = _split(_children(node) or ())
        stack.append((node, depth, leaves, kids))
        stack.extend((kid, depth + 1, 0, None) for kid in kids)


#: Leaves of one item each, by exact type (the common case, told apart without ``isinstance``).
_ONE = {int, float, bool, complex, type(None)}
_SIZED = {str, bytes, bytearray}
_HOLDERS = {dict, list, tuple, set, frozenset}


def _split(children: Iterable[Any]) -> tuple[int, list[Any]]:
    """What the leaves among ``children`` weigh, and the containers among them (in order)."""
    leaves = 0
    kids = []
    for kid in children:
        kind = type(kid)
        if kind in _ONE:
            leaves += 1
        elif kind in _SIZED:
            leaves += 1 + len(kid)
        elif kind in _HOLDERS or _children(kid) is not None:
            kids.append(kid)
        else:
            leaves += _weight(kid)
    return leaves, kids
