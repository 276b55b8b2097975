"""The steady-state fast path of a call site (ddpctx.reduce.fastpath), on 2 and 3 real ranks.

Once every rank agreed on a site's structure, a call packs, reduces and reads
back with the least Python. These tests hold it to the general path: the same
results bit for bit (a differential test against a fresh site, which always
takes the general path), one collective per call, and every way a rank can
leave the steady state -- other keys, another dtype, another shape, another
leaf type, a failure, async handles -- still ends in the same clean error on
every rank (a mismatch is a ``ReductionError`` on every rank, naming what
differs on which rank), never a gloo abort or a silent wrong sum.
"""

from __future__ import annotations

import math
import time
from fractions import Fraction
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ddpctx
from ddpctx import DistContext, HangError, RankError, ReductionError, launch
from ddpctx.reduce import collectives, fastpath
from ddpctx.reduce.collectives import Site, all_reduce_tree
from tests.helpers import Reductions, patience

RANKS = pytest.mark.distributed(world_size=[2, 3], timeout=120)
FAST = 5.0  # seconds within which a failure must reach every rank
SETTINGS = settings(
    max_examples=40,
    derandomize=True,
    database=None,
    deadline=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
)
# None: Python floats. Integers and bools read back through the buffer, floats through tolist().
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, None]
INTEGERS = [torch.int64, torch.int32, torch.bool]


class Counted(Reductions):
    """Counts the reductions, object gathers and general path's planning calls (they run)."""

    def __enter__(self) -> Counted:
        super().__enter__()
        self.gathers = self.prepares = 0
        self.kept = (dist.all_gather_object, collectives._prepare)

        def all_gather_object(*args: Any, **kwargs: Any) -> Any:
            self.gathers += 1
            return self.kept[0](*args, **kwargs)

        def prepare(*args: Any, **kwargs: Any) -> Any:
            self.prepares += 1
            return self.kept[1](*args, **kwargs)

        dist.all_gather_object = all_gather_object  # type: ignore[assignment]
        collectives._prepare = prepare  # type: ignore[assignment]
        return self

    @property
    def reduces(self) -> int:
        return self.calls

    def __exit__(self, *exc: object) -> None:
        dist.all_gather_object, collectives._prepare = self.kept  # type: ignore[assignment]
        super().__exit__(*exc)


def metrics(dtype: torch.dtype | None, numbers: list[float]) -> dict[str, Any]:
    if dtype is None:
        return {f"m{i}": float(x) for i, x in enumerate(numbers)}
    return {f"m{i}": torch.tensor(x, dtype=dtype) for i, x in enumerate(numbers)}


def same(got: Any, want: Any) -> bool:
    """Bit for bit: the same keys, leaf types, dtypes and values (NaN equal to NaN)."""
    if type(got) is not type(want) or got.keys() != want.keys():
        return False
    for key, value in want.items():
        mine = got[key]
        if type(mine) is not type(value):
            return False
        if isinstance(value, torch.Tensor):
            if mine.dtype != value.dtype or mine.shape != value.shape:
                return False
            if not torch.equal(mine.nan_to_num(7.0), value.nan_to_num(7.0)):
                return False
        elif not (mine == value or (mine != mine and value != value)):
            return False
    return True


@RANKS
@pytest.mark.slow  # over 2 s: out of the quick tier
def test_the_fast_path_equals_the_general_path_bit_for_bit(dist_ctx: DistContext) -> None:
    rank, n = dist_ctx.rank, dist_ctx.world_size

    @SETTINGS
    @given(
        dtype=st.sampled_from(DTYPES + INTEGERS),
        op=st.sampled_from(["mean", "sum", "prod", "max", "min"]),
        count=st.integers(1, 40),
        seed=st.integers(0, 2**16),
    )
    def check(dtype: torch.dtype | None, op: str, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed * 7 + rank)
        site = Site("steady")
        problems = []
        # float max/min carry a NaN marker, an integer product a float64 sum wire
        # for its flag: those stay on the general path
        integer = dtype in INTEGERS
        fast_path = op != "prod" if integer else op in ("mean", "sum", "prod")
        for step in range(4):
            numbers = (torch.randn(count, generator=generator) * 10 ** (step - 1)).tolist()
            if integer:
                numbers = [float(round(x)) for x in numbers]
            mine = metrics(dtype, numbers)
            with Counted() as counted:
                fast = all_reduce_tree(mine, op, site=site)
            general = all_reduce_tree(mine, op, site=Site("fresh"))  # always the general path
            took = (counted.reduces, counted.gathers, counted.prepares) == (1, 0, 0)
            if step > 0 and fast_path and not took:
                problems.append(f"step {step}: not the fast path {vars(counted)}")
            if not same(fast, general):
                problems.append(f"step {step}: fast {fast} != general {general}")
            if any(fast[key] is mine[key] for key in mine):
                problems.append("a result is this rank's own input object")
        # and against torch's own collective on a float64 buffer, rounded once
        if dtype is not None and not integer and op in ("mean", "sum"):
            flat = torch.tensor(numbers, dtype=dtype).to(torch.float64)
            dist.all_reduce(flat)
            want = (flat / n if op == "mean" else flat).to(dtype)
            if not torch.equal(torch.stack(list(fast.values())), want):
                problems.append(f"fast {fast} != torch's float64 all_reduce {want}")
        agreed = dist_ctx.all_gather(problems)
        assert not any(agreed), agreed

    check()


