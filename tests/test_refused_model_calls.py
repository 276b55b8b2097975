"""A model's collectives inside rank-zero-only work are refused at once, on every rank.

``ctx.full_state_dict`` and ``ctx.clip_grad_norm_`` of a sharded model gather
its shards (reduce its gradient norm) through DTensor's functional
collectives; ``ctx.load_checkpoint`` and ``ctx.save_checkpoint`` concern every
rank's state. Inside ``ctx.rank_zero()``, ``ctx.atomic_dir()`` or a
``@rank_zero_only`` function only rank 0 runs them, so they waited for the
collective timeout (sharded), or restored rank 0 alone and left its replica
apart from the others' (a ``ctx.wrap`` model). Each test runs real ranks with a
real gloo group, a collective timeout far longer than the test's own, and
checks that the error comes at once on every rank, naming the user's call and
line, and that the ranks are still in step afterwards; under debug mode too,
where a rank alone in a sharded gather used to die by SIGABRT.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ddpctx
from ddpctx import DistContext, HangError, RankZeroError
from tests.helpers import patience
from tests.test_refused_callers import (
    FAST,
    in_atomic_dir,
    in_barrier_function,
    in_rank_zero_block,
    refused_at_once,
)

#: A collective timeout far past the test's (60 s): a refusal within the test is no timeout.
TIMEOUT_S = 900


def in_form(form: str, ctx: DistContext, call: Callable[[DistContext], Any], where: Path) -> None:
    """Run ``call`` in the rank-zero work ``form`` names."""
    if form == "ctx.atomic_dir()":
        in_atomic_dir(ctx, call, where)
    elif form == "ctx.rank_zero()":
        in_rank_zero_block(ctx, call)
    else:
        in_barrier_function(ctx, call)


#: Each form, and how the refusal names it.
FORMS = {
    "ctx.rank_zero()": "inside a ctx.rank_zero() block",
    "ctx.atomic_dir()": "inside a ctx.atomic_dir() block",
    "rank_zero_only(barrier=True)": "inside rank_zero_only function",
}


def sharded(ctx: DistContext) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A sharded model that has gradients, and its optimizer."""
    torch.manual_seed(0)
    model = ctx.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)), blocks=[nn.Linear])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    return model, optimizer


SHARDED_CALLS: dict[str, Callable[[DistContext, nn.Module, Path], Any]] = {
    "ctx.full_state_dict()": lambda ctx, model, run: ctx.full_state_dict(model),
    "ctx.clip_grad_norm_()": lambda ctx, model, run: ctx.clip_grad_norm_(model, max_norm=1.0),
    "ctx.load_checkpoint()": lambda ctx, model, run: ctx.load_checkpoint(run, model=model),
}


@pytest.mark.distributed(world_size=2, timeout=60, init=False)
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("call", sorted(SHARDED_CALLS))
def test_a_sharded_models_collective_inside_rank_zero_work_is_refused_at_once_on_every_rank(
    tmp_path: Path, call: str, form: str, debug: bool
) -> None:
    # Found in use: each waited for the collective timeout (10 min by default) where the
    # troubleshooting guide promises a refusal at once; under DDPCTX_DEBUG=collectives rank 1
    # died by SIGABRT (rank 0's gather met its debug check).
    with ddpctx.distributed(timeout=TIMEOUT_S, debug=debug) as ctx:
        model, optimizer = sharded(ctx)
        run = tmp_path / "run"
        ctx.save_checkpoint(run, model=model, optimizer=optimizer)  # something to load
        work = SHARDED_CALLS[call]
        expected = RuntimeError if ctx.rank == 0 else RankZeroError
        error = refused_at_once(
            lambda: in_form(form, ctx, lambda c: work(c, model, run), tmp_path), expected
        )
        assert f"{call} was called {FORMS[form]}" in str(error), str(error)
        assert "test_refused_model_calls.py" in str(error)  # the user's line
        assert "Call it before or after the rank-zero work, on every rank" in str(error)
        # still in step: every rank gathers, clips and loads together
        state = ctx.full_state_dict(model)
        assert sorted(state) == (
            ["0.bias", "0.weight", "1.bias", "1.weight"] if ctx.rank == 0 else []
        )
        assert ctx.clip_grad_norm_(model, max_norm=1e9) > 0
        assert ctx.load_checkpoint(run, model=model, optimizer=optimizer) is not None
        assert ctx.all_reduce(1.0, op="sum") == float(ctx.world_size)


