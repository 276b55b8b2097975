"""Distributed unit tests in the styles of DeepSpeed's and Lightning's suites, on the plugin.

Written for ddpctx (not copied): the shapes those suites use -- a class whose
tests all run on N ranks, world sizes as parameters (some marked slow), a
test that forms its own group, fixtures that set the environment, ``capsys``
and ``-s`` output per rank -- each checked against real gloo ranks.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ddpctx
from ddpctx import DistContext

pytestmark = pytest.mark.timeout(240)


@pytest.mark.distributed(world_size=2)
class TestCollectivesOnTwoRanks:
    """DeepSpeed style: every test of the class runs on the class's world size."""

    def test_all_reduce_sum(self, dist_ctx: DistContext) -> None:
        value = torch.tensor([float(dist_ctx.rank + 1)])
        dist.all_reduce(value)
        assert value.item() == 3.0

    def test_broadcast_from_rank_zero(self, dist_ctx: DistContext) -> None:
        value = torch.tensor([42.0 if dist_ctx.rank == 0 else -1.0])
        dist.broadcast(value, src=0)
        assert value.item() == 42.0

    def test_all_gather_objects_of_uneven_size(self, dist_ctx: DistContext) -> None:
        gathered = dist_ctx.all_gather(list(range(dist_ctx.rank + 1)))
        assert gathered == [[0], [0, 1]]


@pytest.mark.distributed(world_size=[1, 2, pytest.param(3, marks=pytest.mark.slow)])
class TestAcrossWorldSizes:
    """Lightning style: one test per world size; the largest only in slow runs."""

    def test_mean_of_ranks(self, dist_ctx: DistContext, dist_world_size: int) -> None:
        mean = dist_ctx.all_reduce(float(dist_ctx.rank), op="mean")
        assert mean == sum(range(dist_world_size)) / dist_world_size

    def test_ddp_keeps_replicas_identical(self, dist_ctx: DistContext) -> None:
        torch.manual_seed(dist_ctx.rank)  # different data per rank
        model = dist_ctx.wrap(torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        weights = dist_ctx.all_gather(dist_ctx.unwrap(model).weight.detach())
        assert all(torch.equal(weights[0], other) for other in weights)


@pytest.fixture
def shard_sizes(dist_world_size: int) -> list[int]:
    """A fixture that depends on the world size, as data-sharding fixtures do."""
    return [10 // dist_world_size] * dist_world_size


@pytest.mark.distributed(world_size=[1, 2])
def test_fixture_sized_by_the_world_size(dist_ctx: DistContext, shard_sizes: list[int]) -> None:
    assert len(shard_sizes) == dist_ctx.world_size


@pytest.mark.distributed(world_size=2, init=False)
def test_code_that_forms_its_own_group() -> None:
    """DeepSpeed's init_distributed=False: the code under test calls init_process_group."""
    assert not dist.is_initialized()
    assert {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= set(os.environ)
    dist.init_process_group("gloo")
    try:
        subgroup = dist.new_group([0, 1])
        value = torch.ones(1)
        dist.all_reduce(value, group=subgroup)
        assert value.item() == 2.0
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed(world_size=2, init=False)
def test_code_that_enters_distributed_itself() -> None:
    with ddpctx.distributed(seed=3) as ctx:
        assert ctx.launcher == "launch"
        assert ctx.seed == 3 + ctx.rank


@pytest.fixture
def offline_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_LIBRARY_OFFLINE", "1")


@pytest.mark.distributed(world_size=2)
def test_environment_from_a_fixture_reaches_every_rank(
    dist_ctx: DistContext, offline_mode: None
) -> None:
    flags = dist_ctx.all_gather(os.environ.get("MY_LIBRARY_OFFLINE"))
    assert flags == ["1", "1"]


@pytest.mark.distributed(world_size=2)
def test_capsys_inside_each_rank(dist_ctx: DistContext, capsys: pytest.CaptureFixture[str]) -> None:
    dist_ctx.print("only rank 0 prints this")
    expected = "only rank 0 prints this\n" if dist_ctx.is_main else ""
    assert capsys.readouterr().out == expected


@pytest.mark.distributed(world_size=2)
async def test_a_coroutine_test(dist_ctx: DistContext) -> None:
    import asyncio

    assert await asyncio.sleep(0, result=dist_ctx.rank) == dist_ctx.rank


@pytest.mark.distributed(world_size=2, isolated=True)
def test_isolated_when_a_test_changes_module_globals(dist_ctx: DistContext) -> None:
    torch.set_printoptions(precision=2)  # global state the warm pool could not undo


@pytest.mark.slow
def test_per_rank_output_is_streamed_with_dash_s(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_logging="""
        import pytest

        @pytest.mark.distributed(world_size=2)
        class TestTraining:
            def test_logs_each_step(self, dist_ctx):
                for step in range(3):
                    print(f"step {step} loss {1.0 / (step + 1):.2f}")
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", timeout=150)
    result.assert_outcomes(passed=1)
    for rank in (0, 1):
        result.stdout.fnmatch_lines([f"[[]rank {rank}[]] step 2 loss 0.33"])


@pytest.mark.distributed(world_size=2, isolated=True)
def test_ranks_start_with_what_ddps_constructor_imports_already_loaded() -> None:
    """DDP's constructor imports torch._dynamo (seconds): the pytest process pays it once."""
    import sys

    assert "torch._dynamo" in sys.modules