@RANKS
def test_a_loss_takes_one_collective_and_no_planning_once_steady(dist_ctx: DistContext) -> None:
    site = Site("loss")
    for step in range(3):
        loss = torch.tensor(float(dist_ctx.rank + step))
        with Counted() as counted:
            result = all_reduce_tree(loss, site=site)
        assert result.item() == (dist_ctx.world_size - 1) / 2 + step
    assert (counted.reduces, counted.gathers, counted.prepares) == (1, 0, 0)
    assert site.fast is not None


def steady(dist_ctx: DistContext, fn: Any, calls: int = 3) -> None:
    for _ in range(calls):
        fn(False)
    assert any(site.fast is not None for site in dist_ctx._sites.values())


def error_everywhere(fn: Any, error: type[BaseException]) -> BaseException:
    started = time.monotonic()
    with pytest.raises(error) as raised:
        fn()
    assert time.monotonic() - started < patience(FAST)
    return raised.value


@RANKS
@pytest.mark.parametrize(
    ("changed", "says"),
    [
        ({"loss": torch.tensor(1.0)}, "rank {last} lacks ['acc']"),
        ({"loss": torch.tensor(1.0), "f1": torch.tensor(1.0)}, "lacks ['acc']; adds ['f1']"),
        (
            {"loss": torch.tensor(1.0), "acc": torch.tensor(1.0, dtype=torch.float64)},
            "has ['acc'] as tensor:torch.float64[] mean (rank 0: tensor:torch.float32[] mean)",
        ),
        (
            {"loss": torch.tensor(1.0), "acc": torch.tensor([1.0])},
            "has ['acc'] as tensor:torch.float32[1] mean (rank 0: tensor:torch.float32[] mean)",
        ),
        (
            {"loss": torch.tensor(1.0), "acc": 1.0},
            "has ['acc'] as python:float[] mean (rank 0: tensor:torch.float32[] mean)",
        ),
        ({"acc": torch.tensor(1.0), "loss": torch.tensor(1.0)}, "same leaves in another order"),
    ],
    ids=["fewer-keys", "renamed-key", "dtype", "shape", "leaf-type", "order"],
)
def test_leaving_the_steady_state_on_one_rank_is_an_error_on_every_rank(
    dist_ctx: DistContext, changed: dict[str, Any], says: str
) -> None:
    last = dist_ctx.world_size - 1

    def step(change: bool) -> Any:
        result = {"loss": torch.tensor(float(dist_ctx.rank)), "acc": torch.tensor(0.5)}
        return dist_ctx.all_reduce(changed if change and dist_ctx.rank == last else result)

    steady(dist_ctx, step)
    error = error_everywhere(lambda: step(True), ReductionError)
    assert "ranks returned different structures" in str(error)
    assert says.format(last=last) in str(error)
    # back in step: the agreed structure reduces again, on the fast path
    assert step(False)["loss"].item() == (dist_ctx.world_size - 1) / 2
    with Counted() as counted:
        assert step(False)["acc"].item() == 0.5
    assert (counted.reduces, counted.gathers) == (1, 0)


