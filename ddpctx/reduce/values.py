"""One leaf's values on their way onto a wire and back: conversions, no layout.

:mod:`ddpctx.reduce.wire` decides where each value goes; these turn a leaf's
value into wire numbers (floats, exact int64) and a reduced number or tensor
back into the leaf's own kind (tensor, NumPy or Python scalar, array).

Example:
    >>> as_number(3, torch.float64), divided(0.0, 0)
    (3.0, nan)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ddpctx.reduce.tree import NUMPY, PYTHON, TENSOR, Leaf

_INT64 = 2**64


def times(value: Any, weight: Any) -> Any:
    """``value * weight`` formed in float64 (floats and ints alike).

    A weight of 0 gives exactly 0, even for a NaN or infinite value: a rank
    that counted no samples contributes nothing to a weighted mean, not the
    NaN that the mean of its empty batch is (``mse_loss`` of empty tensors).

    >>> times(float("nan"), 0), times(2.5, 2)
    (0.0, 5.0)
    """
    factor = float(weight)
    if isinstance(value, torch.Tensor):
        product = value.detach().to(torch.float64)
        return torch.zeros_like(product) if factor == 0 else product * factor
    if isinstance(value, np.ndarray):
        return torch.from_numpy(
            np.zeros(value.shape) if factor == 0 else value.astype(np.float64) * factor
        )
    return 0.0 if factor == 0 else float(value) * factor


def from_numpy(array: np.ndarray[Any, Any]) -> torch.Tensor:
    if array.dtype.kind == "b":
        array = array.astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(array))


def as_int64(value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1).to(device, torch.int64)
    if isinstance(value, np.ndarray):
        return from_numpy(value).reshape(-1).to(device, torch.int64)
    return torch.tensor([as_number(value, torch.int64)], dtype=torch.int64, device=device)


def as_number(value: Any, dtype: torch.dtype) -> Any:
    if dtype.is_floating_point:
        return float(value)
    number = int(value)
    if not -(2**63) <= number < 2**63:
        raise OverflowError(
            f"{number} does not fit in int64, which integers travel as. Reduce it as a "
            "float (float(x)) or split it."
        )
    return number


def mean_over_(values: torch.Tensor, world: int) -> torch.Tensor:
    """``values.div_(world)``, in place, by multiplying where that gives the same bits.

    Over a power-of-two number of ranks, ``1 / world`` is exact, so ``x * (1 /
    world)`` and ``x / world`` are the same correctly rounded number in every
    floating dtype (checked bit for bit on random bit patterns, subnormals and
    NaNs among them) -- and a multiplication took 45 us against 110 us for 1M
    float32 values here. Any other world size divides.

    >>> mean_over_(torch.tensor([3.0, 5.0]), 2), mean_over_(torch.tensor([3.0, 6.0]), 3)
    (tensor([1.5000, 2.5000]), tensor([1., 2.]))
    """
    if world & (world - 1) == 0 and values.is_floating_point():
        return values.mul_(1.0 / world)
    return values.div_(world)


#: The dtypes torch converts float64 into through float32 (rounding twice).
HALVES = (torch.float16, torch.bfloat16)


def rounded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` in ``dtype``, rounded once (float64 to float16/bfloat16 not via float32).

    torch converts float64 to float16 and bfloat16 through float32, rounding
    twice: a float64 sum of three ranks' float16 values just past a tie of
    float16 can land on the tie in float32 and then round the wrong way (1 ulp).
    Rounding to float32 *to odd* (toward zero, then the last bit set when
    inexact) keeps that information, so the one rounding to nearest that
    follows is the correct rounding of the float64 value.

    >>> x = torch.tensor([1 + 2**-10 + 2**-11 - 2**-24], dtype=torch.float64)
    >>> x.to(torch.float16).item(), rounded(x, torch.float16).item()
    (1.001953125, 1.0009765625)
    """
    if values.dtype is dtype:  # torch's dtypes are singletons; .to() of nothing costs 3 us
        return values
    if dtype not in HALVES or values.dtype != torch.float64:
        return values.to(dtype)
    near = values.to(torch.float32)
    wide = near.to(torch.float64)
    toward_zero = torch.where(
        wide.abs() > values.abs(), torch.nextafter(near, torch.zeros_like(near)), near
    )
    odd = (toward_zero.view(torch.int32) | 1).view(torch.float32)
    return torch.where(wide != values, odd, near).to(dtype)  # NaN stays NaN either way


def finish(leaf: Leaf, target: Any, value: torch.Tensor) -> Any:
    """A reduced flat tensor as the leaf's own kind: tensor, array, NumPy or Python number."""
    if leaf.kind == TENSOR:
        shaped = value.reshape(leaf.shape)
        if not target.is_floating_point and shaped.is_floating_point():
            shaped = shaped.round()
        return rounded(shaped, target).to(leaf.device)
    host = value.cpu()
    if leaf.kind == NUMPY:
        array = host.numpy().reshape(leaf.shape)
        if target.kind in "biu" and array.dtype.kind == "f":
            array = np.rint(array) if np.isfinite(array).all() else array
        cast = array.astype(target) if target.kind != "b" else array != 0
        return cast[()] if not leaf.shape else cast
    number = host.item()
    if target is float:
        return float(number)
    if target is bool:
        return bool(number)
    return int(number)


def scalar(leaf: Leaf, target: Any, number: Any) -> Any:
    """A reduced Python number as a Python or NumPy scalar of the leaf's result type."""
    if leaf.kind == PYTHON:
        if target is float:
            return float(number)
        if target is bool:
            return bool(number)
        return int(number)
    kind = target.kind
    if kind == "b":
        return np.bool_(number != 0)
    if kind in "iu":  # wrapped as NumPy's arithmetic in that dtype wraps
        wrapped = (int(number) + 2**63) % _INT64 - 2**63
        return np.array(wrapped, dtype=np.int64).astype(target)[()]
    return target.type(number)


def divided(number: float, divisor: float) -> float:
    """``number / divisor`` as a float division in torch would give it: 0/0 is NaN."""
    if divisor:
        return number / divisor
    return math.nan if number == 0 or math.isnan(number) else math.copysign(math.inf, number)
