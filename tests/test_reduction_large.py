"""One large floating tensor: reduced as torch reduces it, in one buffer the tensor's length.

A single floating leaf summed or multiplied carries the protocol's flag as a
NaN in its first value, so its buffer is the tensor's one copy: the same
layout as a hand-written ``clone`` + ``all_reduce``, so the same sums, bit for
bit, at any world size. These tests pin that, and that the promises around it
hold: a new tensor (never a view of the input, which is never written to),
its dtype, shape and device; a NaN in the data stays data; another shape or a
failure on one rank is an error on every rank.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ddpctx import DistContext, ReductionError
from ddpctx.reduce.collectives import Site, all_reduce_tree
from tests.helpers import Reductions, patience

SETTINGS = settings(
    max_examples=12,
    derandomize=True,  # the same examples on every rank
    database=None,
    deadline=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
)
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT}


def by_hand(tensor: torch.Tensor, op: str, world: int) -> torch.Tensor:
    """What a user writes for the same semantics: clone, all_reduce, divide for a mean."""
    reduced = tensor.clone()
    dist.all_reduce(reduced, op=TORCH_OPS[op])
    return reduced.div_(world) if op == "mean" else reduced


@st.composite
def large_tensors(draw: st.DrawFn) -> dict[str, Any]:
    """A large floating tensor's shape and dtype, an op, and a seed for its values."""
    shape = draw(st.sampled_from([(1024,), (4097,), (32, 40), (3, 7, 50), (2, 1, 2048), (1030, 1)]))
    return {
        "shape": shape,
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "op": draw(st.sampled_from(["mean", "sum", "prod"])),
        "grad": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**30)),
    }


@pytest.mark.distributed(world_size=[2, 3], timeout=120)
def test_one_large_tensor_is_reduced_bit_for_bit_as_by_hand_in_one_buffer_its_length(
    dist_ctx: DistContext,
) -> None:
    rank, world = dist_ctx.rank, dist_ctx.world_size

    @SETTINGS
    @given(case=large_tensors())
    def check(case: dict[str, Any]) -> None:
        generator = torch.Generator().manual_seed(case["seed"] * 8 + rank)
        mine = torch.randn(case["shape"], generator=generator, dtype=case["dtype"])
        if case["op"] == "prod":  # near 1: a product of three stays finite
            mine = 1 + mine / 100
        mine.requires_grad_(case["grad"])
        before = mine.detach().clone()
        site = Site(f"large-{case['shape']}-{case['dtype']}-{case['op']}")
        problems = []
        for _ in range(2):  # the first call agrees, the second is the steady state
            with Reductions() as recorded:
                ours = all_reduce_tree(mine, case["op"], site=site)
            want = by_hand(mine.detach(), case["op"], world)
            if not torch.equal(ours, want):
                problems.append("differs from clone + all_reduce")
            if (ours.dtype, ours.shape, ours.device) != (want.dtype, want.shape, want.device):
                problems.append(f"came back as {ours.dtype} {tuple(ours.shape)} {ours.device}")
            if ours.untyped_storage().data_ptr() == mine.untyped_storage().data_ptr():
                problems.append("a view of the input")
            if ours.requires_grad:
                problems.append("attached to the input's graph")
            if not torch.equal(mine.detach(), before):
                problems.append("the input was written to")
        if recorded.sizes != [mine.numel()]:
            problems.append(f"steady state sent {recorded.sizes}, not one buffer of {mine.numel()}")
        agreed = dist_ctx.all_gather(problems)
        assert not any(agreed), (case, agreed)

    check()


def test_one_large_tensor_without_a_group_comes_back_as_a_new_tensor() -> None:
    tensor = torch.randn(2048)
    before = tensor.clone()
    site = Site("large-alone")
    for _ in range(2):
        got = all_reduce_tree(tensor, "mean", site=site)
        assert torch.equal(got, before)
        assert torch.equal(tensor, before)
        assert got.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    got.add_(1)
    assert torch.equal(tensor, before)  # a snapshot: writing to it leaves the input be


def error_everywhere(fn: Any) -> ReductionError:
    started = time.monotonic()
    with pytest.raises(ReductionError) as raised:
        fn()
    assert time.monotonic() - started < patience(30)
    return raised.value


@pytest.mark.distributed(world_size=[2, 3], timeout=120)
def test_a_1m_tensor_meeting_another_shape_or_a_failure_is_an_error_on_every_rank(
    dist_ctx: DistContext,
) -> None:
    rank, world, last = dist_ctx.rank, dist_ctx.world_size, dist_ctx.world_size - 1
    big = torch.full((1_000_000,), float(rank + 1))
    mean = sum(range(1, world + 1)) / world
    other = torch.ones(500_000)
    # at a new site: rank `last` sends another shape from the first call on
    fresh = Site("large-fresh")
    error = error_everywhere(lambda: all_reduce_tree(other if rank == last else big, site=fresh))
    assert "ranks returned different structures" in str(error)
    assert "torch.float32[500000]" in str(error)
    assert "torch.float32[1000000]" in str(error)
    # steady, then rank `last` changes shape: its raised flag is a NaN in the first value
    site = Site("large-steady")
    for _ in range(2):
        assert torch.equal(all_reduce_tree(big, site=site), torch.full_like(big, mean))
    error = error_everywhere(lambda: all_reduce_tree(other if rank == last else big, site=site))
    assert "ranks returned different structures" in str(error)
    # a NaN in the first value of the data is data: one question more, then NaN there
    nan_first = big.clone()
    nan_first[0] = float("nan") if rank == 0 else 1.0
    with Reductions() as recorded:
        got = all_reduce_tree(nan_first, site=site)
    assert recorded.sizes == [1_000_000, 1], recorded.sizes
    assert got[0] != got[0]
    assert torch.equal(got[1:], torch.full_like(big[1:], mean))
    # the steady state goes on, one buffer of the tensor's length
    with Reductions() as recorded:
        assert torch.equal(all_reduce_tree(big, site=site), torch.full_like(big, mean))
    assert recorded.sizes == [1_000_000]
    # a failure on one rank reaches every rank
    from ddpctx.reduce.collectives import report_failure

    def fail_on_last() -> Any:
        if rank == last:
            report_failure(ValueError("no data on this rank"), site)
            raise ReductionError("this rank failed")
        return all_reduce_tree(big, site=site)

    error = error_everywhere(fail_on_last)
    if rank != last:
        assert f"rank {last} could not reduce its result" in str(error)
    assert torch.equal(all_reduce_tree(big, site=site), torch.full_like(big, mean))