@RANKS
@pytest.mark.parametrize(
    ("changed", "says"),
    [
        (torch.tensor([1.0]), "tensor:torch.float32[1] mean"),
        (torch.tensor(1.0, dtype=torch.float64), "tensor:torch.float64[] mean"),
        (1.0, "python:float"),
    ],
    ids=["one-element-1d", "float64", "python-float"],
)
def test_a_loss_leaving_the_steady_state_on_one_rank_is_an_error_on_every_rank(
    dist_ctx: DistContext, changed: Any, says: str
) -> None:
    # A steady float32 loss on the CPU is packed from its value alone (no stack): the
    # checks that stack made (0-d, dtype, tensor) must still send any other result to
    # the general path, which names the difference on every rank.
    last = dist_ctx.world_size - 1

    def step(change: bool) -> Any:
        loss = torch.tensor(float(dist_ctx.rank), requires_grad=True) * 1.0  # graph attached
        return dist_ctx.all_reduce(changed if change and dist_ctx.rank == last else loss)

    steady(dist_ctx, step)
    error = error_everywhere(lambda: step(True), ReductionError)
    assert "ranks returned different structures" in str(error)
    assert says in str(error)
    with Counted() as counted:
        back = step(False)
    assert back.item() == (dist_ctx.world_size - 1) / 2
    assert (back.dtype, back.shape, back.requires_grad) == (torch.float32, (), False)
    assert (counted.reduces, counted.gathers) == (1, 0)


@RANKS
def test_every_rank_switching_together_adopts_the_new_structure(dist_ctx: DistContext) -> None:
    rank, n = dist_ctx.rank, dist_ctx.world_size

    def step(dtype: torch.dtype, keys: tuple[str, ...]) -> Any:
        return dist_ctx.all_reduce({key: torch.tensor(float(rank), dtype=dtype) for key in keys})

    for dtype, keys in [
        (torch.float32, ("a", "b")),
        (torch.float64, ("a", "b")),  # another dtype on every rank: agreed again
        (torch.float64, ("a", "b", "c")),  # another key
        (torch.float32, ("a", "b")),  # back to the first: its plan is cached
    ]:
        first = step(dtype, keys)
        with Counted() as counted:
            second = step(dtype, keys)
        assert (counted.reduces, counted.gathers) == (1, 0), (dtype, keys)
        for result in (first, second):
            assert list(result) == list(keys)
            assert all(v.dtype == dtype and v.item() == (n - 1) / 2 for v in result.values())


@RANKS
def test_a_failure_after_steady_state_reaches_every_rank(dist_ctx: DistContext) -> None:
    @ddpctx.all_reduced
    def evaluate(fail: bool) -> dict[str, torch.Tensor]:
        if fail and dist_ctx.rank == 1:
            raise KeyError("shard missing")
        return {"loss": torch.tensor(1.0)}

    for _ in range(3):
        evaluate(False)
    if dist_ctx.rank == 1:
        error_everywhere(lambda: evaluate(True), KeyError)
    else:
        error = error_everywhere(lambda: evaluate(True), ReductionError)
        assert "rank 1: KeyError: 'shard missing'" in str(error)
    assert evaluate(False)["loss"].item() == 1.0


@RANKS
def test_async_handles_on_the_fast_path(dist_ctx: DistContext) -> None:
    rank, n, last = dist_ctx.rank, dist_ctx.world_size, dist_ctx.world_size - 1
    site = Site("async")
    handles = []
    for step in range(6):  # two in flight at a time: read one step later
        loss = {"loss": torch.tensor(float(rank + step)), "n": torch.tensor(1.0)}
        handles.append(all_reduce_tree(loss, site=site, async_op=True))
        if len(handles) > 1:
            done = step - 1
            assert handles.pop(0).result()["loss"].item() == (n - 1) / 2 + done
    assert site.fast is not None
    assert handles.pop().result()["loss"].item() == (n - 1) / 2 + 5
    # a rank changing its structure: every rank raises at .result(), not at the call
    agreed = {"loss": torch.tensor(1.0), "n": torch.tensor(1.0)}
    changed = {"loss": torch.tensor(1.0)}
    handle = all_reduce_tree(changed if rank == last else agreed, site=site, async_op=True)
    with pytest.raises(ReductionError, match="ranks returned different structures"):
        handle.result()


@RANKS
def test_python_floats_and_a_graph_attached_loss_on_the_fast_path(dist_ctx: DistContext) -> None:
    rank, n = dist_ctx.rank, dist_ctx.world_size
    floats, loss_site = Site("floats"), Site("loss")
    weight = torch.tensor(2.0, requires_grad=True)
    for step in range(3):
        result = all_reduce_tree({"lr": 0.1 * step, "loss": float(rank)}, "sum", site=floats)
        assert result == {"lr": pytest.approx(0.1 * step * n), "loss": sum(range(n))}
        assert type(result["loss"]) is float
        loss = all_reduce_tree(weight * rank, site=loss_site)
        assert not loss.requires_grad
        assert loss.item() == n - 1
    assert floats.fast is not None
    assert loss_site.fast is not None


