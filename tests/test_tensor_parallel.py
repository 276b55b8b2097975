"""Tensor parallel: ctx.shard(tp_plan=, tp_size=) on a (dp, tp) mesh, FSDP2 over the data axis.

The 2 x 2 runs start 4 real gloo ranks; each test checks several things, so
the slow tier pays for two 4-rank jobs and one 4-rank pool test in all.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.data import IterableDataset

from ddpctx import DistContext, RankZeroError, distributed, load_weights
from ddpctx.checkpoint.export import export_checkpoint
from ddpctx.parallel.tensorparallel import check_plan
from tests.test_equivalence import (
    KILL_AFTER,
    TOLERANCE,
    bit_equal,
    largest_difference,
    result_of,
    run_job,
)


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))


def plan() -> dict[str, Any]:
    """The first layer split by columns, the second by rows: one all-reduce per forward."""
    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


# --- refused before any collective, at one process --------------------------------------


def test_a_tp_size_that_does_not_divide_the_world_size_is_refused_naming_both() -> None:
    with distributed() as ctx:
        with pytest.raises(ValueError, match=r"tp_size=2 does not divide the world size 1"):
            ctx.shard(mlp(0), tp_plan=plan(), tp_size=2)
        with pytest.raises(ValueError, match=r"tp_size=0 must be a positive int"):
            ctx.shard(mlp(0), tp_plan=plan(), tp_size=0)
        with pytest.raises(ValueError, match=r"dataloader\(tp_size=2\) does not divide"):
            ctx.dataloader(list(range(4)), batch_size=2, tp_size=2)


@pytest.mark.parametrize("key", ["1.up", "5", "head", "*.weight", "0.0"])
def test_a_plan_key_that_names_no_submodule_is_refused_naming_it(key: str) -> None:
    # torch's parallelize_module only warns and leaves that layer whole
    refused = pytest.raises(
        ValueError, match=rf"tp_plan key {re.escape(repr(key))} names no submodule"
    )
    with distributed() as ctx, refused:
        ctx.shard(mlp(0), tp_plan={key: ColwiseParallel()}, tp_size=1)


class Recorded(ParallelStyle):
    """A style that only records which modules torch's parallelize_module applies it to."""

    def __init__(self, seen: list[nn.Module]) -> None:
        self.seen = seen

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        self.seen.append(module)
        return module


NAMES = st.sampled_from(["a", "b", "ab", "0", "1", "10"])


@st.composite
def trees(draw: st.DrawFn, depth: int = 0) -> nn.Module:
    module = nn.Module()
    for name in draw(st.lists(NAMES, max_size=0 if depth == 2 else 3, unique=True)):
        module.add_module(name, draw(trees(depth + 1)))
    return module


KEYS = st.lists(st.sampled_from(["a", "b", "ab", "0", "1", "*", "?", "[01]", "a*"]), min_size=1)


@settings(max_examples=60, deadline=None)
@given(tree=trees(), atoms=KEYS)
def test_a_plan_key_is_refused_exactly_when_torch_would_apply_it_to_nothing(
    tree: nn.Module, atoms: list[str]
) -> None:
    key = ".".join(atoms)
    seen: list[nn.Module] = []
    with distributed() as ctx, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns for what it skips
        parallelize_module(tree, ctx.mesh, {key: Recorded(seen)})
    try:
        check_plan(tree, {key: Recorded([])}, tp_size=1)
    except ValueError:
        assert not seen, f"{key!r} refused, but torch applies it to {len(seen)} modules"
    else:
        assert seen, f"{key!r} accepted, but torch applies it to nothing"


def test_a_plan_without_a_size_a_size_without_a_plan_and_a_bad_style_are_refused() -> None:
    with distributed() as ctx:
        with pytest.raises(ValueError, match=r"tp_plan=\.\.\.\) needs tp_size="):
            ctx.shard(mlp(0), tp_plan=plan())
        with pytest.raises(ValueError, match=r"tp_size=2\) got no tp_plan"):
            ctx.shard(mlp(0), tp_size=2)
        with pytest.raises(TypeError, match=r"tp_plan\['0'\] is a str, not a ParallelStyle"):
            ctx.shard(mlp(0), tp_plan={"0": "colwise"}, tp_size=1)
        with pytest.raises(TypeError, match=r"must be a non-empty dict"):
            ctx.shard(mlp(0), tp_plan={}, tp_size=1)


