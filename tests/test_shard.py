"""Sharded training: ctx.shard (FSDP2), sharded checkpoints, clipping, precision, on real ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.utils.data import TensorDataset

from ddpctx import DistContext, distributed


def tiny_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3)
    )


@pytest.mark.distributed(world_size=2, timeout=90)
def test_an_fsdp1_model_is_refused_at_save_and_nothing_is_written(
    dist_ctx: DistContext, tmp_path: Path
) -> None:
    model = FullyShardedDataParallel(tiny_model(), device_id=torch.device("cpu"))
    with pytest.raises(TypeError, match=r"FullyShardedDataParallel \(FSDP1\).*ctx\.shard"):
        dist_ctx.save_checkpoint(tmp_path, model=model, epoch=0)
    dist_ctx.barrier()
    assert list(tmp_path.iterdir()) == []


RANKS = pytest.mark.distributed(world_size=[2, 3], timeout=90)


def global_batches(steps: int, batch: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (torch.randn(batch, 6, generator=generator), torch.randn(batch, 3, generator=generator))
        for _ in range(steps)
    ]


def train_reference(steps: int, clip: float | None = None) -> tuple[nn.Module, list[float]]:
    """The same training on one process over the whole batch: what sharding must reproduce."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    norms = []
    for x, y in global_batches(steps):
        nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
    return model, norms


def train_sharded(
    ctx: DistContext, steps: int, clip: float | None = None, **shard: object
) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
    model = ctx.shard(tiny_model(), **shard)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    norms = []
    for x, y in global_batches(steps):
        mine = slice(ctx.rank * len(x) // ctx.world_size, (ctx.rank + 1) * len(x) // ctx.world_size)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        if clip is not None:
            norms.append(ctx.clip_grad_norm_(model, clip))
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, norms


@RANKS
def test_training_a_sharded_model_matches_one_process_over_the_whole_batch(
    dist_ctx: DistContext,
) -> None:
    model, _, _ = train_sharded(dist_ctx, steps=4, blocks=[nn.Linear])
    assert all(
        type(layer).__name__.startswith("FSDP") for layer in model if isinstance(layer, nn.Linear)
    )
    full = dist_ctx.full_state_dict(model)
    if dist_ctx.rank != 0:
        assert full == {}
        return
    reference, _ = train_reference(steps=4)
    assert full.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert full[name].device.type == "cpu"
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)


@RANKS
def test_each_rank_holds_about_one_nth_of_the_weights(dist_ctx: DistContext) -> None:
    model = dist_ctx.shard(tiny_model(), blocks=[nn.Linear])
    local = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[operator]
    total = sum(p.numel() for p in tiny_model().parameters())
    # each tensor is split by rows, so a rank's share is within one row per tensor of total/N
    assert abs(local - total / dist_ctx.world_size) <= 10 * len(list(model.parameters()))
    assert dist_ctx.unwrap(model) is model


@RANKS
def test_clip_grad_norm_equals_the_unsharded_norm_and_clips_the_same(
    dist_ctx: DistContext,
) -> None:
    model, _, norms = train_sharded(dist_ctx, steps=3, clip=0.05, blocks=[nn.Linear])
    full = dist_ctx.full_state_dict(model)
    reference, expected = train_reference(steps=3, clip=0.05)
    assert all(isinstance(norm, float) for norm in norms)
    assert norms == pytest.approx(expected, rel=1e-5)
    assert min(expected) > 0.05  # the clip was active, so equal weights show equal clipping
    if dist_ctx.rank == 0:
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("norm_type", [float("inf"), 1.0, 2.0])
@RANKS
def test_clip_grad_norm_counts_a_rank_whose_shard_is_empty(
    dist_ctx: DistContext, norm_type: float
) -> None:
    # Before: norm_type=inf raised "_foreach_norm cannot compute the infinity norm on an
    # empty tensor" on the rank holding no row of a 1-output layer.
    def model() -> nn.Sequential:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1))

    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(5))
    sharded = dist_ctx.shard(model(), blocks=[nn.Linear])
    mine = slice(
        dist_ctx.rank * 12 // dist_ctx.world_size, (dist_ctx.rank + 1) * 12 // dist_ctx.world_size
    )
    sharded(x[mine]).pow(2).sum().mul(dist_ctx.world_size / 12).backward()
    norm = dist_ctx.clip_grad_norm_(sharded, 1e-3, norm_type=norm_type)
    reference = model()
    reference(x).pow(2).sum().div(12).backward()
    grads = [p.grad.double() for p in reference.parameters()]  # type: ignore[union-attr]
    expected = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]), norm_type))
    assert norm == pytest.approx(expected, rel=1e-5)
    assert dist_ctx.all_gather(norm) == [norm] * dist_ctx.world_size
    clipped = torch.cat([p.grad.full_tensor().flatten() for p in sharded.parameters()])  # type: ignore[union-attr]
    assert float(torch.linalg.vector_norm(clipped.double(), norm_type)) == pytest.approx(
        1e-3, rel=1e-3
    )