@RANKS
@pytest.mark.slow  # over 2 s: out of the quick tier
def test_a_mixed_dict_of_tensors_and_floats_equals_the_general_path_bit_for_bit(
    dist_ctx: DistContext,
) -> None:
    """``{"loss": tensor, "lr": float, ...}`` with per-key means and sums, as ctx.log sends."""
    rank = dist_ctx.rank

    @SETTINGS
    @given(
        kinds=st.lists(st.sampled_from(DTYPES), min_size=2, max_size=8),
        ops=st.lists(st.sampled_from(["mean", "sum"]), min_size=8, max_size=8),
        seed=st.integers(0, 2**16),
        special=st.sampled_from([None, math.nan, math.inf, -math.inf, 1e39, 0.0]),
    )
    def check(
        kinds: list[torch.dtype | None], ops: list[str], seed: int, special: float | None
    ) -> None:
        generator = torch.Generator().manual_seed(seed * 7 + rank)
        op = {f"m{i}": ops[i] for i in range(len(kinds))}
        site, problems = Site("steady"), []
        for step in range(4):
            numbers = (torch.randn(len(kinds), generator=generator) * 10 ** (step - 1)).tolist()
            if special is not None and step == 3 and rank == 0:
                numbers[seed % len(kinds)] = special
            mine = {
                f"m{i}": float(x) if dtype is None else torch.tensor(x, dtype=dtype)
                for i, (dtype, x) in enumerate(zip(kinds, numbers, strict=True))
            }
            with Counted() as counted:
                fast = all_reduce_tree(mine, op, site=site)
            general = all_reduce_tree(mine, op, site=Site("fresh"))  # always the general path
            # the flag rides as NaN in the first value: a NaN there costs one more collective
            asked = 1 + math.isnan(float(general["m0"]))
            if step > 0 and (counted.reduces, counted.gathers, counted.prepares) != (asked, 0, 0):
                problems.append(f"step {step}: not the fast path {vars(counted)}")
            if not same(fast, general):
                problems.append(f"step {step}: fast {fast} != general {general}")
        agreed = dist_ctx.all_gather(problems)
        assert not any(agreed), agreed

    check()


@RANKS
@pytest.mark.parametrize(
    "change",
    ["a float becomes a tensor", "a tensor's dtype", "a tensor's shape", "a key", "a numpy float"],
)
def test_a_mixed_dict_leaving_the_steady_state_on_one_rank_is_an_error_on_every_rank(
    dist_ctx: DistContext, change: str
) -> None:
    site, last = Site("mixed"), dist_ctx.world_size - 1

    def mine(changed: bool) -> dict[str, Any]:
        result: dict[str, Any] = {"loss": torch.tensor(1.0), "lr": 0.5}
        if not changed:
            return result
        if change == "a float becomes a tensor":
            result["lr"] = torch.tensor(0.5)
        elif change == "a tensor's dtype":
            result["loss"] = torch.tensor(1.0, dtype=torch.float64)
        elif change == "a tensor's shape":
            result["loss"] = torch.ones(1)
        elif change == "a key":
            result = {"loss": result["loss"], "lr2": 0.5}
        else:
            import numpy as np

            result["lr"] = np.float32(0.5)
        return result

    for _ in range(3):
        all_reduce_tree(mine(False), site=site)
    assert site.fast is not None
    assert site.fast.mixed
    error_everywhere(
        lambda: all_reduce_tree(mine(dist_ctx.rank == last), site=site), ReductionError
    )


@RANKS
def test_per_key_means_and_sums_of_floats_stay_right_once_steady(dist_ctx: DistContext) -> None:
    """Regression: the steady state divided every float by the world size, sums too."""
    n, site, tensors = dist_ctx.world_size, Site("per-key"), Site("per-key tensors")
    for _ in range(4):
        got = all_reduce_tree({"a": 1.0, "b": 2.0}, {"a": "mean", "b": "sum"}, site=site)
        assert got == {"a": 1.0, "b": 2.0 * n}
        mixed = {"loss": torch.tensor(1.0), "n": torch.tensor(3.0), "lr": 0.5}
        got = all_reduce_tree(mixed, {"n": "sum"}, site=tensors)
        assert same(got, {"loss": torch.tensor(1.0), "n": torch.tensor(3.0 * n), "lr": 0.5})
    assert site.fast is not None
    assert tensors.fast is not None
    assert tensors.fast.mixed


