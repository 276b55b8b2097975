"""ctx.shard starts where ctx.wrap does, full_state_dict is a snapshot, precision and optimizers."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from ddpctx import DistContext, distributed


def unseeded_model() -> nn.Sequential:
    """Initialised from the current RNG: under distributed(seed=42) each rank's differs."""
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():  # a buffer that differs per rank as well
        model[1].running_mean.copy_(torch.randn(8))
    return model


def pretrained_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    return unseeded_model().state_dict()


def assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value.cpu()), name


WORLD_SIZES = pytest.mark.distributed(world_size=[1, 2, 3], timeout=120, init=False)


@WORLD_SIZES
def test_shard_starts_every_rank_from_rank0s_weights_as_wrap_does() -> None:
    # Before: each rank kept its slice of its own initialisation ('0.weight': False, ...)
    with distributed(seed=42) as ctx:
        model = unseeded_model()
        mine = copy.deepcopy(model.state_dict())
        rank0 = ctx.broadcast(mine)
        if ctx.world_size > 1:
            assert not torch.equal(ctx.all_gather(mine["0.weight"])[1], rank0["0.weight"])
        twin = copy.deepcopy(model)
        sharded = ctx.shard(model, blocks=[nn.Linear])
        full = ctx.full_state_dict(sharded)
        wrapped = ctx.wrap(twin)
        for name, buffer in sharded.named_buffers():  # buffers are whole on every rank
            assert torch.equal(buffer, rank0[name]), name
        assert_same(wrapped.module.state_dict(), rank0)
        if ctx.is_main:
            assert_same(full, rank0)


@WORLD_SIZES
def test_pretrained_weights_loaded_on_rank0_only_reach_every_shard() -> None:
    pretrained = pretrained_weights()
    with distributed(seed=42) as ctx:
        model = unseeded_model()
        if ctx.is_main:
            model.load_state_dict(pretrained)
        sharded = ctx.shard(model, blocks=[nn.Linear])
        full = ctx.full_state_dict(sharded)
        if ctx.is_main:
            assert_same(full, pretrained)


class Rotary(nn.Module):
    """q and k rotated by a float32 table (a non-persistent buffer), then attention."""

    def __init__(self, dim: int = 8, length: int = 5) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, 2)
        angles = torch.arange(length)[:, None] * torch.linspace(0.1, 1.0, dim // 2)[None]
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat([-second, first], dim=-1) * self.sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attended = nn.functional.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v)
        return self.out(attended.mean(dim=1))


def rotary_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(77)
    return Rotary().state_dict()


@WORLD_SIZES
def test_a_meta_model_is_sharded_from_rank0s_state_dict_and_keeps_real_buffers() -> None:
    weights = rotary_weights()
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(3))
    reference = Rotary()
    reference.load_state_dict(weights)
    with distributed(seed=42) as ctx:
        with torch.device("meta"):
            model = Rotary()
        table = Rotary()  # the rotary table is computed on a real device, as models do
        model.register_buffer("cos", table.cos, persistent=False)
        model.register_buffer("sin", table.sin, persistent=False)
        sharded = ctx.shard(model, full_state_dict=weights if ctx.is_main else None)
        assert all(not p.is_meta for p in sharded.parameters())
        full = ctx.full_state_dict(sharded)
        if ctx.is_main:
            assert_same(full, weights)
        assert torch.equal(sharded(x), reference(x))  # buffers and shards both right


@pytest.mark.distributed(world_size=2, timeout=90, init=False)
def test_a_meta_model_without_a_state_dict_or_with_a_wrong_one_is_refused_on_every_rank() -> None:
    with distributed(seed=0) as ctx:
        with torch.device("meta"):
            model = unseeded_model()
        with pytest.raises(ValueError, match=r"meta device.*no full_state_dict.*mmap=True"):
            ctx.shard(model)
        wrong = {"0.weight": torch.zeros(8, 6)} if ctx.is_main else None
        with pytest.raises(ValueError, match=r"does not fit the model: missing \['0.bias'"):
            ctx.shard(model, full_state_dict=wrong)
        assert not any(type(p).__name__ == "DTensor" for p in model.parameters())  # untouched
        narrow = {**pretrained_weights(), "0.weight": torch.zeros(8, 5)}
        with pytest.raises(
            ValueError,
            match=r"does not fit the model: shape \['0.weight \(8, 5\), not \(8, 6\)'\]\.",
        ):
            ctx.shard(model, full_state_dict=narrow if ctx.is_main else None)
        with pytest.raises(TypeError, match=r"rank 0 passed a str; pass e\.g\. torch\.load"):
            ctx.shard(model, full_state_dict="weights.pt" if ctx.is_main else None)  # type: ignore[arg-type]
        with torch.device("meta"):
            rotary = Rotary()
        with pytest.raises(ValueError, match=r"non-persistent buffers \['cos', 'sin'\]"):
            ctx.shard(rotary, full_state_dict=rotary_weights() if ctx.is_main else None)
        ctx.barrier()


