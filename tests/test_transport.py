"""How a reduction's buffer crosses the ranks (ddpctx.reduce.transport), on real gloo ranks.

At 2 ranks a buffer of 3 elements to 64 KiB goes by one ``all_gather`` and a local
reduction; the result must be torch's own ``all_reduce`` bit for bit, synchronous or
async. Below 3 elements, above 64 KiB and at 3 ranks, torch's ``all_reduce`` is used.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpctx import DistContext
from ddpctx.reduce import transport
from tests.helpers import Reductions

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Kinds:
    """Which torch collective each call used (the real ones run)."""

    def __enter__(self) -> list[str]:
        self.originals, self.names = (dist.all_reduce, dist.all_gather), []

        def all_reduce(*args: Any, **kwargs: Any) -> Any:
            self.names.append("all_reduce")
            return self.originals[0](*args, **kwargs)

        def all_gather(*args: Any, **kwargs: Any) -> Any:
            self.names.append("all_gather")
            return self.originals[1](*args, **kwargs)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather  # type: ignore[assignment]
        return self.names

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce, dist.all_gather = self.originals  # type: ignore[assignment]


@pytest.mark.distributed(world_size=[2, 3], timeout=60)
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("count", [1, 2, 3, 32, 8192, 8193])
def test_a_buffer_reduces_as_torchs_all_reduce_bit_for_bit_by_the_way_its_size_picks(
    dist_ctx: DistContext, op: str, async_op: bool, count: int
) -> None:
    generator = torch.Generator().manual_seed(dist_ctx.rank + 17 * count)
    mine = torch.randn(count, generator=generator, dtype=torch.float64) * 1e3
    want = mine.clone()
    dist.all_reduce(want, op=OPS[op])
    buffer = mine.clone()
    with Kinds() as used:
        handle = transport.all_reduce(buffer, op, async_op=async_op)
        if async_op:
            handle.wait()
    gathered = dist_ctx.world_size == 2 and count >= 3 and count * 8 <= 64 * 1024
    assert used == ["all_gather" if gathered else "all_reduce"]
    assert torch.equal(buffer, want)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_32_metrics_at_two_ranks_are_one_gather_and_torchs_sum(dist_ctx: DistContext) -> None:
    metrics = {f"m{i}": torch.tensor(i + 0.1 * dist_ctx.rank) for i in range(32)}
    site_result = None
    for _ in range(3):  # the steady state from the second call
        with Reductions() as counted:
            site_result = dist_ctx.all_reduce(metrics, op="sum")
    assert counted.sizes == [32]
    want = torch.stack(list(metrics.values())).to(torch.float64)
    dist.all_reduce(want)
    assert site_result is not None
    assert torch.equal(torch.stack(list(site_result.values())), want.to(torch.float32))