def test_one_process_fast_path_returns_new_tensors() -> None:
    site = Site("single")
    mine = {"loss": torch.tensor(0.25), "acc": torch.tensor(0.5)}
    for _ in range(3):
        result = all_reduce_tree(mine, site=site)
        assert same(result, mine)
        assert result["loss"] is not mine["loss"]
    assert site.fast is not None
    result["loss"].add_(1)  # a result of its own: the input is untouched
    assert mine["loss"].item() == 0.25


def test_debug_mode_checks_lockstep_through_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPCTX_DEBUG", "collectives")
    monkeypatch.setenv("DDPCTX_HANG_TIMEOUT", "0")
    with pytest.raises(RankError) as caught:
        launch(_steady_then_diverge, world_size=2, timeout=60)
    assert isinstance(caught.value.original, HangError)
    message = str(caught.value.original)
    # which lines it names is the hang doctor's business (tests/test_hang.py)
    assert "ranks are in different collectives on the default group: barrier at" in message
    assert "vs all_reduce at" in message


def _steady_then_diverge() -> None:
    ctx = ddpctx.current()
    assert ctx is not None
    for step in range(4):
        if ctx.rank == 0 and step == 3:
            ctx.barrier()
        else:
            ctx.all_reduce(torch.tensor(1.0))


ONE_VALUE = {
    "tensor": lambda x: torch.tensor(x),
    "float": lambda x: x,
    "dict": lambda x: {"loss": torch.tensor(x, dtype=torch.float64)},
    "bf16": lambda x: torch.tensor(x, dtype=torch.bfloat16),
}


def value_of(result: Any) -> float:
    return float(result["loss"] if isinstance(result, dict) else result)


@RANKS
@pytest.mark.parametrize("kind", sorted(ONE_VALUE))
@pytest.mark.parametrize("op", ["mean", "sum", "prod"])
def test_one_value_travels_alone_and_its_flag_as_nan(
    dist_ctx: DistContext, kind: str, op: str
) -> None:
    # Before: one element more (a flag) per call; gloo takes 1.3-1.5x as long for 2 as for 1.
    rank, n, last = dist_ctx.rank, dist_ctx.world_size, dist_ctx.world_size - 1
    make = ONE_VALUE[kind]
    site = Site(f"one-{kind}-{op}")

    def reduce(value: Any) -> Any:
        return all_reduce_tree(value, op, site=site)

    def reference(values: list[float]) -> float:  # float64, rounded once like the leaf
        exact = torch.tensor(values, dtype=torch.float64)
        total = exact.prod() if op == "prod" else exact.sum()
        total = total / n if op == "mean" else total
        return value_of(make(float(total)))

    for step in range(3):
        mine = 1.5 + rank + step
        with Reductions() as recorded:
            got = value_of(reduce(make(mine)))
        assert got == reference([1.5 + r + step for r in range(n)])
    assert recorded.sizes == [1], recorded.sizes  # steady: one collective of one element
    # a NaN (or +inf with -inf) in the data is data: NaN everywhere, one question more
    for bad in ([float("nan")] + [0.0] * (n - 1), [float("inf"), -float("inf")] + [1.0] * (n - 2)):
        if op == "prod" and bad[0] == float("inf"):
            continue  # inf * -inf is -inf, not NaN
        with Reductions() as recorded:
            got = value_of(reduce(make(bad[rank])))
        assert got != got, got
        assert recorded.sizes == [1, 1], recorded.sizes
    # and the steady state goes on
    assert value_of(reduce(make(2.0))) == reference([2.0] * n)
    # a rank that leaves the structure raises the flag (a NaN): an error on every rank
    other = {"loss": 1.0, "acc": 1.0}
    error = error_everywhere(lambda: reduce(other if rank == last else make(1.0)), ReductionError)
    assert "ranks returned different structures" in str(error)
    assert value_of(reduce(make(2.0))) == reference([2.0] * n)

    # a failing rank, also through an async handle
    def fail() -> None:
        report = ValueError("no batch")
        collectives.report_failure(report, site)
        raise report

    if rank == last:
        error_everywhere(fail, ValueError)
    else:
        error = error_everywhere(lambda: reduce(make(1.0)), ReductionError)
        assert f"rank {last}: ValueError: no batch" in str(error)
    handle = all_reduce_tree(make(float("nan") if rank == 0 else 1.0), op, site=site, async_op=True)
    assert value_of(handle.result()) != value_of(handle.result())
    handle = all_reduce_tree(make(3.0), op, site=site, async_op=True)
    assert value_of(handle.result()) == reference([3.0] * n)


