"""A shard's tensor entry built on its mapped bytes (ddpctx.checkpoint.entries) is torch.load's.

A sharded load builds each tensor entry on the bytes already mapped and verified
(``torch.load(mmap=True)``'s way, for one stretch of a shard), so loading it copies
its bytes once. Checked here against ``torch.load`` of the same bytes, bit for bit,
for every dtype, odd shapes and strides, and entries starting at any byte (the
shard's entries are not aligned); refusals and damage said as the copying path
says them; and a real 2-rank sharded load taking the in-place path and ending with
the weights the copying path gives.
"""

from __future__ import annotations

import io
import math
import os
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpctx import DistContext
from ddpctx.checkpoint import entries
from ddpctx.checkpoint.entries import in_place_tensor, weights_only_value
from ddpctx.checkpoint.files import RefusedCheckpoint
from ddpctx.checkpoint.sums import Damaged
from tests.helpers import shared_folder, two_sharded_layers

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]
SHARD = Path("__0_0.distcp")


def saved(value: Any) -> bytes:
    stream = io.BytesIO()
    torch.save(value, stream)
    return stream.getvalue()


def at(data: bytes, skew: int) -> memoryview:
    """``data`` starting ``skew`` bytes into a buffer: an entry at any offset of a shard."""
    return memoryview(b"\0" * skew + data)[skew:]


def as_bytes(tensor: torch.Tensor) -> bytes:
    """The values' bits, row-major (what must be equal, NaNs and signed zeros too)."""
    flat = torch.empty(tensor.numel(), dtype=tensor.dtype).copy_(tensor.reshape(-1))
    return bytes(flat.view(torch.uint8).numpy().tobytes())


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    transpose=st.booleans(),
    step=st.integers(1, 3),
    skew=st.integers(0, 63),
    seed=st.integers(0, 2**16),
)
def test_an_entry_built_in_place_equals_torch_load_of_it_bit_for_bit(
    dtype: torch.dtype, shape: list[int], transpose: bool, step: int, skew: int, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    numel, element = math.prod(shape), torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(
        0, 256, ((numel * step + 1) * element,), dtype=torch.uint8, generator=generator
    )
    flat = (raw % 2).bool() if dtype == torch.bool else raw.view(dtype)
    tensor = flat[1 : 1 + numel * step : step]  # a view: torch.save writes its whole storage
    tensor = tensor.reshape(shape)
    if transpose and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)
    data = saved(tensor)
    expected = torch.load(io.BytesIO(data), weights_only=True)
    got = in_place_tensor(at(data, skew), skew, SHARD, "w")
    assert got is not None, "the in-place path was not taken on this torch"
    assert (got.dtype, got.shape, got.stride()) == (
        expected.dtype,
        expected.shape,
        expected.stride(),
    )
    assert got.storage_offset() == expected.storage_offset()
    assert as_bytes(got) == as_bytes(expected)


def test_an_entry_built_in_place_shares_the_mapped_bytes_and_copies_nothing() -> None:
    data = bytearray(saved(torch.arange(1000.0)))
    got = in_place_tensor(memoryview(data), 0, SHARD, "w")
    assert got is not None
    start = memoryview(data).obj  # the buffer's own memory
    assert start is data
    before = got[7].item()
    index = bytes(data).find(torch.arange(1000.0)[7:8].numpy().tobytes())
    data[index : index + 4] = torch.tensor([-1.0]).numpy().tobytes()
    assert (before, got[7].item()) == (7.0, -1.0)  # the same memory, not a copy of it


def test_a_legacy_entry_is_left_to_the_copying_path() -> None:
    stream = io.BytesIO()
    torch.save(torch.ones(3), stream, _use_new_zipfile_serialization=False)
    data = memoryview(stream.getvalue())
    assert in_place_tensor(data, 0, SHARD, "w") is None
    loaded = weights_only_value(io.BytesIO(bytes(data)), SHARD, "w")
    assert torch.equal(loaded, torch.ones(3))


def test_a_torch_without_the_means_is_left_to_the_copying_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(entries, "_in_place_loading", lambda: False)
    assert in_place_tensor(memoryview(saved(torch.ones(2))), 0, SHARD, "w") is None


def test_a_misaligned_entry_elsewhere_than_x86_and_arm_is_left_to_the_copying_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("platform.machine", lambda: "sparc64")
    data = saved(torch.ones(2))
    assert in_place_tensor(at(data, 3), 3, SHARD, "w") is None
    aligned = in_place_tensor(at(data, 0), 16, SHARD, "w")
    assert aligned is not None
    assert torch.equal(aligned, torch.ones(2))


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_an_entry_carrying_pickled_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    data = memoryview(saved({"w": RunsCode(marker)}))
    with pytest.raises(RefusedCheckpoint) as caught:
        in_place_tensor(data, 0, tmp_path / SHARD, "0.weight")
    assert not marker.exists()
    said = str(caught.value)
    assert "refused as unsafe" in said
    assert "'0.weight'" in said
    assert str(tmp_path / SHARD) in said
    assert "system" in said  # what it named


@pytest.mark.parametrize(
    "data", [b"PK\x03\x04" + b"\x17" * 200, saved(torch.ones(64))[:-40]], ids=["junk", "cut"]
)
def test_an_entry_that_does_not_read_is_damaged_naming_it(data: bytes) -> None:
    with pytest.raises(Damaged) as caught:
        in_place_tensor(memoryview(data), 0, SHARD, "0.weight")
    assert "'0.weight'" in str(caught.value)
    assert "cannot be read" in str(caught.value)


def _sharded_weights(ctx: DistContext, folder: Path, in_place: bool) -> tuple[int, list[bytes]]:
    """Load ``folder`` into a fresh sharded model; (entries built in place, the weights' bits)."""
    built = [0]
    original = entries.in_place_tensor

    def counted(*args: Any) -> Any:
        found = original(*args) if in_place else None
        built[0] += found is not None
        return found

    from ddpctx.checkpoint import dcpread

    setattr(dcpread, "in_place_tensor", counted)  # noqa: B010 -- the name dcpread calls
    try:
        model = two_sharded_layers(ctx)
        with torch.no_grad():  # other weights than the saved ones
            for parameter in model.parameters():
                parameter.add_(1.0)
        optimizer = torch.optim.AdamW(model.parameters())
        ctx.load_checkpoint(folder, model=model, optimizer=optimizer)
        state = ctx.full_state_dict(model)
    finally:
        setattr(dcpread, "in_place_tensor", original)  # noqa: B010
    flat = [as_bytes(t) for t in state.values()]
    return built[0], flat


@pytest.mark.distributed(world_size=2, timeout=90)
def test_a_sharded_load_builds_entries_in_place_and_ends_as_the_copying_load(
    dist_ctx: DistContext, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ctx = dist_ctx
    folder, model = shared_folder(ctx, tmp_path_factory), two_sharded_layers(ctx)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    ctx.save_checkpoint(folder, model=model, optimizer=optimizer, epoch=0)
    built, fast = _sharded_weights(ctx, folder, in_place=True)
    none, slow = _sharded_weights(ctx, folder, in_place=False)
    assert built > 0
    assert none == 0
    if ctx.is_main:
        assert fast == slow
        assert len(fast) == 4