@pytest.mark.distributed(world_size=[1, 2], timeout=120, init=False)
@pytest.mark.parametrize("how", ["wrap", "shard"])
def test_full_state_dict_is_a_snapshot_that_later_steps_leave_alone(how: str) -> None:
    # Before: sharded at world size 1 and wrap at 2 handed back the live tensors
    with distributed(seed=0) as ctx:
        torch.manual_seed(0)
        bare = unseeded_model()
        model = ctx.wrap(bare) if how == "wrap" else ctx.shard(bare, blocks=[nn.Linear])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        taken = ctx.full_state_dict(model)
        kept = copy.deepcopy(taken)
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(ctx.rank))
        model(x).pow(2).sum().backward()  # a train-mode forward moves BatchNorm's buffers too
        optimizer.step()
        after = ctx.full_state_dict(model)
        if ctx.is_main:
            assert_same(taken, kept)
            changed = [name for name in kept if not torch.equal(after[name], kept[name])]
            assert {"0.weight", "1.running_mean", "3.bias"} <= set(changed)
            assert all(not value.requires_grad for value in taken.values())


@pytest.mark.distributed(world_size=2, timeout=120, init=False)
@pytest.mark.parametrize("how", ["wrap", "shard"])
def test_bf16_mixed_trains_a_model_with_a_float32_rotary_buffer_without_autocast(
    how: str,
) -> None:
    # Before, sharded: "Expected query, key, and value to have the same dtype"
    x = torch.randn(16, 5, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(16, 2, generator=torch.Generator().manual_seed(2))
    with distributed(seed=0, precision="bf16-mixed") as ctx:
        torch.manual_seed(5)
        model = ctx.wrap(Rotary()) if how == "wrap" else ctx.shard(Rotary())
        assert ctx.unwrap(model).cos.dtype == torch.float32
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
        losses = []
        for _ in range(12):
            output = model(x)
            loss = nn.functional.mse_loss(output, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert output.dtype == torch.float32
        assert all(math.isfinite(loss) for loss in losses)
        assert losses[-1] < 0.9 * losses[0], losses
        torch.manual_seed(5)
        reference = Rotary()
        expected = nn.functional.mse_loss(reference(x), y).item()
        assert losses[0] == pytest.approx(expected, rel=0.03)  # bf16 follows float32 closely


def lbfgs_step(ctx: DistContext, model: nn.Module) -> float:
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=3)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    return float(optimizer.step(closure))  # type: ignore[arg-type]


@pytest.mark.distributed(world_size=[1, 2], timeout=90)
def test_lbfgs_on_a_sharded_model_names_the_cause_and_the_fix(dist_ctx: DistContext) -> None:
    # Before: at 2 ranks, and at 1 for a [1, 4] weight, torch's raw "RuntimeError: This
    # operation would remove or reshape sharded dimension 0"
    torch.manual_seed(0)
    sharded = dist_ctx.shard(nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1)))
    with pytest.raises(TypeError, match=r"LBFGS .*flattens all parameters.*ctx\.wrap.*AdamW"):
        lbfgs_step(dist_ctx, sharded)
    torch.manual_seed(0)
    wrapped = dist_ctx.wrap(nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1)))
    assert math.isfinite(lbfgs_step(dist_ctx, wrapped))  # the named fix works
    torch.manual_seed(0)
    again = dist_ctx.shard(nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1)))
    adam = torch.optim.Adam(again.parameters())
    again(torch.ones(2, 6)).sum().backward()
    adam.step()  # a per-parameter optimizer is not refused


@pytest.mark.distributed(world_size=2, timeout=120, init=False)
@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("where", ["meta", "real"])
def test_full_state_dict_loads_rank0s_weights_in_every_precision(
    precision: str, where: str
) -> None:
    weights = pretrained_weights()
    with distributed(seed=42, precision=precision) as ctx:
        with torch.device("meta" if where == "meta" else "cpu"):
            model = unseeded_model()
        sharded = ctx.shard(model, full_state_dict=weights if ctx.is_main else None)
        full = ctx.full_state_dict(sharded)
        dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
        assert {p.dtype for p in sharded.parameters()} == {dtype}
        if ctx.is_main:
            expected = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
            assert_same(full, expected)
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
        assert sharded(x).dtype == torch.float32


