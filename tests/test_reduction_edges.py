"""Edges of the reduction engine found by outside use, each pinned on real ranks.

Integer counts under "mean", Python-int totals beyond int64, float32 sums
next to torch's own ``all_reduce``, and a result that cannot even be prepared
on one rank (it contains itself): an error on every rank, never a desync.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ddpctx import DistContext, ReductionError, all_reduced
from tests.helpers import patience

FAST = 5.0  # seconds within which a failure must reach every rank


# 1. A mean of integer counts ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
@pytest.mark.distributed(world_size=[1, 2, 3], timeout=60)
def test_a_mean_of_integer_scalar_tensors_is_a_float_at_every_world_size(
    dist_ctx: DistContext, dtype: torch.dtype
) -> None:
    n, rank = dist_ctx.world_size, dist_ctx.rank
    predictions = torch.tensor([1, 0, 1, 1]) == torch.tensor([1, rank % 2, 0, 1])

    @all_reduced
    def accuracy() -> dict[str, torch.Tensor]:
        correct = predictions.sum().to(dtype)
        return {"correct": correct, "total": torch.tensor(4).to(dtype)}

    result = accuracy()
    correct = [
        int((torch.tensor([1, 0, 1, 1]) == torch.tensor([1, r % 2, 0, 1])).sum()) for r in range(n)
    ]
    if dtype == torch.bool:
        correct = [1 if c else 0 for c in correct]
        totals = 1.0
    else:
        totals = 4.0
    assert result["correct"].dtype == torch.get_default_dtype()
    assert result["correct"].shape == ()
    assert result["correct"].item() == pytest.approx(sum(correct) / n, rel=1e-6)
    assert result["total"].item() == totals
    weighted = dist_ctx.all_reduce(
        {"correct": predictions.sum().to(dtype), "count": torch.tensor(4)}, weight="count"
    )
    assert weighted["correct"].dtype == torch.get_default_dtype()
    assert weighted["correct"].item() == pytest.approx(sum(correct) / n, rel=1e-6)


@pytest.mark.parametrize("default", [torch.float32, torch.float64])
@pytest.mark.distributed(world_size=[2, 3], timeout=60)
def test_a_mean_of_large_int64_tensors_is_the_exact_mean_rounded_once_to_the_default_dtype(
    dist_ctx: DistContext, default: torch.dtype
) -> None:
    # Raised by the outside attack: 2**40 + 1 + rank came back as float32, 1.5 off the exact
    # mean, while the same value as an array or an int came back exact. As documented
    # (README: as torch's `tensor / n`), an integer tensor's mean takes torch's default
    # dtype; what this pins is that it is the exact mean rounded once, never rounded twice.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        n, rank = dist_ctx.world_size, dist_ctx.rank
        mean = dist_ctx.all_reduce({"count": torch.tensor(2**40 + 1 + rank)})["count"]
    finally:
        torch.set_default_dtype(previous)
    exact = sum(2**40 + 1 + r for r in range(n)) / n  # exact in float64 here
    assert mean.dtype == default
    assert mean.item() == torch.tensor(exact, dtype=torch.float64).to(default).item()


# 2. Python ints beyond int64 ----------------------------------------------------------------


@pytest.mark.distributed(world_size=[2, 3], timeout=60)
def test_python_int_sums_beyond_int64_are_exact_not_wrapped(dist_ctx: DistContext) -> None:
    n, rank = dist_ctx.world_size, dist_ctx.rank
    big = 2**62 + rank
    assert dist_ctx.all_reduce(big, op="sum") == sum(2**62 + r for r in range(n))
    assert dist_ctx.all_reduce(-(2**63) + rank, op="sum") == sum(-(2**63) + r for r in range(n))
    mixed = dist_ctx.all_reduce(
        {"loss": 0.5, "n": big, "t": torch.tensor([1.0, 2.0]), "i": torch.tensor(3)}, op="sum"
    )
    assert mixed["n"] == sum(2**62 + r for r in range(n))
    assert type(mixed["n"]) is int
    assert mixed["loss"] == 0.5 * n
    mean = dist_ctx.all_reduce({"n": big})
    assert mean["n"] == sum(2**62 + r for r in range(n)) / n
    # NumPy and torch integers still wrap as their own arithmetic wraps
    wrapped = dist_ctx.all_reduce({"np": np.int64(2**62), "t": torch.tensor(2**62)}, op="sum")
    assert int(wrapped["np"]) == (2**62 * n + 2**63) % 2**64 - 2**63
    assert int(wrapped["t"]) == (2**62 * n + 2**63) % 2**64 - 2**63


@pytest.mark.distributed(world_size=[2, 3], timeout=60)
def test_python_int_products_beyond_int64_are_exact_or_refused(dist_ctx: DistContext) -> None:
    n, rank = dist_ctx.world_size, dist_ctx.rank
    base = 2 ** (80 // n)  # a product near 2**80, past int64
    product = dist_ctx.all_reduce(base + rank, op="prod")
    assert product == math.prod(base + r for r in range(n)) > 2**63
    negative = dist_ctx.all_reduce({"p": -(3 ** (60 // n)) - rank, "loss": 1.5}, op={"p": "prod"})
    assert negative["p"] == math.prod(-(3 ** (60 // n)) - r for r in range(n))
    assert type(negative["p"]) is int
    assert dist_ctx.all_reduce(7 + rank, op="prod") == math.prod(7 + r for r in range(n))
    with pytest.raises(OverflowError, match=r"too large to compute exactly"):
        dist_ctx.all_reduce({"huge": 2**62}, op="prod")  # beyond 2**116: refused, everywhere
    assert dist_ctx.all_reduce(1.0, op="sum") == float(n)  # the ranks are still in step


# 3. float32 sums next to torch's own all_reduce ---------------------------------------------


@pytest.mark.parametrize("length", [1, 7, 1000, 1024, 5000])
@pytest.mark.distributed(world_size=[2, 3], timeout=60)
def test_float32_sums_next_to_torchs_own_all_reduce(dist_ctx: DistContext, length: int) -> None:
    """What the README promises: at 2 ranks, bit for bit torch's sum; at more ranks, small
    leaves are the correctly rounded sum and large ones torch's float32 rounding."""
    n = dist_ctx.world_size
    generator = torch.Generator().manual_seed(1000 + dist_ctx.rank)
    mine = torch.randn(length, generator=generator, dtype=torch.float32) * 1e3
    torchs = mine.clone()
    dist.all_reduce(torchs)
    ours = dist_ctx.all_reduce(mine, op="sum")
    assert ours.dtype == torch.float32
    everyone = dist_ctx.all_gather(mine)
    exact = torch.stack(everyone).to(torch.float64).sum(dim=0)
    if n == 2:  # a + b is rounded once, in any order
        assert torch.equal(ours, torchs)
    elif length < 1024:  # summed in float64, rounded once: the correctly rounded sum
        assert torch.equal(ours, exact.to(torch.float32))
    else:  # float32 sums in another order than torch's: within float32's rounding of a sum
        bound = (n - 1) * 2.0**-24 * torch.stack(everyone).abs().sum(dim=0).to(torch.float64)
        assert bool(((ours.double() - exact).abs() <= bound).all())
        assert bool(((torchs.double() - exact).abs() <= bound).all())


