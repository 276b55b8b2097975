"""@all_reduced, @rank_zero_only, rank_zero_first and object collectives on 2 and 3 real ranks.

Every test body runs on each rank (the ddpctx pytest plugin), with a real gloo group.
"""

from __future__ import annotations

import math
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ddpctx import (
    DistContext,
    RankZeroError,
    ReductionError,
    all_reduced,
    rank_zero_first,
    rank_zero_only,
)
from ddpctx.rankzero.outcome import Outcome, Place, share
from ddpctx.reduce.objects import all_gather_rare
from tests.helpers import Reductions, patience

RANKS = pytest.mark.distributed(world_size=[2, 3], timeout=60)
FAST = 5.0  # seconds within which a failure must reach every rank
Pair = namedtuple("Pair", "first second")


@RANKS
def test_mean_is_the_same_on_every_rank(dist_ctx: DistContext) -> None:
    result = all_reduced(lambda: float(dist_ctx.rank + 1))()
    assert result == (dist_ctx.world_size + 1) / 2


@RANKS
def test_every_op_by_name(dist_ctx: DistContext) -> None:
    n = dist_ctx.world_size
    ops = {"m": "mean", "s": "sum", "hi": "max", "lo": "min", "p": "prod"}
    result = all_reduced(op=ops)(lambda: dict.fromkeys(ops, dist_ctx.rank + 1))()
    assert result == {
        "m": (n + 1) / 2,
        "s": n * (n + 1) // 2,
        "hi": n,
        "lo": 1,
        "p": math.factorial(n),
    }
    assert isinstance(result["s"], int)
    assert isinstance(result["m"], float)


@RANKS
def test_a_single_op_applies_to_every_leaf(dist_ctx: DistContext) -> None:
    n, r = dist_ctx.world_size, dist_ctx.rank
    values = {
        op: all_reduced(op=op)(lambda: [float(r + 1), 10.0 * (r + 1)])()
        for op in ("sum", "max", "min", "prod")
    }
    assert values["sum"] == [n * (n + 1) / 2, 10 * n * (n + 1) / 2]
    assert values["max"] == [n, 10.0 * n]
    assert values["min"] == [1.0, 10.0]
    assert values["prod"][0] == math.factorial(n)


@RANKS
def test_weighted_mean_weighs_each_rank_by_its_count(dist_ctx: DistContext) -> None:
    # rank 0: 1 sample, loss 1; rank 1: 3 samples, mean loss 4; rank 2: no samples.
    losses, counts = [1.0, 4.0, 10.0], [1, 3, 0]
    rank = dist_ctx.rank

    @all_reduced(weight="count")
    def evaluate() -> dict[str, Any]:
        return {"loss": torch.tensor(losses[rank]), "acc": losses[rank] / 10, "count": counts[rank]}

    result = evaluate()
    assert result["loss"].item() == 3.25  # (1*1 + 4*3) / 4, not the plain mean of the ranks
    assert result["acc"] == pytest.approx(0.325)
    assert result["count"] == 4


@RANKS
def test_a_rank_that_counted_nothing_adds_nothing_not_the_nan_of_its_empty_mean(
    dist_ctx: DistContext,
) -> None:
    # rank 0 holds every sample; the others' shards are empty (pad=False), and the mean
    # of an empty batch is NaN (mse_loss of empty tensors), as an array, an inf, a tensor
    n = 5 if dist_ctx.rank == 0 else 0
    pred, target = torch.zeros(n, 1), torch.ones(n, 1)
    empty = dist_ctx.rank != 0

    @all_reduced(weight="count")
    def evaluate() -> dict[str, Any]:
        return {
            "loss": torch.nn.functional.mse_loss(pred, target),
            "inf": math.inf if empty else 2.0,
            "per_class": np.array([math.nan, math.nan]) if empty else np.array([1.0, 3.0]),
            "count": n,
        }

    result = evaluate()
    assert result["loss"].item() == 1.0
    assert result["inf"] == 2.0
    assert result["per_class"].tolist() == [1.0, 3.0]
    assert result["count"] == 5


@RANKS
def test_a_total_weight_of_zero_gives_nan_not_zero(dist_ctx: DistContext) -> None:
    result = all_reduced(weight="count")(lambda: {"loss": 0.0, "count": 0})()
    assert math.isnan(result["loss"])
    assert result["count"] == 0