@pytest.mark.distributed(world_size=2, timeout=120, init=False)
@pytest.mark.parametrize("affine", [True, False])
def test_bf16_mixed_shards_a_batch_norm_model_and_trains_it_as_wrap_does(affine: bool) -> None:
    # Before: "expected scalar type BFloat16 but found Float" (bf16 weights, float32 statistics)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randn(16, 3, generator=torch.Generator().manual_seed(2))

    def batch_norm_model() -> nn.Sequential:
        torch.manual_seed(9)
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, affine=affine), nn.Linear(8, 3))

    with distributed(seed=0, precision="bf16-mixed") as ctx:
        losses: dict[str, list[float]] = {}
        for how in ("wrap", "shard"):
            model = ctx.wrap(batch_norm_model()) if how == "wrap" else ctx.shard(batch_norm_model())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            losses[how] = []
            for _ in range(8):
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses[how].append(loss.item())
            assert ctx.unwrap(model)[1].running_mean.dtype == torch.float32
        assert losses["shard"][-1] < losses["shard"][0]
        assert losses["shard"] == pytest.approx(losses["wrap"], rel=0.03)


class Strided(nn.Module):
    """A buffer stored transposed (non-contiguous) and a 0-d buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)
        self.register_buffer("mask", torch.rand(3, 6).t())
        self.register_buffer("scale", torch.rand(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x * self.mask.sum(dim=1)) * self.scale


@pytest.mark.distributed(world_size=2, timeout=90, init=False)
def test_a_non_contiguous_buffer_and_a_scalar_buffer_start_from_rank0s_too() -> None:
    with distributed(seed=42) as ctx:
        model = Strided()
        rank0 = ctx.broadcast(copy.deepcopy(model.state_dict()))
        sharded = ctx.shard(model)
        full = ctx.full_state_dict(sharded)
        assert torch.equal(sharded.scale, rank0["scale"])
        assert torch.equal(sharded.mask, rank0["mask"])
        if ctx.is_main:
            assert_same(full, rank0)


def test_an_optimizer_made_before_ctx_shard_is_refused_at_its_first_step() -> None:
    # Found by the merged-whole attack: its steps changed the replaced parameters, the model
    # never trained, and nothing said so (the same script with ctx.wrap trains).
    with distributed(seed=0) as ctx:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        early = torch.optim.SGD(model.parameters(), lr=0.1)
        model = ctx.shard(model)
        model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(ValueError, match=r"holds 4 of 4 parameters from before ctx\.shard"):
            early.step()
        with pytest.raises(ValueError, match=r"Create the optimizer after ctx\.shard"):
            early.step()  # every step, not the first only
        after = torch.optim.SGD(model.parameters(), lr=0.1)
        start = ctx.full_state_dict(model)
        after.step()
        assert not torch.equal(ctx.full_state_dict(model)["0.weight"], start["0.weight"])


class Projected(nn.Module):
    """A fixed random projection in a non-persistent buffer: drawn from each rank's seed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("projection", torch.randn(4, 4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x @ self.projection)


@pytest.mark.distributed(world_size=[2, 3], timeout=120, init=False)
@pytest.mark.parametrize("where", ["real", "meta"])
def test_full_state_dict_gives_every_rank_rank0s_non_persistent_buffers(where: str) -> None:
    # Before: set_model_state_dict set parameters and persistent buffers only, so each
    # rank kept the projection its own seed drew (seed + rank): other models per rank.
    torch.manual_seed(5)
    weights = Projected().state_dict()
    with distributed(seed=42) as ctx:
        if where == "meta":
            with torch.device("meta"):
                model = Projected()
            model.register_buffer("projection", torch.randn(4, 4), persistent=False)
        else:
            model = Projected()
        rank0 = ctx.broadcast(model.projection.clone())
        sharded = ctx.shard(model, full_state_dict=weights if ctx.is_main else None)
        assert torch.equal(sharded.projection, rank0)
        everyone = ctx.all_gather(sharded(torch.ones(2, 4)).detach())
        assert all(torch.equal(output, everyone[0]) for output in everyone)


@pytest.mark.distributed(world_size=2, timeout=120, init=False)
def test_a_model_with_an_expanded_buffer_is_refused_by_shard_on_every_rank() -> None:
    # Found by the outside attack: rank 0's values were broadcast into the 4 floats such a
    # buffer owns, 64 written ("malloc(): unaligned tcache chunk detected", SIGABRT on rank 1).
    model = nn.Linear(4, 4)
    model.register_buffer("mask", torch.ones(1, 4).expand(16, 4))
    with distributed(seed=0) as ctx:
        with pytest.raises(ValueError, match=r"'mask' of the model is an expanded tensor"):
            ctx.shard(model)
        ctx.barrier()  # every rank refused it, and is still in step