@pytest.mark.distributed(world_size=2, timeout=60)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_loading_a_wrapped_model_inside_rank_zero_work_is_refused_on_every_rank(
    dist_ctx: DistContext, tmp_path: Path, form: str
) -> None:
    # Found in use: it returned without an error and restored rank 0 alone; after the next
    # step the replicas differed by 1.0.
    torch.manual_seed(dist_ctx.rank)
    model = dist_ctx.wrap(nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    run = tmp_path / "run"
    dist_ctx.save_checkpoint(run, model=model, optimizer=optimizer)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # the model moves on from the checkpoint, on every rank alike

    def load(ctx: DistContext) -> None:
        ctx.load_checkpoint(run, model=model, optimizer=optimizer)

    expected = RuntimeError if dist_ctx.rank == 0 else RankZeroError
    error = refused_at_once(lambda: in_form(form, dist_ctx, load, tmp_path), expected)
    assert f"ctx.load_checkpoint() was called {FORMS[form]}" in str(error), str(error)
    assert "test_refused_model_calls.py" in str(error)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = dist_ctx.all_gather(weights)
    assert all(torch.equal(theirs, everyone[0]) for theirs in everyone)  # replicas agree


@pytest.mark.distributed(world_size=2, timeout=60)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_clipping_a_ddp_model_inside_rank_zero_work_is_refused_on_every_rank(
    dist_ctx: DistContext, tmp_path: Path, form: str
) -> None:
    # Found in use: accepted; rank 0's gradients alone were clipped and after
    # optimizer.step() the replicas differed (by up to 2.94), with no error anywhere.
    model = dist_ctx.wrap(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.full((2, 4), 10.0)).sum().backward()  # a norm far over max_norm below

    def clip(ctx: DistContext) -> None:
        ctx.clip_grad_norm_(model, max_norm=0.1)

    expected = RuntimeError if dist_ctx.rank == 0 else RankZeroError
    error = refused_at_once(lambda: in_form(form, dist_ctx, clip, tmp_path), expected)
    assert f"ctx.clip_grad_norm_() was called {FORMS[form]}" in str(error), str(error)
    assert "test_refused_model_calls.py" in str(error)
    assert "before or after the rank-zero work, on every rank" in str(error)
    optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = dist_ctx.all_gather(weights)
    assert all(torch.equal(theirs, everyone[0]) for theirs in everyone)  # replicas agree


def forward_of(model: nn.Module) -> torch.Tensor:
    return model(torch.ones(2, 4))  # the refused line


#: ``file:line`` of the forward in :func:`forward_of`, which the refusal names.
FORWARD_LINE = f"test_refused_model_calls.py:{forward_of.__code__.co_firstlineno + 1}"


def with_buffers(ctx: DistContext, how: str) -> nn.Module:
    """A model with buffers (DDP broadcasts them in each forward), wrapped or sharded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    return ctx.wrap(model) if how == "ctx.wrap()" else ctx.shard(model, blocks=[nn.Linear])


@pytest.mark.distributed(world_size=2, timeout=60, init=False)
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("how", ["ctx.wrap()", "ctx.shard()"])
def test_a_parallel_models_forward_inside_rank_zero_work_is_refused_at_once_naming_the_line(
    tmp_path: Path, how: str, form: str
) -> None:
    # Found in use: under DDP the job ended after 8-11 s with rank 1 blamed (SIGABRT, gloo's
    # "collective mismatch"); a sharded model waited for the collective timeout.
    with ddpctx.distributed(timeout=TIMEOUT_S) as ctx:
        model = with_buffers(ctx, how)
        expected = RuntimeError if ctx.rank == 0 else RankZeroError
        error = refused_at_once(
            lambda: in_form(form, ctx, lambda c: forward_of(model), tmp_path), expected
        )
        kind = "a DDP model" if how == "ctx.wrap()" else "a sharded model"
        assert f"the forward of {kind} (model(...)) was called {FORMS[form]}" in str(error)
        assert FORWARD_LINE in str(error), str(error)  # rank 0's line, on every rank
        fix = "ctx.unwrap(model)(x)" if how == "ctx.wrap()" else "ctx.full_state_dict(model)"
        assert fix in str(error), str(error)
        forward_of(model).sum().backward()  # still in step: every rank runs the model
        assert ctx.all_reduce(1.0, op="sum") == float(ctx.world_size)


@pytest.mark.distributed(world_size=2, timeout=60)
def test_the_bare_module_of_a_ddp_model_runs_in_rank_zero_work_and_the_replicas_stay_equal(
    dist_ctx: DistContext,
) -> None:
    # Sample generation on rank 0 (nanoGPT's raw_model): no collective, so it is allowed.
    model = with_buffers(dist_ctx, "ctx.wrap()")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with dist_ctx.rank_zero() as main:
        if main:
            with torch.no_grad():
                assert dist_ctx.unwrap(model)(torch.ones(2, 4)).shape == (2, 1)
                assert model.module(torch.ones(2, 4)).shape == (2, 1)
    forward_of(model).sum().backward()
    optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = dist_ctx.all_gather(weights)
    assert all(torch.equal(theirs, everyone[0]) for theirs in everyone)


@pytest.mark.distributed(world_size=2, timeout=60)
@pytest.mark.parametrize("how", ["ctx.wrap()", "ctx.shard()"])
def test_making_a_model_parallel_inside_rank_zero_work_is_refused_on_every_rank(
    dist_ctx: DistContext, how: str
) -> None:
    # Both broadcast rank 0's weights: inside rank-zero work the others never joined.
    def make(ctx: DistContext) -> None:
        layer = nn.Linear(2, 2)
        ctx.wrap(layer) if how == "ctx.wrap()" else ctx.shard(layer)

    expected = RuntimeError if dist_ctx.rank == 0 else RankZeroError
    error = refused_at_once(lambda: in_rank_zero_block(dist_ctx, make), expected)
    assert f"{how} was called inside a ctx.rank_zero() block" in str(error), str(error)
    assert dist_ctx.all_reduce(1.0, op="sum") == float(dist_ctx.world_size)


def test_a_model_collective_in_rank_zero_work_is_refused_on_one_process_too(
    tmp_path: Path,
) -> None:
    """The same script fails the same way at every world size; a DDP model's own copy
    (``full_state_dict``) and its bare module's forward (nothing is sent) still run there."""
    with ddpctx.distributed() as ctx:
        model = ctx.wrap(nn.Linear(2, 1))
        model(torch.ones(1, 2)).sum().backward()
        ctx.save_checkpoint(tmp_path, model=model)
        with ctx.rank_zero() as main:
            if main:
                assert sorted(ctx.full_state_dict(model)) == ["bias", "weight"]
                assert ctx.unwrap(model)(torch.ones(1, 2)).shape == (1, 1)  # the bare module
                with pytest.raises(RuntimeError, match=r"ctx.clip_grad_norm_\(\) was called"):
                    ctx.clip_grad_norm_(model, max_norm=1e9)
                with pytest.raises(RuntimeError, match=r"the forward of a DDP model"):
                    model(torch.ones(1, 2))
                with pytest.raises(RuntimeError, match=r"ctx.load_checkpoint\(\) was called"):
                    ctx.load_checkpoint(tmp_path, model=model)
                with pytest.raises(RuntimeError, match=r"ctx.wrap\(\) was called"):
                    ctx.wrap(nn.Linear(2, 1))


@pytest.mark.distributed(world_size=2, timeout=60, init=False)
@pytest.mark.parametrize("call", ["ctx.full_state_dict()", "ctx.clip_grad_norm_()"])
def test_a_sharded_gather_on_rank_0_alone_is_a_hang_error_under_debug_mode_not_sigabrt(
    tmp_path: Path, call: str
) -> None:
    # Not rank-zero work (so not refused): rank 0's gather met rank 1's next collective,
    # and under debug mode its check; rank 1 died by SIGABRT. Now the call is checked as one
    # collective: both ranks raise HangError naming both calls, at once.
    def gather_alone() -> None:
        with ddpctx.distributed(timeout=TIMEOUT_S, debug=True, hang_timeout=0) as ctx:
            model, _ = sharded(ctx)
            if ctx.rank == 0:
                SHARDED_CALLS[call](ctx, model, tmp_path)
            ctx.barrier()

    started = time.monotonic()
    with pytest.raises(HangError) as raised:
        gather_alone()
    assert time.monotonic() - started < patience(FAST)
    message = str(raised.value)
    assert f"{call} at tests/test_refused_model_calls.py:" in message, message
    assert "barrier at tests/test_refused_model_calls.py:" in message, message


@pytest.mark.parametrize("how", ["ctx.wrap()", "ctx.shard()"])
def test_a_compiled_models_forward_is_refused_in_rank_zero_work_and_runs_outside(how: str) -> None:
    """Dynamo traces the check (no graph break, see test_compile): it still refuses."""
    with ddpctx.distributed() as ctx:
        layer = nn.Sequential(nn.Linear(4, 1))
        options = {"backend": "eager"}
        model = (
            ctx.wrap(layer, compile=options)
            if how == "ctx.wrap()"
            else ctx.shard(layer, compile=options)
        )
        assert forward_of(model).shape == (2, 1)
        with ctx.rank_zero() as main:
            if main:
                with pytest.raises(
                    RuntimeError, match=r"the forward of a .* model \(model"
                ) as error:
                    forward_of(model)
                assert FORWARD_LINE in str(error.value), str(error.value)
        assert forward_of(model).shape == (2, 1)