def every_kind(rank: int) -> dict[str, Any]:
    return {
        "int": rank + 1,
        "float": rank + 0.5,
        "bool": rank == 0,
        "np_float32": np.float32(rank + 1),
        "np_int64": np.int64(rank + 1),
        "np_array": np.array([rank, 2 * rank]),
        "tensor_0d": torch.tensor(float(rank + 1)),
        "tensor_int": torch.tensor([rank, rank + 1]),
        "tensor_2d": torch.full((2, 2), float(rank)),
        "tensor_bool": torch.tensor(rank == 0),
    }


@RANKS
def test_leaf_kinds_survive_a_mean(dist_ctx: DistContext) -> None:
    n = dist_ctx.world_size
    mean = (n + 1) / 2
    result = all_reduced(lambda: every_kind(dist_ctx.rank))()
    assert result["int"] == mean
    assert isinstance(result["int"], float)
    assert result["float"] == mean - 0.5
    assert result["bool"] == pytest.approx(1 / n)
    assert isinstance(result["np_float32"], np.float32)
    assert result["np_float32"] == mean
    assert isinstance(result["np_int64"], np.float64)
    assert result["np_array"].dtype == np.float64
    assert result["np_array"].tolist() == [mean - 1, 2 * mean - 2]
    assert result["tensor_0d"].dtype == torch.float32
    assert result["tensor_0d"].shape == ()
    assert result["tensor_int"].dtype == torch.get_default_dtype()
    assert result["tensor_int"].tolist() == [mean - 1, mean]
    assert result["tensor_2d"].tolist() == [[mean - 1] * 2] * 2
    assert result["tensor_bool"].dtype == torch.get_default_dtype()
    assert all(t.device == dist_ctx.device for t in result.values() if isinstance(t, torch.Tensor))


@RANKS
def test_leaf_kinds_survive_a_sum_and_integers_stay_integers(dist_ctx: DistContext) -> None:
    n = dist_ctx.world_size
    total = n * (n + 1) // 2
    result = all_reduced(op="sum")(lambda: every_kind(dist_ctx.rank))()
    assert result["int"] == total
    assert isinstance(result["int"], int)
    assert result["bool"] == 1  # how many ranks said True
    assert isinstance(result["np_int64"], np.int64)
    assert result["np_array"].dtype == np.int64
    assert result["np_array"].tolist() == [total - n, 2 * (total - n)]
    assert result["tensor_int"].dtype == torch.int64
    assert result["tensor_int"].tolist() == [total - n, total]
    assert result["tensor_bool"].dtype == torch.int64
    assert result["tensor_bool"].item() == 1


@RANKS
def test_nested_dicts_use_the_nearest_count(dist_ctx: DistContext) -> None:
    n, r = dist_ctx.world_size, dist_ctx.rank

    @all_reduced(weight="count", op={"lr": "max"})
    def metrics() -> dict[str, Any]:
        return {
            "train": {"loss": float(r + 1), "count": 1},
            "val": {"loss": 2.0 * r, "count": r, "parts": [float(r), Pair(r, 1.0)]},
            "lr": (0.1, 0.2 * (r + 1)),
        }

    result = metrics()
    assert result["train"] == {"loss": (n + 1) / 2, "count": n}
    val_count = sum(range(n))  # rank r has r samples of loss 2r
    assert result["val"]["loss"] == pytest.approx(sum(2 * k * k for k in range(n)) / val_count)
    assert isinstance(result["val"]["parts"][1], Pair)  # namedtuples come back as themselves
    assert isinstance(result["lr"], tuple)
    assert result["lr"][1] == pytest.approx(0.2 * n)  # op "max"


def expect_error_everywhere(fn: Any, error: type[BaseException]) -> BaseException:
    started = time.monotonic()
    with pytest.raises(error) as raised:
        fn()
    assert time.monotonic() - started < patience(FAST)
    return raised.value


@RANKS
def test_different_keys_are_an_error_on_every_rank(dist_ctx: DistContext) -> None:
    key = "acc" if dist_ctx.rank == 0 else "f1"
    error = expect_error_everywhere(all_reduced(lambda: {"loss": 1.0, key: 0.5}), ReductionError)
    assert "ranks returned different structures" in str(error)
    assert "rank 1 lacks ['acc']; adds ['f1']" in str(error)


@RANKS
def test_different_lengths_are_an_error_not_an_abort(dist_ctx: DistContext) -> None:
    big = {"loss": 1.0, "hist": torch.ones(500)}
    fn = all_reduced(lambda: {"loss": 1.0} if dist_ctx.rank == 0 else big)
    error = expect_error_everywhere(fn, ReductionError)
    assert "rank 1 adds ['hist']" in str(error)