@RANKS
def test_a_rank_out_of_step_at_a_new_site_meets_a_steady_one_value_site_with_an_error(
    dist_ctx: DistContext,
) -> None:
    # Found by attacking the merged engine: rank `last` ran out of data a step early and
    # reduced an end-of-epoch sum at a new call site while the others logged their loss;
    # the others read its flag (1.0) as part of the loss sum and went on: loss=5.5.
    last = dist_ctx.world_size - 1

    @ddpctx.all_reduced
    def train_loss(value: torch.Tensor) -> torch.Tensor:
        return value

    for _ in range(3):
        train_loss(torch.tensor(10.0 * (dist_ctx.rank + 1)))
    if dist_ctx.rank == last:
        error = error_everywhere(
            lambda: dist_ctx.all_reduce(torch.tensor(7.0), op="sum"), ReductionError
        )
    else:
        error = error_everywhere(lambda: train_loss(torch.tensor(1.0)), ReductionError)
    assert "ranks returned different structures" in str(error)
    assert "mean" in str(error)
    assert "sum" in str(error)


@ddpctx.all_reduced(op="sum")
def steady_sum() -> float:
    return 1.0


@ddpctx.all_reduced(op="sum")
def new_sum() -> float:
    return 100.0


@RANKS
def test_a_rank_at_a_new_function_meeting_a_steady_one_of_the_same_structure_is_an_error(
    dist_ctx: DistContext,
) -> None:
    # Found by attacking the merged whole: rank 1 called new_sum (never called) while rank 0
    # called steady_sum, both one float summed: both got 101.0, no error.
    for _ in range(2):
        steady_sum()
    last = dist_ctx.world_size - 1
    error = error_everywhere(steady_sum if dist_ctx.rank != last else new_sum, ReductionError)
    assert "ranks are in different @all_reduced functions" in str(error)
    assert f"rank {last} in all_reduced(tests.test_fastpath.new_sum)" in str(error)
    assert "rank 0 in all_reduced(tests.test_fastpath.steady_sum)" in str(error)
    assert steady_sum() == dist_ctx.world_size  # and the steady site goes on


def nearest(value: float, dtype: torch.dtype) -> torch.Tensor:
    """``value`` rounded once to ``dtype`` (to nearest, ties to even), by exact arithmetic."""
    close = torch.tensor(value, dtype=torch.float64).to(dtype)  # within one ulp of the answer
    candidates = [
        close,
        torch.nextafter(close, torch.tensor(math.inf, dtype=dtype)),
        torch.nextafter(close, torch.tensor(-math.inf, dtype=dtype)),
    ]
    finite = [c for c in candidates if math.isfinite(c.item())]

    def key(candidate: torch.Tensor) -> tuple[Fraction, int]:
        odd = int(candidate.view(torch.int16).item()) & 1 if dtype.itemsize == 2 else 0
        return abs(Fraction(candidate.item()) - Fraction(value)), odd

    return min(finite, key=key)


@given(
    value=st.floats(allow_nan=True, allow_infinity=True, width=64),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
)
def test_a_single_value_is_rounded_back_once_to_its_dtype(value: float, dtype: torch.dtype) -> None:
    # The single-value read-back builds its 0-d tensor with torch.scalar_tensor, which
    # refuses a value outside the dtype's range (such a sum must still come back +-inf);
    # float16 and bfloat16 must not be rounded through float32 first (torch does).
    got = fastpath._scalar(value, dtype, torch.device("cpu"))
    limit = torch.finfo(dtype).max
    if dtype in (torch.float16, torch.bfloat16) and math.isfinite(value) and abs(value) <= limit:
        expected = nearest(value, dtype)
    else:
        expected = torch.tensor(value, dtype=dtype)
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
    assert torch.equal(got, expected) or (got.isnan().item() and expected.isnan().item())


#: Three ranks' values whose exact sum is just below a tie of the dtype; torch's float64 to
#: float16/bfloat16 conversion rounds through float32, lands on the tie and rounds up.
NEAR_TIES = {
    torch.float16: ([1 + 2**-10, 2**-11, -(2**-24)], 1 + 2**-10),
    torch.bfloat16: ([1 + 2**-7, 2**-8, -(2**-30)], 1 + 2**-7),
}