# 4. A result that cannot be prepared on one rank --------------------------------------------


def contains_itself() -> dict[str, Any]:
    result: dict[str, Any] = {"loss": 1.0}
    result["again"] = result
    return result


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.distributed(world_size=[2, 3], timeout=60)
def test_a_result_that_contains_itself_on_one_rank_is_an_error_on_every_rank(
    dist_ctx: DistContext, async_op: bool
) -> None:
    bad_rank = 1

    @all_reduced(async_op=async_op)  # type: ignore[call-overload]
    def evaluate() -> Any:
        return contains_itself() if dist_ctx.rank == bad_rank else {"loss": 1.0, "again": {}}

    def reduce_once() -> None:
        outcome = evaluate()
        if async_op:
            outcome.result()

    for _ in range(2):  # also at a site that agreed on a structure before
        started = time.monotonic()
        with pytest.raises((ValueError, ReductionError)) as raised:
            reduce_once()
        assert time.monotonic() - started < patience(FAST)
        if dist_ctx.rank == bad_rank:
            assert type(raised.value) is ValueError
            assert "contains itself" in str(raised.value)
        else:
            assert isinstance(raised.value, ReductionError)
            assert f"rank {bad_rank}" in str(raised.value)
            assert "contains itself" in str(raised.value)
    # the group is still in step afterwards
    assert dist_ctx.all_reduce({"x": 1.0}, op="sum") == {"x": float(dist_ctx.world_size)}
    assert dist_ctx.all_gather(dist_ctx.rank) == list(range(dist_ctx.world_size))


@pytest.mark.distributed(world_size=2, timeout=60)
def test_a_leaf_that_fails_to_convert_on_one_rank_is_an_error_on_every_rank(
    dist_ctx: DistContext,
) -> None:
    class Flaky(int):
        def __int__(self) -> int:
            raise ArithmeticError("sensor offline")

    value: Any = Flaky(1) if dist_ctx.rank == 0 else 1
    with pytest.raises((ArithmeticError, ReductionError)) as raised:
        dist_ctx.all_reduce({"reading": value, "peak": 2.0}, op={"peak": "max"})
    if dist_ctx.rank == 0:
        assert type(raised.value) is ArithmeticError
    else:
        assert "rank 0" in str(raised.value)
    assert dist_ctx.all_reduce(math.pi, op="max") == math.pi


# 5. Containers of another type on one rank --------------------------------------------------

