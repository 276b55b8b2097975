"""The Kronos-style helper names, in one process (the 2-rank mean is in test_torchrun)."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch
import torch.distributed as dist

import ddpctx
from ddpctx import cleanup_ddp, format_time, get_model_size, reduce_tensor, set_seed, setup_ddp


def test_setup_and_cleanup_ddp_without_a_launcher() -> None:
    assert setup_ddp() == (0, 1, 0)
    assert dist.is_initialized()
    assert setup_ddp() == (0, 1, 0)  # a second call reuses the active context
    cleanup_ddp()
    assert not dist.is_initialized()
    assert ddpctx.current() is None
    cleanup_ddp()  # safe when nothing is active


def test_set_seed_offsets_by_rank() -> None:
    set_seed(10, rank=3)
    drawn = (random.random(), torch.rand(1).item())
    random.seed(13)
    torch.manual_seed(13)
    assert drawn == (random.random(), torch.rand(1).item())


@pytest.mark.parametrize(
    ("seed", "rank", "expected"),
    [
        (None, 0, "seed=None"),
        ("1", 0, "seed='1' (str) is not an int"),
        (1, -2, "rank=-2 must be a non-negative int"),
        (2**32 - 1, 1, "outside [0, 4294967295]"),
    ],
)
def test_set_seed_rejects_bad_values(seed: object, rank: object, expected: str) -> None:
    with pytest.raises(ValueError, match=re.escape(expected)):
        set_seed(seed, rank)  # type: ignore[arg-type]


def test_reduce_tensor_without_a_group_copies_and_never_mutates() -> None:
    value = torch.tensor([2, 4])
    result = reduce_tensor(value)
    assert result.dtype == torch.get_default_dtype()  # a mean of ints is a float
    assert result.tolist() == [2.0, 4.0]
    assert value.tolist() == [2, 4]
    assert result.data_ptr() != value.data_ptr()


def test_reduce_tensor_in_a_world_of_one_for_every_op() -> None:
    with ddpctx.distributed():
        value = torch.tensor([1.5, -2.0])
        for op in ("mean", "avg", "sum", "max", "min", "prod"):
            assert reduce_tensor(value, op=op).tolist() == [1.5, -2.0]
        assert value.tolist() == [1.5, -2.0]


def test_reduce_tensor_checks_its_arguments() -> None:
    with pytest.raises(
        ValueError, match=r"op='average': 'average' is not a reduction. Use one of 'mean'"
    ):
        reduce_tensor(torch.ones(1), op="average")
    with pytest.raises(ValueError, match=r"world_size=4 but the process group has 1 rank"):
        reduce_tensor(torch.ones(1), world_size=4)
    with pytest.raises(TypeError, match=r"needs a torch\.Tensor, got list"):
        reduce_tensor([1.0])  # type: ignore[arg-type]


class _Sized(torch.nn.Module):
    def __init__(self, trainable: int, frozen: int) -> None:
        super().__init__()
        self.trainable = torch.nn.Parameter(torch.empty(trainable, device="meta"))
        self.frozen = torch.nn.Parameter(torch.empty(frozen, device="meta"), requires_grad=False)


@pytest.mark.parametrize(
    ("count", "text"),
    [(24_714_690, "24.7M"), (999, "999"), (1_500, "1.5K"), (3_200_000_000, "3.2B")],
)
def test_get_model_size_counts_trainable_parameters(count: int, text: str) -> None:
    assert get_model_size(_Sized(count, frozen=5_000_000)) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0:00:00"), (59.99, "0:00:59"), (3725.9, "1:02:05"), (90_000, "25:00:00")],
)
def test_format_time(seconds: float, text: str) -> None:
    assert format_time(seconds) == text


@pytest.mark.parametrize("seconds", [-1, math.nan])
def test_format_time_rejects_negative_and_nan(seconds: float) -> None:
    with pytest.raises(ValueError, match="must be a non-negative duration"):
        format_time(seconds)