@RANKS
def test_different_shapes_are_an_error_on_every_rank(dist_ctx: DistContext) -> None:
    fn = all_reduced(lambda: {"x": torch.zeros(2 + (dist_ctx.rank > 0))})
    error = expect_error_everywhere(fn, ReductionError)
    assert (
        "has ['x'] as tensor:torch.float32[3] mean (rank 0: tensor:torch.float32[2] mean)"
        in str(error)
    )


@pytest.mark.parametrize(
    ("leaf", "said", "fix"),
    [
        (torch.tensor([1j]), "a complex tensor (torch.complex64)", "torch.view_as_real(x)"),
        (np.array([1j]), "a complex NumPy array (complex128)", "torch.view_as_real(x)"),
        (np.complex64(1j), "a complex NumPy number (complex64)", "z.real, 'im': z.imag"),
        (2 + 1j, "a complex number (2+1j)", "z.real, 'im': z.imag"),
    ],
)
def test_a_complex_leaf_is_named_complex_with_the_way_to_reduce_it(
    leaf: Any, said: str, fix: str
) -> None:
    """Not "is Tensor ..., not a number, tensor or NumPy array": it is all of those, but complex."""
    from ddpctx.reduce.tree import flatten

    with pytest.raises(TypeError) as raised:
        flatten({"z": leaf})
    assert str(raised.value).startswith(f"['z'] is {said}"), raised.value
    assert "only real leaves can be reduced" in str(raised.value)
    assert fix in str(raised.value)


@RANKS
def test_a_non_numeric_leaf_on_one_rank_is_an_error_on_every_rank(dist_ctx: DistContext) -> None:
    last = dist_ctx.world_size - 1
    fn = all_reduced(lambda: {"loss": 1.0, "tag": "best" if dist_ctx.rank == last else 0.0})
    if dist_ctx.rank == last:
        error = expect_error_everywhere(fn, TypeError)
        assert str(error).startswith("['tag'] is str 'best'")
    else:
        error = expect_error_everywhere(fn, ReductionError)
        assert f"rank {last} could not reduce its result" in str(error)
        assert "['tag'] is str" in str(error)


@RANKS
def test_an_exception_inside_on_one_rank_reaches_every_rank(dist_ctx: DistContext) -> None:
    @all_reduced
    def evaluate() -> float:
        if dist_ctx.rank == 1:
            raise KeyError("validation shard missing")
        return 1.0

    if dist_ctx.rank == 1:
        expect_error_everywhere(evaluate, KeyError)
    else:
        error = expect_error_everywhere(evaluate, ReductionError)
        assert "rank 1: KeyError: 'validation shard missing'" in str(error)


@RANKS
def test_one_collective_for_all_mean_and_sum_leaves(dist_ctx: DistContext) -> None:
    thirty_two = all_reduced(op={f"s{i}": "sum" for i in range(16)})(
        lambda: {
            **{f"m{i}": torch.tensor(1.0) for i in range(16)},
            **{f"s{i}": torch.tensor(2.0) for i in range(16)},
        }
    )
    with_max = all_reduced(op={"peak": "max"})(lambda: {"loss": 1.0, "peak": float(dist_ctx.rank)})
    grows = all_reduced(lambda: torch.ones(1000) * dist_ctx.rank)
    counts = []
    for fn in (thirty_two, with_max, grows):
        fn()  # a site's first call also agrees on the layout
        with Reductions() as counter:
            result = fn()
        counts.append(counter.calls)
    # one; one more for "max" only; a large tensor too is one
    assert counts == [1, 2, 1]
    assert result[0].item() == (dist_ctx.world_size - 1) / 2


@RANKS
def test_ctx_all_reduce_is_the_functional_form(dist_ctx: DistContext) -> None:
    n, r = dist_ctx.world_size, dist_ctx.rank
    result = dist_ctx.all_reduce({"loss": float(r), "count": r + 1}, weight="count")
    count = n * (n + 1) // 2
    assert result["count"] == count
    assert result["loss"] == pytest.approx(sum(k * (k + 1) for k in range(n)) / count)