@RANKS
def test_clip_grad_norm_of_a_ddp_model_equals_the_unsharded_norm(dist_ctx: DistContext) -> None:
    model = dist_ctx.wrap(tiny_model())
    x, y = global_batches(1)[0]
    mine = slice(
        dist_ctx.rank * 12 // dist_ctx.world_size, (dist_ctx.rank + 1) * 12 // dist_ctx.world_size
    )
    nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
    norm = dist_ctx.clip_grad_norm_(model, 1e9)
    reference = tiny_model()
    nn.functional.mse_loss(reference(x), y).backward()
    assert norm == pytest.approx(
        float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])), rel=1e-5
    )


def compute_dtypes(model: nn.Module) -> list[torch.dtype]:
    """The dtype each Linear's forward produced, recorded by hooks."""
    seen: list[torch.dtype] = []
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            layer.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


@pytest.mark.distributed(world_size=2, timeout=90, init=False)
@pytest.mark.parametrize("how", ["wrap", "shard"])
def test_bf16_mixed_trains_on_cpu_computing_in_bf16_with_float32_weights(how: str) -> None:
    with distributed(seed=0, precision="bf16-mixed") as ctx:
        assert ctx.precision == "bf16-mixed"
        model = ctx.wrap(tiny_model()) if how == "wrap" else ctx.shard(tiny_model())
        seen = compute_dtypes(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
        x, y = global_batches(1, batch=32)[0]
        losses = []
        for _ in range(15):
            output = model(x)
            loss = nn.functional.mse_loss(output, y)
            ctx.scaler.scale(loss).backward()  # a pass-through: only 16-mixed scales
            ctx.scaler.step(optimizer)
            ctx.scaler.update()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert set(seen) == {torch.bfloat16}
        assert output.dtype == torch.float32
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        reference = tiny_model()
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.02)
        for _ in range(15):  # the same steps in float32: bf16 must follow it closely
            expected = nn.functional.mse_loss(reference(x), y)
            expected.backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
        assert losses[-1] < 0.9 * losses[0], losses
        assert losses[-1] == pytest.approx(expected.item(), rel=0.03), losses


@pytest.mark.distributed(world_size=2, timeout=90, init=False)
@pytest.mark.parametrize("how", ["wrap", "shard"])
def test_bf16_true_trains_on_float32_batches_with_bf16_weights(how: str) -> None:
    # Before: float32 batches from ctx.dataloader met bf16 weights: "mat1 and mat2 must
    # have the same dtype" -- the README's "one precision= switch" example crashed.
    data = TensorDataset(*global_batches(1, batch=64)[0])
    with distributed(seed=0, precision="bf16-true") as ctx:
        model = ctx.wrap(tiny_model()) if how == "wrap" else ctx.shard(tiny_model())
        seen = compute_dtypes(model)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
        losses = []
        train = ctx.dataloader(data, batch_size=16, shuffle=True)
        for _ in ctx.epochs(8):
            total = 0.0
            for x, y in train:
                assert x.dtype == torch.float32  # batches stay as the dataset made them
                output = model(x)
                loss = nn.functional.mse_loss(output, y)
                ctx.scaler.scale(loss).backward()
                ctx.scaler.unscale_(optimizer)
                ctx.clip_grad_norm_(model, 1.0)
                ctx.scaler.step(optimizer)
                ctx.scaler.update()
                optimizer.zero_grad()
                total += loss.item()
            losses.append(ctx.all_reduce(total))
        assert set(seen) == {torch.bfloat16}
        assert output.dtype == torch.float32
        assert losses[-1] < 0.9 * losses[0], losses  # epoch totals fall


