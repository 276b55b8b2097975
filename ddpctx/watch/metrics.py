"""What ``ctx.log`` accepts, and the flat values its loggers get.

- :func:`check_scalars` runs on the calling rank before any collective: a
  value that is not one number, a metric named ``step``, and two keys that
  flatten to one name (``{"a/b": 1, "a": {"b": 2}}``) are refused there,
  naming them.
- :func:`flat_metrics` runs on rank 0's writer thread: ``{"a": {"b": x}}``
  becomes ``{"a/b": x}``; integers stay exact Python ints (a count above
  2**53 is not rounded), everything else becomes a float.
- :func:`json_number` is how ``metrics.jsonl`` spells a value: NaN and
  +/-Infinity are not JSON numbers, so they are written as ``null``.
- :func:`step_number` accepts any integer a step may arrive as (``int``,
  NumPy and torch integer scalars), never a bool or a float.

Example:
    >>> flat_metrics({"loss": 0.25, "val": {"acc": 1}, "tokens": 2**53 + 1})
    {'loss': 0.25, 'val/acc': 1, 'tokens': 9007199254740993}
    >>> json_number(float("nan")) is None
    True
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np


def check_scalars(values: Mapping[str, Any]) -> None:
    """Refuse, on the calling rank and before any collective, what the trail cannot write.

    Looks at shapes and names only (no device sync).

    >>> check_scalars({"loss": [0.1, 0.2]})
    Traceback (most recent call last):
    ...
    ValueError: ctx.log: 'loss' is list [0.1, 0.2], not one number. Log a scalar ...
    >>> check_scalars({"a/b": 1.0, "a": {"b": 2.0}})
    Traceback (most recent call last):
    ...
    ValueError: ctx.log: the keys 'a/b' and 'a' -> 'b' both name the metric 'a/b' ...
    """
    if not isinstance(values, Mapping):
        raise ValueError(
            f"ctx.log got {type(values).__name__} {short(values)}; it takes a dict of "
            "metrics, e.g. ctx.log({'loss': loss})."
        )
    if "step" in values:
        raise ValueError(
            "ctx.log got a metric named 'step', which is the trail's own column. Pass the step "
            "as ctx.log(metrics, step=...), or name the metric otherwise (e.g. 'global_step')."
        )
    if not any(isinstance(value, Mapping) for value in values.values()):
        for key, value in values.items():  # flat: no two keys can name one metric
            if key == "":
                _unnamed(("",))
            if not _one_number(value):
                _refuse(str(key), value)
        return
    seen: dict[str, tuple[Any, ...]] = {}
    for keys, value in _leaves(values, ()):
        if "" in keys:
            _unnamed(keys)
        name = "/".join(map(str, keys))
        if not _one_number(value):
            _refuse(name, value)
        if name in seen:
            raise ValueError(
                f"ctx.log: the keys {_path(seen[name])} and {_path(keys)} both name the metric "
                f"{name!r} (nested dicts become 'outer/inner' names), so the files could keep "
                "only one of them. Rename one of the two keys."
            )
        seen[name] = keys


def _one_number(value: Any) -> bool:
    return type(value) is float or (
        isinstance(value, (bool, int, float, np.number))
        or (hasattr(value, "shape") and math.prod(getattr(value, "shape", ())) == 1)
    )


def _unnamed(keys: tuple[Any, ...]) -> None:
    raise ValueError(
        f"ctx.log: the metric at {_path(keys)} has an empty name, which no logger can show "
        "(metrics.csv would get a column without a header). Give it a name."
    )


def _refuse(name: str, value: Any) -> None:
    raise ValueError(
        f"ctx.log: {name!r} is {type(value).__name__} {short(value)}, not one number. "
        "Log a scalar (e.g. tensor.mean()), or a dict of scalars."
    )


def flat_metrics(values: Mapping[str, Any]) -> dict[str, float]:
    """``{"a": {"b": x}}`` -> ``{"a/b": x}``: ints stay exact ints, the rest become floats.

    (Typed ``float`` as the :class:`~ddpctx.watch.loggers.Logger` protocol says: an
    ``int`` is a ``float`` to a type checker.)
    """
    flat: dict[str, float] = {}
    for keys, value in _leaves(values, ()):
        name = "/".join(map(str, keys))
        try:
            flat[name] = _number(value)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"ctx.log: {name!r} is {type(value).__name__} {short(value)}, not one number "
                f"({error}). Log a scalar (e.g. tensor.mean()), or a dict of scalars."
            ) from None
    return flat


def json_number(value: float) -> float | None:
    """``value`` as ``metrics.jsonl`` writes it: NaN and +/-Infinity (no JSON numbers) as None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def step_number(step: object) -> int:
    """``step`` as an int (NumPy and torch integer scalars too); a bool or a float is refused."""
    if isinstance(step, (bool, np.bool_, float, np.floating)):
        raise TypeError(f"a {type(step).__name__}")
    return operator.index(step)  # type: ignore[arg-type]


def short(value: Any) -> str:
    """A short description of ``value`` for an error message."""
    shape = getattr(value, "shape", None)
    return f"of shape {tuple(shape)}" if shape is not None else repr(value)[:60]


def _leaves(
    values: Mapping[Any, Any], keys: tuple[Any, ...]
) -> Iterator[tuple[tuple[Any, ...], Any]]:
    for key, value in values.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, (*keys, key))
        else:
            yield (*keys, key), value


def _path(keys: tuple[Any, ...]) -> str:
    return " -> ".join(repr(key) for key in keys)


def _number(value: Any) -> float:
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    dtype = getattr(value, "dtype", None)
    if dtype is not None and _is_integer_dtype(dtype):
        item = value.item() if hasattr(value, "item") else value
        return int(item)
    return float(value)


def _is_integer_dtype(dtype: Any) -> bool:
    is_floating = getattr(dtype, "is_floating_point", None)  # a torch dtype
    if is_floating is not None:
        return not is_floating and not dtype.is_complex and str(dtype) != "torch.bool"
    try:
        return bool(np.issubdtype(dtype, np.integer))
    except TypeError:
        return False