CONTAINERS: dict[str, Any] = {
    "list": list,
    "tuple": tuple,
    "OrderedDict": lambda items: OrderedDict(enumerate(items)),
    "dict": lambda items: dict(enumerate(items)),
    "Pair": lambda items: Pair(*items),
}


class Pair(NamedTuple):
    first: float
    second: float


@pytest.mark.parametrize("where", ["top", "nested"])
@pytest.mark.parametrize(
    ("mine", "theirs"),
    [("list", "tuple"), ("tuple", "Pair"), ("dict", "OrderedDict"), ("list", "Pair")],
)
@pytest.mark.distributed(world_size=2, timeout=60)
def test_a_container_of_another_type_on_one_rank_is_an_error_on_every_rank(
    dist_ctx: DistContext, mine: str, theirs: str, where: str
) -> None:
    # Before: rank 0 returned [1.0, 2.0] and rank 1 (1.0, 2.0); each got its own type back.
    def result(kind: str, step: float) -> Any:
        inner = CONTAINERS[kind]([1.0 * step, 2.0 * step])
        return inner if where == "top" else {"loss": step, "parts": inner}

    @all_reduced(op="sum")
    def evaluate(step: float) -> Any:
        return result(mine, step)

    evaluate(1.0)  # the call site agrees on a structure first: the fast path's side too
    assert evaluate(2.0) == result(mine, 4.0)

    @all_reduced(op="sum")
    def disagree() -> Any:
        return result(mine if dist_ctx.rank == 0 else theirs, 1.0)

    with pytest.raises(ReductionError, match=r"container:") as raised:
        disagree()
    assert "rank 1" in str(raised.value)
    assert dist_ctx.all_reduce([1.0], op="sum") == [2.0]  # still in step


# 6. Booleans count as Python and NumPy count them -------------------------------------------


@pytest.mark.distributed(world_size=3, timeout=60)
def test_booleans_sum_to_counts_and_keep_bool_under_max_min_prod(dist_ctx: DistContext) -> None:
    flags = [[True, False, True], [True, True, False], [False, False, True]]
    mine = flags[dist_ctx.rank]
    every = np.array(flags)
    tensor = torch.tensor(mine)
    summed = dist_ctx.all_reduce(tensor, op="sum")
    assert summed.dtype == torch.int64
    assert summed.tolist() == every.sum(axis=0).tolist()
    array = dist_ctx.all_reduce(np.array(mine), op="sum")
    assert array.dtype == np.int64
    assert array.tolist() == every.sum(axis=0).tolist()
    assert dist_ctx.all_reduce(mine[0], op="sum") == sum(row[0] for row in flags)
    for op, expected in (("max", every.any(axis=0)), ("min", every.all(axis=0))):
        result = dist_ctx.all_reduce(tensor, op=op)
        assert result.dtype == torch.bool
        assert result.tolist() == expected.tolist()
    product = dist_ctx.all_reduce(tensor, op="prod")
    assert product.dtype == torch.bool
    assert product.tolist() == every.all(axis=0).tolist()
    mean = dist_ctx.all_reduce(tensor, op="mean")
    assert mean.tolist() == pytest.approx(every.mean(axis=0).tolist())


@pytest.mark.parametrize(
    "count",
    [-3, -0.5, math.nan, math.inf, torch.tensor(-2), np.int64(-1)],
    ids=["int", "float", "nan", "inf", "tensor", "numpy"],
)
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.distributed(world_size=[2, 3], timeout=60)
def test_a_negative_or_non_finite_count_on_one_rank_is_an_error_on_every_rank(
    dist_ctx: DistContext, count: Any, async_op: bool
) -> None:
    # Found by an outside user: a negative count was accepted, and the weighted mean
    # came back as a number on every rank (the counts partly cancelling).
    bad_rank = dist_ctx.world_size - 1

    def reduce_once() -> None:
        mine = {"loss": 1.0 + dist_ctx.rank, "count": count if dist_ctx.rank == bad_rank else 5}
        outcome = dist_ctx.all_reduce(mine, weight="count", async_op=async_op)
        if async_op:
            outcome.result()

    for _ in range(2):  # a fresh site, then one that agreed on the structure before
        started = time.monotonic()
        with pytest.raises((ValueError, ReductionError)) as raised:
            reduce_once()
        assert time.monotonic() - started < patience(FAST)
        if dist_ctx.rank == bad_rank:
            assert type(raised.value) is ValueError
        else:
            assert isinstance(raised.value, ReductionError)
            assert f"rank {bad_rank}" in str(raised.value)
        assert "['count']" in str(raised.value)
        assert "must be a finite number >= 0" in str(raised.value)
    ok = dist_ctx.all_reduce({"loss": 2.0, "count": 0 if dist_ctx.rank else 4}, weight="count")
    assert ok == {"loss": 2.0, "count": 4}  # zero stays allowed; the ranks are in step
