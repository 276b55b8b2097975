"""Wrong results the reduction engine once gave, each pinned by a test on 2 and 3 real ranks.

One test (or a few) per case, named for the behaviour that is now guaranteed:
NumPy float64 scalars, inputs left alone, dict subclasses in object
collectives, per-key op precedence, call sites, integers, NaN, buffer history,
buffer size, copies from all_gather.
"""

from __future__ import annotations

import math
import pickle
import random
import time
from collections import Counter, OrderedDict, defaultdict
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ddpctx import DistContext, ReductionError, all_reduced
from tests.helpers import Reductions, patience

RANKS = pytest.mark.distributed(world_size=[2, 3], timeout=60)
FAST = 5.0  # seconds within which a failure must reach every rank


# 1. NumPy float64 scalars ---------------------------------------------------------------


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "mean"])
@RANKS
def test_numpy_float64_scalars_come_back_as_numpy_float64(dist_ctx: DistContext, op: str) -> None:
    values = [0.25, 1.5, 2.75][: dist_ctx.world_size]
    expected = {
        "sum": sum(values),
        "max": max(values),
        "min": min(values),
        "prod": math.prod(values),
        "mean": sum(values) / len(values),
    }[op]
    result = dist_ctx.all_reduce({"score": np.float64(values[dist_ctx.rank])}, op=op)
    assert type(result["score"]) is np.float64
    assert result["score"] == expected


# 2. Inputs are never written to -----------------------------------------------------------


@pytest.mark.parametrize("op", ["sum", "max", "min", "prod", "mean"])
@RANKS
def test_reduction_never_writes_into_the_callers_values(dist_ctx: DistContext, op: str) -> None:
    rank = float(dist_ctx.rank + 2)
    array = np.full(3, rank)
    tensor = torch.full((3,), rank, dtype=torch.float64)
    int_tensor = torch.full((2,), int(rank))
    for result in ({"a": array}, {"t": tensor}, {"i": int_tensor}, {"a": array, "t": tensor}):
        dist_ctx.all_reduce(result, op=op)
        assert array.tolist() == [rank] * 3
        assert tensor.tolist() == [rank] * 3
        assert int_tensor.tolist() == [int(rank)] * 2


# 3. Dict subclasses and unpicklable objects in object collectives -------------------------


def dict_subclasses(rank: int) -> list[Any]:
    counts: defaultdict[str, int] = defaultdict(int)
    counts["dog"] += rank + 1
    return [Counter({"cat": 4, f"rank{rank}": 1}), counts, OrderedDict(b=1, a=rank)]


@RANKS
def test_all_gather_delivers_dict_subclasses_as_torch_does(dist_ctx: DistContext) -> None:
    ours = dist_ctx.all_gather(dict_subclasses(dist_ctx.rank))
    torchs: list[Any] = [None] * dist_ctx.world_size
    dist.all_gather_object(torchs, dict_subclasses(dist_ctx.rank))
    assert ours == torchs
    for mine, theirs in zip(ours, torchs, strict=True):
        assert [type(x) for x in mine] == [type(x) for x in theirs]
    assert ours[0][0] == Counter({"cat": 4, "rank0": 1})
    assert ours[0][1].default_factory is int


@RANKS
def test_broadcast_delivers_dict_subclasses_as_torch_does(dist_ctx: DistContext) -> None:
    ours = dist_ctx.broadcast(dict_subclasses(dist_ctx.rank), src=1)
    box = [dict_subclasses(dist_ctx.rank)]
    dist.broadcast_object_list(box, src=1)
    assert ours == box[0]
    assert [type(x) for x in ours] == [Counter, defaultdict, OrderedDict]


@pytest.mark.parametrize("collective", ["all_gather", "broadcast"])
@pytest.mark.distributed(world_size=[2, 3], timeout=30)
def test_an_object_one_rank_cannot_send_is_an_error_on_every_rank(
    dist_ctx: DistContext, collective: str
) -> None:
    sender = 1
    obj: Any = {"ok": 1}
    if dist_ctx.rank == sender:
        obj = defaultdict(lambda: 0)  # a lambda cannot be pickled
    send = (
        (lambda: dist_ctx.all_gather(obj))
        if collective == "all_gather"
        else (lambda: dist_ctx.broadcast(obj, src=sender))
    )
    started = time.monotonic()
    with pytest.raises((ReductionError, pickle.PicklingError, AttributeError)) as raised:
        send()
    assert time.monotonic() - started < patience(FAST)
    if dist_ctx.rank != sender:
        assert isinstance(raised.value, ReductionError)
        assert f"rank {sender}" in str(raised.value)
    dist_ctx.barrier()  # the group still works afterwards
    assert dist_ctx.all_gather(dist_ctx.rank) == list(range(dist_ctx.world_size))