def test_float16_on_cpu_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"precision='16-mixed' needs CUDA.*'cpu'.*bf16-mixed"):
        distributed(precision="16-mixed").__enter__()


@pytest.mark.parametrize("bad", ["fp16", "bf16", 16, None])
def test_an_unknown_precision_is_refused_naming_the_choices(bad: object) -> None:
    with pytest.raises(ValueError, match=r"precision=.* is not one of '32', 'bf16-mixed'"):
        distributed(precision=bad).__enter__()  # type: ignore[arg-type]


def test_the_default_precision_changes_nothing() -> None:
    with distributed() as ctx:
        model = ctx.wrap(tiny_model())
        assert ctx.precision == "32"
        assert not ctx.scaler.is_enabled()
        autocast: list[bool] = []
        model.module.register_forward_pre_hook(
            lambda *_: autocast.append(torch.is_autocast_enabled("cpu"))
        )
        assert model(torch.ones(2, 6)).dtype == torch.float32
        assert autocast == [False]  # the forward runs as the model's own, no autocast around it


@pytest.mark.distributed(world_size=2, timeout=90, init=False)
def test_bf16_mixed_blocks_pass_bf16_on_and_only_the_root_returns_float32() -> None:
    with distributed(seed=0, precision="bf16-mixed") as ctx:
        model = ctx.shard(tiny_model(), blocks=[nn.Linear])
        seen = compute_dtypes(model)
        output = model(torch.ones(4, 6))
        assert seen == [torch.bfloat16] * 3  # no float32 round trip between blocks
        assert output.dtype == torch.float32


class TiedLM(nn.Module):
    """GPT-2's shape in small: the output layer shares the input embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(300, 16)
        self.h = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])
        self.lm_head = nn.Linear(16, 300, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for layer in self.h:
            x = x + layer(x)
        return self.lm_head(x)


def test_the_default_blocks_leave_tied_parameters_to_their_common_parent() -> None:
    from ddpctx.parallel.sharding import default_blocks

    model = TiedLM()
    chosen = default_blocks(model, min_params=1000)  # the embedding alone would qualify
    assert model.wte not in chosen
    assert model.lm_head not in chosen
    assert all(any(block is layer for layer in model.h) for block in chosen)


@pytest.mark.distributed(world_size=2, timeout=90)
def test_a_tied_embedding_shards_by_default_and_stays_tied(dist_ctx: DistContext) -> None:
    model = dist_ctx.shard(TiedLM(), min_params=1000)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randint(0, 300, (4, 5))).logsumexp(-1).mean().backward()
    optimizer.step()
    assert model.wte.weight is model.lm_head.weight
    full = dist_ctx.full_state_dict(model)
    if dist_ctx.rank == 0:
        torch.testing.assert_close(full["wte.weight"], full["lm_head.weight"], rtol=0, atol=0)
        assert not torch.equal(full["wte.weight"], TiedLM().wte.weight)  # it trained


@pytest.mark.distributed(world_size=2, timeout=90)
def test_blocks_naming_a_tied_module_is_refused_naming_it_and_the_fix(
    dist_ctx: DistContext,
) -> None:
    with pytest.raises(ValueError, match=r"'wte'.*'weight' is tied.*Leave this module out"):
        dist_ctx.shard(TiedLM(), blocks=[nn.Embedding])


@pytest.mark.distributed(world_size=2, timeout=90)
def test_wrapping_a_sharded_model_is_refused_naming_both_ways(dist_ctx: DistContext) -> None:
    model = dist_ctx.shard(tiny_model(), blocks=[nn.Linear])
    with pytest.raises(ValueError, match=r"sharded model \(fsdp2.*ctx\.wrap.*ctx\.shard"):
        dist_ctx.wrap(model)
