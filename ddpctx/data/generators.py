"""Private random generators in a dataset or collate function: found and named, not handled.

A dataset that keeps its own ``random.Random``, ``np.random.Generator``,
``np.random.RandomState`` or ``torch.Generator`` (Kronos' ``QlibDataset``
draws its windows from ``self.py_rng``) breaks two promises that ddpctx keeps
for the *global* generators:

- **exact resume**: a checkpoint saves every rank's global generators, and a
  resumed epoch reads its remaining batches with the state they had; a
  private generator restarts from wherever the user's code last seeded it,
  so the resumed epoch draws the epoch's *first* numbers again;
- **distinct workers**: every DataLoader worker starts from a copy of the
  dataset, so with ``num_workers > 0`` every worker draws the same numbers
  (each batch's samples repeat across workers).

Why ddpctx names them instead of handling them. Handling would mean
re-seeding the user's generator behind their back, per batch, in the main
process and in every worker. That silently overrides the user's own seeding
(``set_epoch_seed``), and it is wrong for the generators that are meant to
stay fixed (a held-out split drawn once, a ``torch.Generator`` passed to
``random_split``) -- and ddpctx cannot tell the two kinds apart. The fix on
the user's side is one line and makes both promises hold: draw from the
global generators (``random.randint`` for ``self.py_rng.randint``,
``np.random.…``, ``torch.…`` without ``generator=``), which ddpctx seeds per
rank, worker and batch and saves in every checkpoint. So :func:`warn_private_generators`
warns once, on rank 0, when the loader is made (before the first
checkpoint), naming the attribute path and that fix. A generator that is
meant to stay fixed can be silenced with
``warnings.filterwarnings("ignore", category=PrivateGeneratorWarning)``.

The search follows attributes, list/tuple/dict items, ``Subset.dataset``,
``ConcatDataset.datasets``, ``functools.partial`` arguments, bound methods'
``__self__``, and what a function or lambda closes over or takes as a
default (not its globals), a few levels deep; it never calls user code.

Example:
    >>> import random
    >>> class Windows:
    ...     def __init__(self):
    ...         self.py_rng = random.Random(0)
    >>> private_generators(Windows(), "dataset")
    [('dataset.py_rng', 'random.Random')]
"""

from __future__ import annotations

import contextlib
import functools
import random
import types

import numpy as np
import torch

from ddpctx.utils.warn import warn_user

#: How deep the search follows attributes and items, and how many objects it visits at most.
MAX_DEPTH = 6
MAX_VISITS = 5000
_MAX_ITEMS = 64  # of one list, tuple or dict

_GENERATORS: tuple[tuple[type, str, str], ...] = (
    (random.Random, "random.Random", "random.randint(...) instead of self.rng.randint(...)"),
    (
        np.random.Generator,
        "numpy.random.Generator",
        "np.random.randint(...) / np.random.random(...) instead of self.rng.integers(...)",
    ),
    (
        np.random.RandomState,
        "numpy.random.RandomState",
        "np.random.randint(...) instead of self.rng.randint(...)",
    ),
    (
        torch.Generator,
        "torch.Generator",
        "torch.randint(...) / torch.rand(...) without generator=self.rng",
    ),
)

_LEAVES = (str, bytes, int, float, complex, bool, type(None), torch.Tensor, np.ndarray)
_SKIPPED = (types.ModuleType, type, types.BuiltinFunctionType)


class PrivateGeneratorWarning(UserWarning):
    """A dataset or collate function holds a random generator ddpctx can neither save nor seed."""


def _kind(item: object) -> str | None:
    if isinstance(item, random.Random) and item is not getattr(random, "_inst", None):
        return "random.Random"
    for kind, label, _ in _GENERATORS[1:]:
        if isinstance(item, kind):
            return label
    return None


def _children(item: object) -> list[tuple[str, object]]:
    """(path suffix, child) pairs worth searching under ``item``."""
    if isinstance(item, (list, tuple)):
        return [(f"[{index}]", child) for index, child in enumerate(item[:_MAX_ITEMS])]
    if isinstance(item, dict):
        pairs = list(item.items())[:_MAX_ITEMS]
        return [(f"[{key!r}]", child) for key, child in pairs]
    if isinstance(item, functools.partial):
        found = [(".func", item.func)]
        found += [(f".args[{index}]", child) for index, child in enumerate(item.args)]
        return found + [(f".keywords[{key!r}]", child) for key, child in item.keywords.items()]
    if isinstance(item, types.MethodType):
        return [(".__self__", item.__self__)]
    if isinstance(item, types.FunctionType):  # what a lambda or nested function closes over
        found = []
        for variable, cell in zip(item.__code__.co_freevars, item.__closure__ or (), strict=False):
            with contextlib.suppress(ValueError):  # a cell not filled yet
                found.append((f".<closure {variable}>", cell.cell_contents))
        defaults = item.__defaults__ or ()
        return found + [(f".__defaults__[{index}]", child) for index, child in enumerate(defaults)]
    attributes = getattr(item, "__dict__", None)
    if isinstance(attributes, dict):
        return [(f".{name}", child) for name, child in list(attributes.items())[:_MAX_ITEMS]]
    return []


def private_generators(root: object, name: str) -> list[tuple[str, str]]:
    """Every private generator under ``root`` as ``(attribute path, generator type)``."""
    found: list[tuple[str, str]] = []
    seen: set[int] = set()
    frontier: list[tuple[str, object, int]] = [(name, root, 0)]
    while frontier and len(seen) < MAX_VISITS:
        path, item, depth = frontier.pop(0)  # breadth first: the shortest path is named
        if id(item) in seen or isinstance(item, (*_LEAVES, *_SKIPPED)):
            continue
        seen.add(id(item))
        kind = _kind(item)
        if kind is not None:
            found.append((path, kind))
            continue
        if depth < MAX_DEPTH:
            frontier += [(path + suffix, child, depth + 1) for suffix, child in _children(item)]
    return found


def warn_private_generators(dataset: object, collate_fn: object) -> None:
    """Warn (once per attribute path) about each private generator, naming the fix."""
    found = private_generators(dataset, "dataset")
    if collate_fn is not None:
        found += private_generators(collate_fn, "collate_fn")
    for path, kind in found:
        fix = next(example for _, label, example in _GENERATORS if label == kind)
        warn_user(
            f"ctx.dataloader: {path} is a private {kind}. ddpctx cannot seed it per worker, "
            "so with num_workers > 0 every worker starts from a copy of it and draws the same "
            "numbers, and it is in no checkpoint unless you pass it to save_checkpoint and "
            f"load_checkpoint as rank_state={{'rng': {path}}} (then reseed it only in an epoch "
            "that starts from its first batch, `if loader.start == 0: "
            "dataset.set_epoch_seed(epoch)`: a reseed after load_checkpoint undoes the "
            "restore); otherwise a resumed epoch redraws the numbers it already drew (the run "
            "does not continue exactly). Fix: "
            f"draw from the global generator instead, e.g. {fix}; ddpctx seeds those per rank, "
            "worker and batch and saves them in every checkpoint. Then delete the unused "
            "generator (this warning looks for it, not for its use). If it is meant to stay "
            "fixed, or you save it through rank_state= with num_workers=0, silence this with "
            "warnings.filterwarnings('ignore', "
            "category=ddpctx.data.generators.PrivateGeneratorWarning).",
            PrivateGeneratorWarning,
        )