# 4. Per-key op precedence -------------------------------------------------------------------


@RANKS
def test_the_innermost_key_named_in_op_wins(dist_ctx: DistContext) -> None:
    n, r = dist_ctx.world_size, float(dist_ctx.rank)
    result = dist_ctx.all_reduce(
        {"val": {"loss": r, "peak": r}, "loss": r, "other": r},
        op={"val": "max", "loss": "sum"},
    )
    assert result == {
        "val": {"loss": sum(range(n)), "peak": n - 1},  # "loss" inside "val": loss wins
        "loss": sum(range(n)),
        "other": sum(range(n)) / n,
    }
    inner_only = dist_ctx.all_reduce({"val": {"loss": r}}, op={"val": "max", "loss": "mean"})
    assert inner_only == {"val": {"loss": sum(range(n)) / n}}


# 5. Call sites: structure only, the sites named -------------------------------------------


@RANKS
def test_one_reduction_written_on_two_lines_agrees(dist_ctx: DistContext) -> None:
    for _ in range(3):
        if dist_ctx.rank == 0:
            result = dist_ctx.all_reduce({"loss": float(dist_ctx.rank)})
        else:
            result = dist_ctx.all_reduce({"loss": float(dist_ctx.rank)})
        assert result == {"loss": sum(range(dist_ctx.world_size)) / dist_ctx.world_size}


@RANKS
def test_a_mismatch_across_two_lines_names_both_lines_and_the_difference(
    dist_ctx: DistContext,
) -> None:
    def reduce() -> Any:
        if dist_ctx.rank == 0:
            return dist_ctx.all_reduce({"loss": 1.0})
        return dist_ctx.all_reduce({"acc": 1.0})

    with pytest.raises(ReductionError) as raised:
        reduce()
    message = str(raised.value)
    assert "rank 1 lacks ['loss']; adds ['acc']" in message
    assert message.count("test_reduction_regressions.py:") >= 2  # both call sites
    assert ": ." not in message


# 6. Integers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.int8])
@RANKS
def test_integer_tensors_wrap_like_torchs_own_all_reduce(
    dist_ctx: DistContext, dtype: torch.dtype
) -> None:
    big = torch.iinfo(dtype).max - dist_ctx.rank
    for op in ("sum", "prod", "max", "min"):
        mine = torch.tensor([big, 3], dtype=dtype)
        expected = mine.clone()
        dist.all_reduce(
            expected,
            op={"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT}.get(
                op, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN
            ),
        )
        result = dist_ctx.all_reduce(mine, op=op)
        assert result.dtype == dtype
        assert result.tolist() == expected.tolist(), op


@RANKS
def test_integer_arrays_and_numpy_scalars_wrap_like_numpy(dist_ctx: DistContext) -> None:
    n = dist_ctx.world_size
    array = np.array([250, 1], dtype=np.uint8)
    scalar = np.int32(2**31 - 1)
    result = dist_ctx.all_reduce({"a": array, "s": scalar}, op="sum")
    assert result["a"].dtype == np.uint8
    assert result["a"].tolist() == [(250 * n) % 256, n]
    assert type(result["s"]) is np.int32
    assert int(result["s"]) == np.array([(2**31 - 1) * n]).astype(np.int32)[0]


@RANKS
def test_python_ints_are_exact_beyond_two_to_the_53(dist_ctx: DistContext) -> None:
    n, r = dist_ctx.world_size, dist_ctx.rank
    big = 2**53 + 1 + r
    result = dist_ctx.all_reduce(
        {"s": big, "hi": big, "lo": -big}, op={"s": "sum", "hi": "max", "lo": "min"}
    )
    assert result == {
        "s": sum(2**53 + 1 + k for k in range(n)),
        "hi": 2**53 + n,
        "lo": -(2**53 + n),
    }
    base = 2**30 + 1 if n == 2 else 2**20 + 1  # the product stays within int64
    assert dist_ctx.all_reduce(base, op="prod") == base**n


