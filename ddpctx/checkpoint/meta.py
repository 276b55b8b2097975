"""Checkpoint meta that round-trips through ``torch.load(weights_only=True)``, or is refused.

``weights_only=True`` loads tensors and plain Python values only. A NumPy
scalar (``np.mean(...)`` returns one), a ``pathlib.Path`` or an
``argparse.Namespace`` pickles fine but is refused at load time -- so a
checkpoint holding one would be written every epoch and never load. Meta is
therefore converted, explicitly, when it is saved:

====================================  ==========================================
saved                                 comes back as
====================================  ==========================================
NumPy scalar (``np.float64(0.5)``)    the Python number (``0.5``)
NumPy array                           a ``torch.Tensor`` (same dtype and shape)
``pathlib.Path`` (any ``PurePath``)   ``str``
``argparse.Namespace``                ``dict`` of its attributes (converted too)
tuple, list, dict (str/int keys)      the same, with items converted
None, bool, int, float, str, bytes,   themselves
complex, ``torch.Tensor``
====================================  ==========================================

Anything else is refused before anything is written, with a ``TypeError``
naming the key path, the type and the fix; meta nested deeper than a loaded
checkpoint may be (``shape.MAX_DEPTH``) with a ``ValueError``.

Example:
    >>> import numpy as np, pathlib
    >>> plain_meta({"loss": np.float64(0.5), "out": pathlib.Path("runs/a")})
    {'loss': 0.5, 'out': 'runs/a'}
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import numpy as np
import torch

from ddpctx.checkpoint.shape import MAX_DEPTH

_PLAIN = (type(None), bool, int, float, str, bytes, complex)


def plain_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` converted to values ``weights_only`` loads; a ``TypeError`` for the rest."""
    return {key: _plain(value, key) for key, value in meta.items()}


def _plain(value: Any, where: str, depth: int = 3) -> Any:
    if depth > MAX_DEPTH and isinstance(value, (dict, list, tuple, argparse.Namespace)):
        # a checkpoint holds its meta 2 deep; containers deeper are refused at load
        raise ValueError(
            f"checkpoint meta {where[:80]}... nests more than {MAX_DEPTH - 2} levels deep, and "
            f"a checkpoint whose values nest more than {MAX_DEPTH} deep is refused at load. "
            "Store it flatter (e.g. as a JSON string)."
        )
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, _PLAIN):
        return value if type(value) in _PLAIN else _PLAIN_BASE[_base(value)](value)
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return _refuse(value, where)
        return torch.from_numpy(np.ascontiguousarray(value).copy())
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, argparse.Namespace):
        return {key: _plain(item, f"{where}.{key}", depth + 1) for key, item in vars(value).items()}
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                return _refuse(key, f"{where} key {key!r}")
            out[key if type(key) in (str, int) else _PLAIN_BASE[_base(key)](key)] = _plain(
                item, f"{where}[{key!r}]", depth + 1
            )
        return out
    if isinstance(value, (list, tuple)):
        items = [_plain(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return _refuse(value, where)


_PLAIN_BASE: dict[type, type] = {t: t for t in _PLAIN}


def _base(value: Any) -> type:
    """The plain type a subclass (an ``IntEnum``, a ``str`` subclass) is stored as."""
    for kind in (bool, int, float, complex, str, bytes):
        if isinstance(value, kind):
            return kind
    return type(None)


def _refuse(value: Any, where: str) -> Any:
    kind = type(value)
    raise TypeError(
        f"checkpoint meta {where} is a {kind.__module__}.{kind.__qualname__} ({value!r:.80}), "
        "which torch.load(weights_only=True) would refuse, so the checkpoint could never be "
        "resumed. Store plain values instead: numbers, strings, lists, dicts, tensors (e.g. "
        "str(...) or float(...) of it); NumPy values, paths and argparse.Namespace are "
        "converted for you."
    )