def test_tp_size_1_shards_as_ctx_shard_does_without_a_plan() -> None:
    with distributed() as ctx:
        planned = ctx.shard(mlp(0), blocks=[nn.Linear], tp_plan={"*": ColwiseParallel()}, tp_size=1)
        plain = ctx.shard(mlp(0), blocks=[nn.Linear])
        assert [(p.device_mesh.ndim, p.placements) for p in planned.parameters()] == [
            (p.device_mesh.ndim, p.placements) for p in plain.parameters()
        ]
        assert bit_equal(ctx.full_state_dict(planned), ctx.full_state_dict(plain))
        assert ctx.mesh.ndim == 1  # ctx.mesh stays the one-dimensional mesh


def test_a_checkpoint_records_one_loader_position_per_tensor_parallel_group() -> None:
    # Before: one position per global rank (4), for a loader dealt to 2 data ranks, so the
    # resume took the world-size change path and read other samples (0.04 off at 2 x 2).
    from ddpctx.data.book import LoaderBook
    from ddpctx.data.dataloader import make_dataloader

    book = LoaderBook()
    dealt = {"shuffle": True, "pad": True, "base_seed": 0, "rank": 0, "world_size": 2}
    loader = make_dataloader(list(range(16)), 2, loader_kwargs={}, **dealt)  # type: ignore[arg-type]
    book.add(loader)
    next(iter(loader))
    ((key, mine),) = book.snapshot()
    epoch, consumed, complete, done = mine
    peer = (key, (epoch, consumed + 1, complete, done))  # data rank 1 read one batch more
    (record,) = book.records([[(key, mine)], [(key, mine)], [peer], [peer]])
    assert record["world_size"] == 2
    assert record["consumed"] == [consumed, consumed + 1]
    with pytest.raises(ValueError, match=r"tensor-parallel group 1 read the loader"):
        book.records([[(key, mine)], [(key, mine)], [peer], [(key, mine)]])


# --- 2 x 2 ranks --------------------------------------------------------------------------


class Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(8))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator))
        for _ in range(steps)
    ]


