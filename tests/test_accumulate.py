"""Gradient accumulation on real ranks: N micro-batches equal one N-times-larger batch, with
exactly one gradient all-reduce per optimizer step (counted by a DDP comm hook)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.data import TensorDataset

from ddpctx import DistContext, distributed

RANKS = pytest.mark.distributed(world_size=[2, 3], timeout=90)

#: float32 sums in another order: the weights agree to this (absolute) tolerance.
TOLERANCE = 1e-6


def data(n: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=generator)
    return TensorDataset(x, x @ torch.arange(6.0).unsqueeze(1) + 0.1)


def model_copy(ctx: DistContext) -> tuple[nn.Module, torch.optim.Optimizer, list[int]]:
    torch.manual_seed(7)
    model = ctx.wrap(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)))
    calls = [0]

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
        calls[0] += 1
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), calls


@RANKS
@pytest.mark.slow
def test_accumulating_n_micro_batches_equals_one_n_times_larger_batch(
    dist_ctx: DistContext,
) -> None:
    every, micro = 4, 3
    dataset = data(every * micro * dist_ctx.world_size * 5)  # 5 optimizer steps per epoch

    big_model, big_optimizer, big_calls = model_copy(dist_ctx)
    big = dist_ctx.dataloader(dataset, batch_size=every * micro, shuffle=True)
    small_model, small_optimizer, small_calls = model_copy(dist_ctx)
    small = dist_ctx.dataloader(dataset, batch_size=micro, shuffle=True)
    accumulation = dist_ctx.accumulate(small_model, every=every, loader=small)

    steps = 0
    for _ in dist_ctx.epochs(2):
        for x, y in big:
            big_optimizer.zero_grad()
            nn.functional.mse_loss(big_model(x), y).backward()
            big_optimizer.step()
        for x, y in small:
            with accumulation as sync:
                (nn.functional.mse_loss(small_model(x), y) / every).backward()
            if sync:
                small_optimizer.step()
                small_optimizer.zero_grad()
                steps += 1

    assert steps == 10
    assert small_calls[0] == steps  # one all-reduce (one bucket) per optimizer step
    assert big_calls[0] == steps
    for mine, theirs in zip(small_model.parameters(), big_model.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=TOLERANCE)


@RANKS
def test_the_last_batch_of_an_epoch_always_syncs(dist_ctx: DistContext) -> None:
    loader = dist_ctx.dataloader(list(range(7 * dist_ctx.world_size)), batch_size=1)
    model, _, calls = model_copy(dist_ctx)
    accumulation = dist_ctx.accumulate(model, every=3, loader=loader)
    pattern = []
    for _ in dist_ctx.epochs(1):
        for _ in loader:
            with accumulation as sync:
                model(torch.ones(1, 6)).sum().backward()
            pattern.append(sync)
    assert pattern == [False, False, True, False, False, True, True]
    assert calls[0] == 3


@RANKS
def test_no_sync_skips_the_all_reduce_only_while_enabled(dist_ctx: DistContext) -> None:
    model, _, calls = model_copy(dist_ctx)
    for enabled in (True, True, False):
        with dist_ctx.no_sync(model, enabled=enabled):
            model(torch.ones(2, 6)).sum().backward()
    assert calls[0] == 1


def test_no_sync_and_accumulate_are_no_ops_on_one_rank_and_for_bare_models() -> None:
    with distributed() as ctx:
        bare = nn.Linear(2, 1)
        with ctx.no_sync(bare):
            bare(torch.ones(1, 2)).sum().backward()
        assert bare.weight.grad is not None
        with pytest.raises(ValueError, match=r"every=0 must be a positive int"):
            ctx.accumulate(bare, every=0)


@pytest.mark.distributed(world_size=2, timeout=90)
def test_a_nested_accumulation_block_is_refused_and_ddp_keeps_syncing(
    dist_ctx: DistContext,
) -> None:
    model, _, calls = model_copy(dist_ctx)
    accumulation = dist_ctx.accumulate(model, every=2)
    with accumulation as sync:
        assert not sync  # the first of two micro-batches: no all-reduce
        with pytest.raises(RuntimeError, match=r"cannot be nested"), accumulation:
            pass
        model(torch.ones(2, 6)).sum().backward()
    with accumulation as sync:
        assert sync
        model(torch.ones(2, 6)).sum().backward()
    model(torch.ones(2, 6)).sum().backward()  # outside any block: DDP all-reduces as usual
    assert calls[0] == 2