@pytest.mark.distributed(world_size=3, timeout=120)
def test_a_half_precision_sum_at_three_ranks_is_rounded_once(dist_ctx: DistContext) -> None:
    for dtype, (values, expected) in NEAR_TIES.items():
        mine = torch.tensor(values[dist_ctx.rank], dtype=dtype)
        for _ in range(3):  # the first call (general path), then the steady state (fast path)
            assert dist_ctx.all_reduce(mine, op="sum").item() == expected, dtype
            assert dist_ctx.all_reduce({"m": mine, "n": mine}, op="sum")["m"].item() == expected
            assert dist_ctx.all_reduce(mine.reshape(1), op="sum").item() == expected
            handle = dist_ctx.all_reduce(mine, op="sum", async_op=True)
            assert handle.result().item() == expected


def test_a_float32_sum_past_float32s_range_comes_back_inf_on_every_rank() -> None:
    def body() -> list[float]:
        ctx = ddpctx.current()
        assert ctx is not None
        big = torch.tensor(3e38, dtype=torch.float32)
        return [ctx.all_reduce(big, op="sum").item() for _ in range(3)]  # slow, then fast path

    assert launch(body, world_size=2, timeout=60) == [[float("inf")] * 3] * 2


@pytest.mark.distributed(world_size=2, timeout=120)
def test_a_float16_leafs_mean_is_taken_before_rounding_and_its_sum_overflows(
    dist_ctx: DistContext,
) -> None:
    # As the README says: a float16 leaf travels as float64, so its mean does not overflow
    # where a sum-then-divide in float16 would; its sum, rounded back to float16, is inf.
    big = torch.tensor(60000.0, dtype=torch.float16)
    for _ in range(3):
        assert dist_ctx.all_reduce(big).item() == 60000.0
        assert dist_ctx.all_reduce(big, op="sum").item() == math.inf
    large = torch.full((1024,), 60000.0, dtype=torch.float16)  # float64 too, at any size
    assert (dist_ctx.all_reduce(large) == 60000.0).all()
    assert torch.isinf(dist_ctx.all_reduce(large, op="sum")).all()
    big = torch.full((1024,), 3e38, dtype=torch.float32)  # a large float32 leaf: float32
    assert torch.isinf(dist_ctx.all_reduce(big)).all()  # sum then divide, as torch does


def laid_out(base: torch.Tensor, layout: str) -> torch.Tensor:
    """``base`` (4-d) as a caller might hold it: contiguous, or a strided view of it."""
    if layout == "transposed":
        return base.transpose(0, 3)
    if layout == "channels-last":
        return base.contiguous(memory_format=torch.channels_last)
    if layout == "sliced":
        return base[:, :, ::2]
    return base


@RANKS
@pytest.mark.slow  # over 2 s: out of the quick tier
def test_a_large_tensor_is_reduced_through_its_own_clone_as_by_hand_bit_for_bit(
    dist_ctx: DistContext,
) -> None:
    # One large floating tensor: its clone is the buffer (no flat copy, no flag element),
    # divided in place. It must equal the general path and torch's own collective on a
    # clone divided by hand, bit for bit, and leave the input alone.
    rank, n = dist_ctx.rank, dist_ctx.world_size

    @SETTINGS
    @given(
        dtype=st.sampled_from([torch.float32, torch.float64]),
        op=st.sampled_from(["mean", "sum", "prod"]),
        shape=st.tuples(*[st.integers(2, 9)] * 3).map(lambda s: (s[0], s[1], 8, s[2] * 8)),
        layout=st.sampled_from(["contiguous", "transposed", "channels-last", "sliced"]),
        keyed=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def check(
        dtype: torch.dtype, op: str, shape: tuple[int, ...], layout: str, keyed: bool, seed: int
    ) -> None:
        generator = torch.Generator().manual_seed(seed * 7 + rank)
        site = Site("whole")
        problems = []
        for step in range(3):
            base = torch.randn(shape, generator=generator, dtype=dtype) * 10 ** (step - 1)
            value = laid_out(base + (1.0 if op == "prod" else 0.0), layout)
            if value.numel() < 1024:
                return  # small tensors travel as float64: another path
            before = value.clone()
            mine: Any = {"grad": value} if keyed else value
            with Counted() as counted:
                got = all_reduce_tree(mine, op, site=site)
            general = all_reduce_tree(mine, op, site=Site("fresh"))
            if keyed:
                got, general = got["grad"], general["grad"]
            if step > 0 and (counted.reduces, counted.gathers, counted.prepares) != (1, 0, 0):
                problems.append(f"step {step}: not the fast path {vars(counted)}")
            if step > 0 and not (site.fast is not None and site.fast.whole):
                problems.append(f"step {step}: not the whole-tensor path")
            # in the values' order: at 3+ ranks, gloo's ring sums each chunk starting at
            # another rank, so a clone kept in a transposed memory order rounds otherwise
            by_hand = value.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(by_hand, dist.ReduceOp.PRODUCT if op == "prod" else dist.ReduceOp.SUM)
            if op == "mean":
                by_hand.div_(n)
            for name, want in (("the general path", general), ("by hand", by_hand)):
                if (got.dtype, got.shape) != (want.dtype, want.shape):
                    problems.append(f"{got.dtype}{tuple(got.shape)} vs {name}'s")
                elif not torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)):
                    problems.append(f"step {step}: differs from {name}")
            if not torch.equal(value, before) or got.data_ptr() == value.data_ptr():
                problems.append("the input was changed or is the result")
        agreed = dist_ctx.all_gather(problems)
        assert not any(agreed), agreed

    check()