@pytest.mark.parametrize(
    ("form", "error_type", "message"),
    [
        ("barrier", OSError, "disk full while writing checkpoint"),
        ("broadcast", ValueError, "no run name"),
        ("first", RuntimeError, "download failed"),
    ],
)
@RANKS
def test_a_failure_on_rank_zero_is_raised_on_every_rank(
    dist_ctx: DistContext, form: str, error_type: type[Exception], message: str
) -> None:
    def fail() -> None:
        raise error_type(message)

    def call() -> None:
        if form == "first":
            with rank_zero_first():
                if dist_ctx.rank == 0:
                    fail()
        else:
            rank_zero_only(**{form: True})(fail)()

    if dist_ctx.rank == 0:
        error = expect_error_everywhere(call, error_type)
        assert str(error) == message
    else:
        error = expect_error_everywhere(call, RankZeroError)
        assert isinstance(error, RankZeroError)
        assert (error.rank, error.error_type, error.message) == (0, error_type.__name__, message)
        assert "in fail" in error.remote_traceback  # rank 0's own frames


@RANKS
def test_broadcast_returns_rank_zeros_result_everywhere(dist_ctx: DistContext) -> None:
    result = rank_zero_only(broadcast=True)(lambda: {"name": f"chosen-by-{dist_ctx.rank}"})()
    assert result == {"name": "chosen-by-0"}


@RANKS
def test_rank_zero_only_runs_on_rank_zero_and_others_get_default(dist_ctx: DistContext) -> None:
    ran = rank_zero_only(lambda: "ran")()
    defaulted = rank_zero_only(default="skipped")(lambda: "ran")()
    if dist_ctx.rank == 0:
        assert (ran, defaulted) == ("ran", "ran")
    else:
        assert (ran, defaulted) == (None, "skipped")


@RANKS
def test_barrier_makes_every_rank_wait_for_rank_zero(dist_ctx: DistContext, tmp_path: Path) -> None:
    marker = tmp_path / "written"

    @rank_zero_only(barrier=True)
    def slow_write() -> None:
        time.sleep(0.3)
        marker.write_text("done")

    slow_write()
    assert marker.exists()


