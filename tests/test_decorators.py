"""The decorators in one process: with no process group, and inside distributed()."""

from __future__ import annotations

import functools
import inspect
import math
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from ddpctx import all_reduced, distributed, rank_zero_first, rank_zero_only


def test_rank_zero_only_keeps_name_doc_signature_and_wrapped() -> None:
    def save(path: str, *, overwrite: bool = False) -> str:
        """Write the checkpoint."""
        return path

    for decorated in (rank_zero_only(save), rank_zero_only(barrier=True)(save)):
        assert decorated.__name__ == "save"
        assert decorated.__doc__ == "Write the checkpoint."
        assert decorated.__wrapped__ is save  # type: ignore[attr-defined]
        assert inspect.signature(decorated) == inspect.signature(save)


def test_all_reduced_keeps_name_doc_signature_and_wrapped() -> None:
    def evaluate(loader: list[int]) -> float:
        """Mean loss."""
        return 0.0

    decorated = all_reduced(op="sum")(evaluate)
    assert (decorated.__name__, decorated.__doc__) == ("evaluate", "Mean loss.")
    assert decorated.__wrapped__ is evaluate  # type: ignore[attr-defined]
    assert inspect.signature(decorated) == inspect.signature(evaluate)


def test_without_a_group_rank_zero_only_runs_on_rank_zero() -> None:
    assert rank_zero_only(lambda: "ran")() == "ran"
    assert rank_zero_only(broadcast=True)(lambda: 7)() == 7
    assert rank_zero_only(barrier=True, default="x")(lambda: "ran")() == "ran"


def test_without_a_group_other_ranks_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert rank_zero_only(lambda: "ran")() is None
    assert rank_zero_only(default=0)(lambda: 5)() == 0
    assert rank_zero_only(local=True)(lambda: "ran")() is None
    with rank_zero_first():  # no group to wait on: the block simply runs
        pass


def test_a_malformed_rank_is_a_loud_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"RANK='zero' is not an integer"):
        rank_zero_only(lambda: None)()


def test_rank_zero_exception_propagates_unchanged_without_a_group() -> None:
    error = OSError("disk full")

    def fail() -> None:
        raise error

    with pytest.raises(OSError, match="disk full") as raised:
        rank_zero_only(barrier=True)(fail)()
    assert raised.value is error


def test_rank_zero_first_without_a_group_runs_and_propagates() -> None:
    ran = []
    with rank_zero_first():
        ran.append(True)
    assert ran == [True]
    with pytest.raises(RuntimeError, match="download failed"), rank_zero_first():
        raise RuntimeError("download failed")


def test_all_reduced_without_a_group_returns_the_same_values_and_kinds() -> None:
    result = all_reduced(
        lambda: OrderedDict(loss=torch.tensor([1.0, 2.0]), n=3, acc=np.float32(0.5))
    )()
    assert isinstance(result, OrderedDict)
    assert torch.equal(result["loss"], torch.tensor([1.0, 2.0]))
    assert result["n"] == 3.0
    assert isinstance(result["n"], float)  # an int under "mean" becomes a float
    assert isinstance(result["acc"], np.float32)


def test_weighted_mean_with_zero_weight_is_nan_in_one_process() -> None:
    result = all_reduced(weight="count")(lambda: {"loss": torch.tensor(1.0), "count": 0})()
    assert math.isnan(result["loss"].item())
    assert result["count"] == 0


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"op": "avg"}, "op='avg': 'avg' is not a reduction. Use one of 'mean'"),
        ({"op": {"loss": "median"}}, "'median' is not a reduction"),
        ({"weight": 3}, "weight=3 must be the name of a leaf"),
    ],
)
def test_bad_decorator_options_fail_at_decoration(kwargs: dict[str, object], expected: str) -> None:
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        all_reduced(**kwargs)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("result", "kwargs", "error", "expected"),
    [
        ({"loss": 1.0, "tag": "best"}, {}, TypeError, "['tag'] is str 'best'"),
        ({"a": [1.0, None]}, {}, TypeError, "['a'][1] is NoneType None"),
        ({"x": torch.tensor(1j)}, {}, TypeError, "['x'] is a complex tensor (torch.complex64)"),
        ("text", {}, TypeError, "the result is str 'text'"),
        ({"loss": 1.0}, {"weight": "count"}, ValueError, "['loss'] has no 'count' leaf"),
        ({"loss": 1.0}, {"op": {"los": "max"}}, ValueError, "names ['los'], which the result"),
        (
            {"count": 1, "l": 1.0},
            {"weight": "count", "op": {"count": "max"}},
            ValueError,
            "['count'] is the weight leaf",
        ),
        ({"l": 1.0, "count": [1, 2]}, {"weight": "count"}, ValueError, "['count'][0]"),
    ],
)
def test_bad_results_name_the_leaf(
    result: object, kwargs: dict[str, object], error: type[Exception], expected: str
) -> None:
    with pytest.raises(error) as raised:
        all_reduced(**kwargs)(lambda: result)()  # type: ignore[call-overload]
    assert expected in str(raised.value)


def test_inside_distributed_every_form_works_with_one_rank() -> None:
    with distributed() as ctx:
        assert all_reduced(op="sum")(lambda: [1, 2])() == [1, 2]
        assert ctx.all_reduce({"loss": 2.0, "count": 5}, weight="count") == {
            "loss": 2.0,
            "count": 5,
        }
        assert ctx.broadcast({"a": 1}) == {"a": 1}
        assert ctx.all_gather("x") == ["x"]
        with ctx.rank_zero_first(local=True):
            pass
        with pytest.raises(ValueError, match=r"src=1 is not a rank of this group; use 0\.\.0"):
            ctx.broadcast(1, src=1)


def _generator() -> Iterator[int]:
    yield 1


async def _coroutine() -> int:
    return 1


async def _async_generator() -> AsyncIterator[int]:
    yield 1


@pytest.mark.parametrize(
    ("func", "kind"),
    [
        (_generator, "a generator function"),
        (_coroutine, "an async function"),
        (_async_generator, "an async generator function"),
        (functools.partial(_generator), "a generator function"),
    ],
)
@pytest.mark.parametrize("option", ["barrier", "broadcast"])
def test_rank_zero_only_with_a_wait_refuses_a_lazy_body_when_decorating(
    func: Callable[..., Any], kind: str, option: str
) -> None:
    # Found by an outside user: with barrier=True on a generator, rank 1 returned before
    # rank 0's body ran, and an exception there reached rank 0 only.
    with pytest.raises(TypeError, match=f"rank_zero_only\\({option}=True\\) cannot wrap") as raised:
        rank_zero_only(**{option: True})(func)
    assert f"it is {kind}" in str(raised.value)
    assert "_generator" in str(raised.value) or "_coroutine" in str(raised.value)
    assert "Decorate a plain function" in str(raised.value)


def test_plain_rank_zero_only_still_wraps_a_generator_function() -> None:
    assert list(rank_zero_only(_generator)()) == [1]  # no wait: nothing to mislead