def reference(steps: int, clip: float) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One float64 process over each whole batch, clipped as the 2 x 2 run is."""
    model = mlp(0).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    norms = []
    for x, y in batches(steps):
        nn.functional.mse_loss(model(x.double()), y.double()).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.float() for k, v in model.state_dict().items()}, norms


@pytest.mark.slow
@pytest.mark.distributed(world_size=4, timeout=180)
def test_at_2x2_training_clipping_gathering_and_checkpoints_match_one_process(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    ctx = dist_ctx
    with pytest.raises(ValueError, match=r"tp_size=3 does not divide the world size 4"):
        ctx.shard(mlp(0), tp_plan=plan(), tp_size=3)
    with pytest.raises(ValueError, match=r"tensor-parallel groups reading one stream"):
        ctx.dataloader(Stream(), batch_size=2, tp_size=2)
    model = ctx.shard(mlp(ctx.rank), tp_plan=plan(), tp_size=2)  # each rank its own seed
    mesh = ctx.parallel_mesh(2)
    assert mesh.mesh_dim_names == ("dp", "tp")
    assert ctx.mesh.ndim == 1
    first = model[0].weight
    assert isinstance(first, DTensor)
    assert first.device_mesh.ndim == 2
    assert first.to_local().shape == (2, 6)  # 8 rows: 2 tensor-parallel x 2 data-parallel
    start = ctx.full_state_dict(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    data_rank = mesh["dp"].get_local_rank()
    assert data_rank == ctx.rank // 2
    norms = []
    for x, y in batches(3):
        mine = slice(data_rank * 4, data_rank * 4 + 4)  # a tensor-parallel pair reads one half
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        norms.append(ctx.clip_grad_norm_(model, 0.05))
        optimizer.step()
        optimizer.zero_grad()
    final = ctx.full_state_dict(model)
    refused = pytest.raises((RuntimeError, RankZeroError), match=r"full_state_dict\(\) was")
    with refused, ctx.rank_zero() as main:  # a gather rank 0 alone makes: refused at once
        if main:
            ctx.full_state_dict(model)
    ctx.save_checkpoint(tmp_path / "run", model=model, optimizer=optimizer, step=3)

    again = ctx.shard(mlp(5), tp_plan=plan(), tp_size=2)
    again_optimizer = torch.optim.AdamW(again.parameters(), lr=0.05)
    loaded = ctx.load_checkpoint(tmp_path / "run", model=again, optimizer=again_optimizer)
    assert loaded is not None
    assert loaded["step"] == 3
    reloaded = ctx.full_state_dict(again)
    with torch.device("meta"):
        empty = mlp(9)
    weights = mlp(0).state_dict() if ctx.is_main else None
    from_meta = ctx.full_state_dict(
        ctx.shard(empty, tp_plan=plan(), tp_size=2, full_state_dict=weights)
    )
    everyone = ctx.all_gather(norms)
    if not ctx.is_main:
        assert start == final == reloaded == from_meta == {}
        return
    assert everyone == [norms] * 4  # one norm, the same on every rank
    expected, expected_norms = reference(3, 0.05)
    assert min(expected_norms) > 0.05  # clipping was active at every step
    assert norms == pytest.approx(expected_norms, rel=1e-5)
    assert bit_equal(start, mlp(0).state_dict())  # rank 0's weights, as ctx.wrap starts
    assert bit_equal(from_meta, mlp(0).state_dict())
    assert largest_difference(final, {k: v.double() for k, v in expected.items()}) < 1e-5
    assert bit_equal(reloaded, final)
    plain = load_weights(tmp_path / "run")
    exported = torch.load(export_checkpoint(tmp_path / "run", tmp_path / "m.pt"))["model"]
    for state in (final, plain, exported):
        assert sorted(state) == sorted(mlp(0).state_dict())
        assert all(type(value) is torch.Tensor for value in state.values())
    assert bit_equal(plain, final)
    assert bit_equal(exported, final)


@pytest.mark.slow
def test_the_tp_cell_starts_as_wrap_ends_near_one_rank_and_resumes_bit_equal(
    tmp_path: Path,
) -> None:
    whole, killed, single = tmp_path / "whole", tmp_path / "killed", tmp_path / "single"
    for folder in (whole, killed, single):
        folder.mkdir()
    run_job(tmp_path, "--reference", nproc=1)
    run_job(single, "--cells", "wrap:32", nproc=1)
    run_job(whole, "--cells", "tp:32", nproc=4)
    run_job(killed, "--cells", "tp:32", "--kill-after", str(KILL_AFTER), nproc=4, restarts=1)
    reference64: dict[str, dict[str, torch.Tensor]] = torch.load(tmp_path / "reference.pt")
    wrap, tp, resumed = (
        result_of(single, "wrap:32"),
        result_of(whole, "tp:32"),
        result_of(killed, "tp:32"),
    )
    assert tp["world_size"] == 4
    assert tp["steps"] == 24
    assert bit_equal(tp["start"], wrap["start"])  # ctx.wrap's start: rank 0's weights
    double = {name: value.double() for name, value in wrap["final"].items()}
    assert largest_difference(tp["final"], double) <= TOLERANCE["32"]
    assert largest_difference(tp["final"], reference64["final"]) <= TOLERANCE["32"]
    assert resumed["restart_count"] == 1
    assert 0 < resumed["resumed_step"] <= KILL_AFTER
    assert bit_equal(resumed["final"], tp["final"])
    checkpoints = whole / "tp-32" / "checkpoints"
    plain = load_weights(checkpoints)  # a 2 x 2 checkpoint read in one plain process
    assert bit_equal(plain, tp["final"])
    assert all(type(value) is torch.Tensor for value in plain.values())
    with distributed(seed=3) as ctx:  # and resharded onto one rank's FSDP2 model
        from tests.scripts.equivalence import make_model

        model = ctx.shard(make_model(), blocks=[nn.Linear])
        meta = ctx.load_checkpoint(
            checkpoints,
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            allow_world_size_change=True,
        )
        assert meta is not None
        assert meta["step"] == 24
        assert bit_equal(ctx.full_state_dict(model), tp["final"])