@RANKS
def test_rank_zero_first_lets_the_others_read_what_rank_zero_made(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    cache = tmp_path / "cache.txt"
    with rank_zero_first():
        if not cache.exists():
            time.sleep(0.2)
            cache.write_text(f"filled by {dist_ctx.rank}")
        seen = cache.read_text()
    assert seen == "filled by 0"


@RANKS
def test_local_rank_zero_of_each_node_serves_its_own_node(dist_ctx: DistContext) -> None:
    rank = dist_ctx.rank  # pretend nodes of two: node = rank // 2, local rank = rank % 2
    place = Place(rank, dist_ctx.world_size, rank % 2, rank // 2)
    mine = Outcome(True, f"from rank {rank}") if rank % 2 == 0 else None
    outcome, source = share(mine, place, local=True)
    assert (outcome.result(source), source) == (f"from rank {2 * (rank // 2)}", 2 * (rank // 2))


@RANKS
def test_broadcast_and_all_gather_take_objects_of_any_size(dist_ctx: DistContext) -> None:
    n = dist_ctx.world_size
    assert [len(x) for x in dist_ctx.all_gather("x" * (1000 * dist_ctx.rank))] == [
        1000 * r for r in range(n)
    ]
    sent = dist_ctx.broadcast({"from": dist_ctx.rank, "tensor": torch.arange(3)}, src=n - 1)
    assert sent["from"] == n - 1
    assert sent["tensor"].tolist() == [0, 1, 2]
    assert sent["tensor"].device == torch.device("cpu")


@RANKS
def test_a_rare_gather_is_one_element_when_no_rank_sends_and_a_gather_when_one_does(
    dist_ctx: DistContext,
) -> None:
    # What the ranks say of a checkpoint they read (nearly always nothing): one
    # 1-element vote, and the objects gathered only when some rank has one.
    n, rank = dist_ctx.world_size, dist_ctx.rank
    for sender in [None, *range(n)]:
        mine = {"rank": rank, "file": "x" * rank} if rank == sender else None
        with Reductions() as counted:
            everyone = all_gather_rare(mine)
        assert everyone == [{"rank": r, "file": "x" * r} if r == sender else None for r in range(n)]
        if sender is None and n > 1:
            assert counted.sizes == [1]  # one vote; no object gather
    both = all_gather_rare({"rank": rank})  # every rank sends
    assert both == [{"rank": r} for r in range(n)]


@RANKS
def test_a_lone_wire_reduced_synchronously_takes_one_blocking_collective(
    dist_ctx: DistContext,
) -> None:
    # An async collective and its wait cost ~50-90 us more CPU than a blocking one (a 1M
    # tensor's mean: ~1.15x the hand-written clone/all_reduce/divide, ~1.0x blocking).
    # Several wires still travel at once, async; an async reduction stays async.
    import torch.distributed as dist

    n, rank = dist_ctx.world_size, dist_ctx.rank
    kinds: list[bool] = []
    original = dist.all_reduce

    def spied(*args: Any, **kwargs: Any) -> Any:
        kinds.append(bool(kwargs.get("async_op", False)))
        return original(*args, **kwargs)

    big = torch.full((70_000,), float(rank))  # beyond the 2-rank gather: an all_reduce
    wires = {"big": big, "top": big + 1}  # a sum wire and a max wire: two at once
    for _ in range(2):  # the first call plans; the second is the steady state
        kinds.clear()
        dist.all_reduce = spied  # type: ignore[assignment]
        try:
            lone = dist_ctx.all_reduce(big)
            lone_kinds, kinds[:] = list(kinds), []
            both = dist_ctx.all_reduce(wires, op={"big": "sum", "top": "max"})
            both_kinds, kinds[:] = list(kinds), []
            handle = dist_ctx.all_reduce(big, async_op=True)
            async_kinds = list(kinds)
            later = handle.result()
        finally:
            dist.all_reduce = original  # type: ignore[assignment]
    assert lone_kinds == [False]
    assert both_kinds == [True, True]
    assert async_kinds == [True]
    mean = sum(range(n)) / n
    assert torch.equal(lone, torch.full((70_000,), mean))
    assert torch.equal(later, lone)
    assert torch.equal(both["big"], torch.full((70_000,), float(sum(range(n)))))
    assert torch.equal(both["top"], torch.full((70_000,), float(n)))


@RANKS
def test_async_all_reduce_returns_a_handle_with_the_result(dist_ctx: DistContext) -> None:
    n, r = dist_ctx.world_size, dist_ctx.rank
    handles = [
        dist_ctx.all_reduce({"loss": float(r), "step": step}, async_op=True) for step in range(3)
    ]
    results = [handle.result() for handle in handles]
    assert results == [{"loss": sum(range(n)) / n, "step": float(step)} for step in range(3)]
    handles[0].wait()  # waiting again is harmless


@RANKS
def test_async_all_reduced_reads_one_step_later(dist_ctx: DistContext) -> None:
    @all_reduced(op="sum", async_op=True)
    def step_metrics(step: int) -> dict[str, Any]:
        return {"seen": dist_ctx.rank + 1, "step": torch.tensor(float(step))}

    pending = step_metrics(0)
    for step in range(1, 4):
        following = step_metrics(step)  # sent before the previous one is read
        previous = pending.result()
        assert previous["seen"] == dist_ctx.world_size * (dist_ctx.world_size + 1) // 2
        assert previous["step"].item() == (step - 1) * dist_ctx.world_size
        pending = following
    pending.result()


@RANKS
def test_async_errors_are_raised_at_result_on_every_rank(dist_ctx: DistContext) -> None:
    @all_reduced(async_op=True)
    def evaluate() -> float:
        if dist_ctx.rank == 1:
            raise KeyError("validation shard missing")
        return 1.0

    handle = evaluate()
    if dist_ctx.rank == 1:
        expect_error_everywhere(handle.result, KeyError)
    else:
        error = expect_error_everywhere(handle.result, ReductionError)
        assert "rank 1: KeyError: 'validation shard missing'" in str(error)
    key = "acc" if dist_ctx.rank == 0 else "f1"
    mismatch = dist_ctx.all_reduce({key: 1.0}, async_op=True)
    error = expect_error_everywhere(mismatch.result, ReductionError)
    assert "rank 1 lacks ['acc']; adds ['f1']" in str(error)


@RANKS
def test_async_first_calls_of_one_site_read_in_another_order_give_the_right_values(
    dist_ctx: DistContext,
) -> None:
    # Found by an outside user: rank 0 read the second handle first; both ranks got
    # [102.0, 102.0] instead of [3.0, 201.0] -- the two calls' agreements paired crosswise.
    n, rank = dist_ctx.world_size, dist_ctx.rank

    @all_reduced(op="sum", async_op=True)
    def first(value: float) -> float:
        return value

    handles = [first(1.0 + rank), first(100.0 + rank), first(1000.0 + rank)]
    order = [2, 0, 1] if rank == 0 else [0, 1, 2]  # one rank reads in another order
    results = {index: handles[index].result() for index in order}
    assert [results[i] for i in range(3)] == [
        sum(1.0 + r for r in range(n)),
        sum(100.0 + r for r in range(n)),
        sum(1000.0 + r for r in range(n)),
    ]


@RANKS
@pytest.mark.parametrize("calls", ["first", "steady"])
def test_async_handles_of_a_two_collective_result_read_in_another_order_are_right(
    dist_ctx: DistContext, calls: str
) -> None:
    # A sum and a max travel in two collectives; the second is sent when the handle is read,
    # so reading swapped on one rank paired one call's max with the other's.
    n, rank = dist_ctx.world_size, dist_ctx.rank
    site_ops = {"total": "sum", "peak": "max"}
    if calls == "steady":
        dist_ctx.all_reduce({"total": 0.0, "peak": 0.0}, op=site_ops)  # agreed before
    handles = [
        dist_ctx.all_reduce(
            {"total": k + rank, "peak": 10.0 * k + rank}, op=site_ops, async_op=True
        )
        for k in (1.0, 2.0)
    ]
    later, earlier = (handles[1].result(), handles[0].result()) if rank == 1 else (None, None)
    earlier = handles[0].result() if rank != 1 else earlier
    later = handles[1].result() if rank != 1 else later
    assert earlier == {"total": sum(1.0 + r for r in range(n)), "peak": 10.0 + n - 1}
    assert later == {"total": sum(2.0 + r for r in range(n)), "peak": 20.0 + n - 1}


@RANKS
def test_an_async_handle_dropped_unread_on_every_rank_leaves_the_others_right(
    dist_ctx: DistContext,
) -> None:
    n, rank = dist_ctx.world_size, dist_ctx.rank
    dist_ctx.all_reduce(float(rank), op="sum", async_op=True)  # dropped unread (steady or not)
    kept = dist_ctx.all_reduce({"x": float(rank)}, op="sum", async_op=True)
    assert kept.result() == {"x": float(sum(range(n)))}
    assert dist_ctx.all_reduce(1.0, op="sum") == float(n)


@RANKS
@pytest.mark.parametrize("reader", ["rank 0 only", "every rank, at different points"])
def test_async_handles_read_on_some_ranks_or_at_different_points_pair_nothing_wrongly(
    dist_ctx: DistContext, reader: str
) -> None:
    # The usual logging pattern: a two-collective metric sent async, read under
    # `if ctx.is_main:` (or before a sync reduction on one rank and after it on another),
    # with sync reductions in between. Reading once sent the second collective, which then
    # paired with another rank's sync reduction: wrong numbers on every rank, no error.
    n, rank = dist_ctx.world_size, dist_ctx.rank
    ops = {"loss": "sum", "peak": "max"}
    for step in range(1, 6):  # the site's first call agrees at once; then the steady state
        handle = dist_ctx.all_reduce(
            {"loss": step + rank, "peak": 10.0 * step + rank}, op=ops, async_op=True
        )
        expected = {"loss": float(sum(step + r for r in range(n))), "peak": 10.0 * step + n - 1}
        early = (rank + step) % 2 == 0
        if reader == "rank 0 only":
            if dist_ctx.is_main:
                assert handle.result() == expected
        elif early:
            assert handle.result() == expected
        assert dist_ctx.all_reduce(float(rank + step), op="sum") == sum(r + step for r in range(n))
        if reader != "rank 0 only" and not early:
            assert handle.result() == expected
        del handle


@RANKS
def test_an_async_handle_is_completed_without_being_waited_for(dist_ctx: DistContext) -> None:
    ops = {"loss": "sum", "peak": "max"}
    for _ in range(2):  # one site: the second call is the steady state
        handle = dist_ctx.all_reduce({"loss": 1.0, "peak": 2.0}, op=ops, async_op=True)
    deadline = time.monotonic() + patience(30)
    while not handle.is_completed():  # as a torch Work is polled
        assert time.monotonic() < deadline, "is_completed() never became True"
        time.sleep(0.001)
    assert handle.result() == {"loss": float(dist_ctx.world_size), "peak": 2.0}


@pytest.mark.distributed(world_size=2, timeout=60, init=False)
def test_an_async_handle_read_after_its_block_ended_says_so() -> None:
    from ddpctx import distributed

    with distributed() as ctx:
        for _ in range(2):  # one site: its first call agrees at once, the second is steady
            handle = ctx.all_reduce({"x": 1.0, "y": 1.0}, {"x": "sum", "y": "max"}, async_op=True)
    with pytest.raises(RuntimeError, match=r"after its distributed\(\) block ended.*inside"):
        handle.result()