@RANKS
def test_a_large_tensor_leaving_the_steady_state_on_one_rank_is_an_error_on_every_rank(
    dist_ctx: DistContext,
) -> None:
    rank, n, last = dist_ctx.rank, dist_ctx.world_size, dist_ctx.world_size - 1
    site = Site("whole-leaving")

    def reduce(value: Any, **kwargs: Any) -> Any:
        return all_reduce_tree(value, site=site, **kwargs)

    def grad(fill: float = 1.0) -> torch.Tensor:
        return torch.full((64, 32), fill)

    for _ in range(3):
        assert torch.equal(reduce(grad(rank + 1.0)), grad(sum(range(1, n + 1)) / n))
    assert site.fast is not None
    assert site.fast.whole
    # another shape of as many elements, another dtype, a parameter: named on every rank
    for changed, says in (
        (torch.ones(32, 64), "tensor:torch.float32[32, 64] mean"),
        (torch.ones(64, 32, dtype=torch.float64), "tensor:torch.float64[64, 32] mean"),
        (torch.ones(4), "tensor:torch.float32[4] mean"),
    ):
        mine = changed if rank == last else grad()
        error = error_everywhere(lambda: reduce(mine), ReductionError)  # noqa: B023 -- called now
        assert "ranks returned different structures" in str(error)
        assert says in str(error), str(error)
        assert torch.equal(reduce(grad(2.0)), grad(2.0))  # and back in step
    parameter = torch.nn.Parameter(grad(3.0))
    assert torch.equal(reduce(parameter), grad(3.0))  # another type of the same structure
    # a NaN first in the data is data: NaN there, the rest right, one question more
    nan_first = grad(1.0)
    nan_first[0, 0] = float("nan") if rank == 0 else 1.0
    with Reductions() as recorded:
        got = reduce(nan_first)
    assert got[0, 0] != got[0, 0]
    assert torch.equal(got.view(-1)[1:], grad(1.0).view(-1)[1:])
    assert recorded.sizes == [64 * 32, 1], recorded.sizes
    # a failing rank, also through an async handle
    if rank == last:
        report = ValueError("no gradient")

        def fail() -> None:
            collectives.report_failure(report, site)
            raise report

        error_everywhere(fail, ValueError)
    else:
        error = error_everywhere(lambda: reduce(grad()), ReductionError)
        assert f"rank {last}: ValueError: no gradient" in str(error)
    handle = reduce(grad(rank + 1.0), async_op=True)
    assert torch.equal(handle.result(), grad(sum(range(1, n + 1)) / n))


@given(
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
    world=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=60, deadline=None)
def test_a_mean_over_the_ranks_is_the_division_bit_for_bit(
    dtype: torch.dtype, world: int, seed: int
) -> None:
    # Over a power-of-two world it multiplies by 1/world instead (twice as fast): the same bits.
    from ddpctx.reduce.values import mean_over_

    bits = {torch.float16: torch.int16, torch.bfloat16: torch.int16}.get(dtype)
    bits = bits or {torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
    info = torch.iinfo(bits)
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randint(info.min, info.max, (4096,), dtype=bits, generator=generator)
    values = patterns.view(dtype)  # every kind of value: subnormals, infinities, NaNs
    got, want = mean_over_(values.clone(), world), values.clone().div_(world)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0).view(bits), want.nan_to_num(0.0).view(bits))
