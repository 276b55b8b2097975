"""``compile=`` on ``ctx.wrap`` and ``ctx.shard``: compiled in place, same model, plain names.

The compiled runs use ``backend="aot_eager"`` (dynamo and AOTAutograd without
inductor's code generation): what these tests check is the plumbing -- the
order of compile and wrapping, the parameter names, checkpoints in both
directions -- and there the compiled model computes exactly what the eager one
does, so the comparisons are bit for bit.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from ddpctx import DistContext, distributed, load_weights
from ddpctx.parallel.compiling import compile_options, torch_compile_arguments

COMPILE = {"backend": "aot_eager"}


def tiny_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3)
    )


def make(ctx: DistContext, mode: str, compile: object) -> nn.Module:
    if mode == "wrap":
        return ctx.wrap(tiny_model(), compile=compile)  # type: ignore[arg-type]
    return ctx.shard(tiny_model(), blocks=[nn.Linear], compile=compile)  # type: ignore[arg-type]


def train(ctx: DistContext, model: nn.Module, steps: range) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in steps:
        generator = torch.Generator().manual_seed(100 * step + ctx.rank)
        x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_compile_takes_true_false_or_torch_compiles_options() -> None:
    assert compile_options(True) == {}
    assert compile_options(False) is None
    assert compile_options(None) is None
    assert compile_options({"mode": "max-autotune"}) == {"mode": "max-autotune"}


@given(st.one_of(st.integers(), st.text(), st.lists(st.integers()), st.just({1: "a"})))
def test_any_other_compile_setting_is_refused_naming_it(setting: object) -> None:
    with pytest.raises(TypeError, match=r"compile=.*pass True.*dict of torch\.compile"):
        compile_options(setting, "ctx.wrap")


def test_a_bad_compile_setting_is_refused_before_the_model_is_touched() -> None:
    model = tiny_model()
    with distributed() as ctx, pytest.raises(TypeError, match=r"ctx\.wrap\(compile='yes'\)"):
        ctx.wrap(model, compile="yes")  # type: ignore[arg-type]
    assert not hasattr(model, "_ddp_params_and_buffers_to_ignore")


#: (compile=, the error, what its message must hold): torch took the first at the wrap and
#: failed at the first forward, said "unexpected keyword" for the second without naming
#: compile=, and let the options of a backend that ignores them pass silently.
BAD_COMPILES = [
    (
        {"fullgraph": "yes"},
        TypeError,
        "'fullgraph': 'yes' is of type str; torch.compile takes bool",
    ),
    ({"nonsense": 1}, ValueError, "'nonsense' (= 1) is not an argument of torch.compile"),
    ({"options": {"x": 1}}, ValueError, "'options' key 'x' (= 1) is not an inductor setting"),
    (
        {"backend": "aot_eager", "options": {"x": 1}},
        ValueError,
        "'backend': 'aot_eager', which takes no options",
    ),
    ({"options": {"max_autotune": "yes"}}, TypeError, "inductor's max_autotune takes bool"),
    ({"backend": "no-such"}, ValueError, "'backend': 'no-such' is not a torch.compile backend"),
    ({"mode": "fast"}, ValueError, "'mode': 'fast' is not one of inductor's modes"),
    ({"recompile_limit": True}, TypeError, "'recompile_limit': True is of type bool"),
    ({"mode": "max-autotune", "options": {}}, ValueError, "and 'options' together"),
]


@pytest.mark.parametrize("mode", ["wrap", "shard"])
@pytest.mark.parametrize(("setting", "error", "says"), BAD_COMPILES)
def test_compile_options_torch_would_refuse_late_or_ignore_are_refused_at_the_wrap(
    mode: str, setting: dict[str, Any], error: type[Exception], says: str
) -> None:
    model = tiny_model()
    with distributed() as ctx:
        wrap = ctx.wrap if mode == "wrap" else functools.partial(ctx.shard, blocks=[nn.Linear])
        with pytest.raises(error) as raised:
            wrap(model, compile=setting)
    assert f"ctx.{mode}(compile=...)" in str(raised.value)
    assert says in str(raised.value)
    assert not hasattr(model, "_ddp_params_and_buffers_to_ignore")  # refused before wrapping


@pytest.mark.parametrize(
    "setting",
    [
        {"fullgraph": True, "dynamic": None, "backend": "aot_eager", "name": "m", "disable": False},
        {"mode": "max-autotune-no-cudagraphs", "recompile_limit": 4, "isolate_recompiles": True},
        {"options": {"max_autotune": False, "triton.cudagraphs": False, "fallback-random": True}},
        {"backend": lambda gm, inputs, **kwargs: gm, "options": {"anything": 1}},
    ],
)
def test_every_compile_option_torch_takes_is_accepted_as_torch_takes_it(
    setting: dict[str, Any],
) -> None:
    # Differential: what ddpctx accepts, torch.compile builds without a word.
    assert compile_options(setting) == setting
    copied = {key: dict(value) if key == "options" else value for key, value in setting.items()}
    torch.compile(nn.Linear(2, 2), **copied)  # (torch takes keys out of the options dict)
    assert {"fullgraph", "backend", "mode", "options"} <= set(torch_compile_arguments())


@pytest.mark.parametrize("mode", ["wrap", "shard"])
@pytest.mark.distributed(world_size=2, timeout=180)
def test_a_compiled_model_trains_as_the_eager_one_with_its_own_names(
    dist_ctx: DistContext, mode: str
) -> None:
    eager, compiled = make(dist_ctx, mode, False), make(dist_ctx, mode, COMPILE)
    assert type(compiled) is type(eager)  # still DDP / FSDP2: every ctx method finds it
    train(dist_ctx, eager, range(4))
    train(dist_ctx, compiled, range(4))
    names = list(compiled.state_dict())
    assert names == list(eager.state_dict())
    assert not [name for name in names if "_orig_mod" in name]
    first, second = dist_ctx.full_state_dict(eager), dist_ctx.full_state_dict(compiled)
    assert list(second) == list(first)
    assert all(torch.equal(first[name], second[name]) for name in first)


def run_and_save(ctx: DistContext, mode: str, compile: object, folder: Path) -> dict[str, Any]:
    model = make(ctx, mode, compile)
    train(ctx, model, range(3))
    ctx.save_checkpoint(folder, model=model, step=3)
    train(ctx, model, range(3, 6))
    return ctx.full_state_dict(model)


@pytest.mark.parametrize("mode", ["wrap", "shard"])
@pytest.mark.parametrize(("saved", "loaded"), [(COMPILE, False), (False, COMPILE)])
@pytest.mark.distributed(world_size=2, timeout=180)
def test_a_checkpoint_saved_compiled_resumes_uncompiled_and_back(
    dist_ctx: DistContext, tmp_path: Path, mode: str, saved: object, loaded: object
) -> None:
    folder = tmp_path / "checkpoints"
    whole = run_and_save(dist_ctx, mode, saved, folder)
    resumed = make(dist_ctx, mode, loaded)
    meta = dist_ctx.load_checkpoint(folder, model=resumed)
    assert meta is not None
    assert meta["step"] == 3
    train(dist_ctx, resumed, range(3, 6))
    again = dist_ctx.full_state_dict(resumed)
    assert all(torch.equal(whole[name], again[name]) for name in whole)
    dist_ctx.barrier()
    if dist_ctx.is_main:  # what a plain process reads back: the model's own names
        weights = load_weights(folder)
        assert list(weights) == list(tiny_model().state_dict())


@pytest.mark.distributed(world_size=1, timeout=180)
def test_ddpctxs_own_hooks_put_no_graph_break_in_a_compiled_sharded_model(
    dist_ctx: DistContext,
) -> None:
    from torch._dynamo.utils import counters

    counters.clear()
    model = make(dist_ctx, "shard", COMPILE)
    train(dist_ctx, model, range(2))
    assert dict(counters["graph_break"]) == {}
