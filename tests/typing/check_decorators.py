"""Checked by `mypy --strict` in CI (not run): decorated functions keep their types.

If a decorator lost the wrapped signature, the `assert_type` lines would fail,
and the `type: ignore[arg-type]` lines would become unused ignores, which
strict mode reports as errors.
"""

from __future__ import annotations

import torch
from typing_extensions import assert_type

from ddpctx import all_reduced, rank_zero_only
from ddpctx.reduce.collectives import Reduction


@rank_zero_only
def log(message: str, *, level: int = 0) -> int:
    return level


@rank_zero_only(default="skipped")
def describe(step: int) -> str:
    return f"step {step}"


@rank_zero_only(broadcast=True)
def run_name(prefix: str) -> str:
    return prefix + "-1"


@rank_zero_only(barrier=True)
def save(path: str) -> None:
    del path


@all_reduced
def loss(scale: float) -> torch.Tensor:
    return torch.tensor(scale)


@all_reduced(op="sum", weight="count")
def evaluate(batch: int) -> dict[str, float]:
    return {"loss": 1.0, "count": float(batch)}


@all_reduced(async_op=True)
def step_loss(value: float) -> float:
    return value


assert_type(log("hi", level=2), int | None)  # other ranks get None
assert_type(describe(3), str)  # str | str: the default is a str too
assert_type(run_name("exp"), str)  # broadcast: every rank gets rank 0's str
assert_type(save("ckpt.pt"), None)
assert_type(loss(0.5), torch.Tensor)
assert_type(evaluate(4), dict[str, float])
assert_type(step_loss(0.5), Reduction[float])  # async_op=True: a handle
assert_type(step_loss(0.5).result(), float)

log(42)  # type: ignore[arg-type]
run_name(prefix=3)  # type: ignore[arg-type]
loss("high")  # type: ignore[arg-type]
evaluate(batch="4")  # type: ignore[arg-type]