# 7. NaN under max and min --------------------------------------------------------------------


@pytest.mark.parametrize("holder", ["first", "last"])
@RANKS
def test_nan_propagates_under_max_and_min_whichever_rank_holds_it(
    dist_ctx: DistContext, holder: str
) -> None:
    nan_rank = 0 if holder == "first" else dist_ctx.world_size - 1
    has_nan = dist_ctx.rank == nan_rank
    value = math.nan if has_nan else 1.0
    tensor = torch.tensor([math.nan if has_nan else 2.0, 3.0])
    for op in ("max", "min"):
        result = dist_ctx.all_reduce({"x": value, "t": tensor, "np": np.float32(value)}, op=op)
        assert math.isnan(result["x"]), op
        assert math.isnan(result["np"]), op
        assert math.isnan(result["t"][0].item()), op
        assert result["t"][1].item() == 3.0


# 8. History independence ---------------------------------------------------------------------


@RANKS
def test_results_do_not_depend_on_what_the_call_site_reduced_before(dist_ctx: DistContext) -> None:
    generator = random.Random(1234 + dist_ctx.rank)
    cases = [{"x": [generator.uniform(-1, 1) for _ in range(60)]} for _ in range(40)]
    fresh = [all_reduced(op="sum")(lambda c=case: c)() for case in cases]
    used = all_reduced(op="sum")(lambda c: c)
    used({"x": torch.ones(5000)})  # a large earlier result at the same site
    assert [used(case) for case in cases] == fresh


# 9. Buffers shrink back ----------------------------------------------------------------------


@RANKS
def test_a_call_site_buffer_shrinks_back_after_a_large_result(dist_ctx: DistContext) -> None:
    site = all_reduced(lambda big: {"t": torch.ones(100_000)} if big else {"loss": 1.0})
    site(True)
    site(False)
    with Reductions() as recorder:
        assert site(False) == {"loss": 1.0}
    assert recorder.sizes
    assert max(recorder.sizes) <= 16


# 10. all_gather returns copies ---------------------------------------------------------------


@RANKS
def test_all_gather_returns_a_copy_of_this_ranks_own_object(dist_ctx: DistContext) -> None:
    mine = {"rank": dist_ctx.rank, "items": [1, 2]}
    gathered = dist_ctx.all_gather(mine)
    assert gathered[dist_ctx.rank] == mine
    assert gathered[dist_ctx.rank] is not mine
    gathered[dist_ctx.rank]["items"].append(3)
    assert mine["items"] == [1, 2]


@pytest.mark.distributed(world_size=2, timeout=60)
@pytest.mark.parametrize(
    "shape", ["one large tensor", "nested dict", "list of tensors", "flat dict", "loss"]
)
def test_a_reduced_result_is_freed_as_soon_as_its_last_reference_goes(
    dist_ctx: DistContext, shape: str
) -> None:
    """Regression: the rebuild closure was a reference cycle holding every result (a 1M
    tensor's 4 MB buffer lived until the cyclic collector ran, each call on fresh pages)."""
    import gc
    import weakref

    big = torch.randn(1_000_000)
    mine: Any = {
        "one large tensor": big,
        "nested dict": {"val": {"loss": torch.tensor(1.0), "acc": torch.tensor(0.5)}},
        "list of tensors": [torch.ones(3), torch.zeros(2)],
        "flat dict": {"loss": torch.tensor(1.0), "lr": 0.1},
        "loss": torch.tensor(2.0),
    }[shape]
    reduce = all_reduced(lambda: mine)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):  # the first call agrees, the next ones are the steady state
            result = reduce()
            leaves = result if isinstance(result, list) else [result]
            if isinstance(result, dict):
                leaves = [v for v in result.values() if isinstance(v, torch.Tensor)]
                leaves += [v for d in result.values() if isinstance(d, dict) for v in d.values()]
            refs = [weakref.ref(leaf) for leaf in leaves]
            del result, leaves
            assert all(ref() is None for ref in refs), shape
    finally:
        gc.enable()
