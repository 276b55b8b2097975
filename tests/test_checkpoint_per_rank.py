"""Each rank verifies the checkpoint files it reads itself, and every rank loads the same one.

Every rank reads its own copy, as ranks on other hosts do: the checkpoint
directory is one path, ``ROOT/run``, a symlink to ``/proc/self/cwd/run``,
and each rank runs in its own ``ROOT/rank<N>`` holding a copy of the
directory -- so the same path names another copy in each rank process. A
byte flipped in one rank's copy alone must be caught by that rank, and
every rank must then load the same older checkpoint (weights and optimizer
moments exactly as saved), with a warning naming the file and the rank.
Real ranks from the plugin's pool, a real gloo group, real files.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from ddpctx import DistContext, current

MODES = ["ddp", "sharded"]
pytestmark = pytest.mark.timeout(120)  # each test; the property tests have their own


def context() -> DistContext:
    ctx = current()
    assert ctx is not None
    return ctx


def build(ctx: DistContext, shard: bool, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    return ctx.shard(model, blocks=[nn.Linear]) if shard else ctx.wrap(model)


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Copies of the whole model and optimizer state (weights, Adam's moments), on every rank."""
    options = StateDictOptions(full_state_dict=True)  # whole on every rank (no cpu_offload)
    weights = get_model_state_dict(model, options=options)
    moments = get_optimizer_state_dict(model, optimizer, options=options)["state"]
    return copy.deepcopy({"weights": weights, "moments": moments})


def save_two(folder: str, shard: bool) -> list[dict[str, Any]]:
    """Checkpoints of epochs 0 and 1 (AdamW, two steps each); their states."""
    ctx = context()
    model = build(ctx, shard, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(100 + ctx.rank)
    states = []
    for epoch in (0, 1):
        for _ in range(2):
            x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 3, generator=generator)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        ctx.save_checkpoint(folder, model=model, optimizer=optimizer, epoch=epoch)
        states.append(digest(model, optimizer))
    return states


def load_own_copy(root: str, shard: bool) -> dict[str, Any]:
    """This rank loads ``ROOT/run`` -- its own copy -- into a fresh model; what it got and said."""
    ctx = context()
    os.chdir(Path(root) / f"rank{ctx.rank}")  # the plugin restores the working directory
    model = build(ctx, shard, seed=9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = ctx.load_checkpoint(Path(root) / "run", model=model, optimizer=optimizer)
    return {
        "meta": meta,
        "state": digest(model, optimizer),
        "warnings": [str(w.message) for w in caught if "skipping" in str(w.message)],
    }


def same(mine: Any, theirs: Any) -> bool:
    if isinstance(mine, torch.Tensor):
        return isinstance(theirs, torch.Tensor) and torch.equal(mine, theirs)
    if isinstance(mine, dict):
        return mine.keys() == theirs.keys() and all(same(mine[k], theirs[k]) for k in mine)
    return bool(mine == theirs)


def copies(root: Path, world_size: int) -> Path:
    """``root/rank<N>/run`` for every rank (the first is the saved one); ``root/run`` to them."""
    for rank in range(1, world_size):
        shutil.copytree(root / "rank0" / "run", root / f"rank{rank}" / "run")
    (root / "run").symlink_to("/proc/self/cwd/run")
    return root / "run"


def saved_copies(run_distributed: Any, root: Path, shard: bool) -> list[dict[str, Any]]:
    (root / "rank0").mkdir()
    states: list[dict[str, Any]] = run_distributed(
        save_two, str(root / "rank0" / "run"), shard, world_size=2, timeout=90
    )[0]
    copies(root, 2)
    return states


def newest_in(root: Path, rank: int) -> Path:
    folder = root / f"rank{rank}" / "run"
    return max(p for p in folder.glob("checkpoint-*") if not p.name.endswith(".sums"))


def flip(path: Path, offset: int, mask: int = 0x10) -> bytes:
    """XOR one byte of ``path`` in place; the original bytes."""
    original = path.read_bytes()
    with path.open("r+b") as stream:
        stream.seek(offset)
        stream.write(bytes([original[offset] ^ mask]))
    return original


def assert_everyone_loaded(
    results: list[dict[str, Any]], state: dict[str, Any], epoch: int
) -> None:
    for rank, result in enumerate(results):
        assert result["meta"] == {"epoch": epoch}, (rank, result["warnings"])
        if epoch == 1:  # the newest: no false alarm from any rank's verification
            assert not result["warnings"], (rank, result["warnings"])
        assert same(result["state"]["weights"], state["weights"]), rank
        assert same(result["state"]["moments"], state["moments"]), rank


def assert_named(results: list[dict[str, Any]], name: str, rank: int) -> None:
    """Rank 0 and the rank that found it each warned once, naming the file and that rank."""
    for warner in {0, rank}:
        said = results[warner]["warnings"]
        assert len(said) == 1, (warner, said)
        assert repr(name) in said[0] or f"/{name}'" in said[0], (warner, said)
        assert f"found by rank {rank}," in said[0], (warner, said)


DAMAGED = [
    pytest.param("ddp", "", id="ddp-pt"),
    pytest.param("sharded", "__1_0.distcp", id="sharded-own-shard"),
    pytest.param("sharded", "ddpctx.pt", id="sharded-ddpctx.pt"),
    pytest.param("sharded", ".metadata", id="sharded-metadata"),
]


@pytest.mark.parametrize(("mode", "name"), DAMAGED)
def test_a_file_damaged_in_one_ranks_copy_makes_every_rank_load_the_older_checkpoint(
    run_distributed: Any, tmp_path: Path, mode: str, name: str
) -> None:
    states = saved_copies(run_distributed, tmp_path, mode == "sharded")
    damaged = newest_in(tmp_path, 1) / name if name else newest_in(tmp_path, 1)
    flip(damaged, damaged.stat().st_size // 2)  # rank 1's copy only
    results = run_distributed(load_own_copy, str(tmp_path), mode == "sharded", timeout=90)
    assert_everyone_loaded(results, states[0], epoch=0)
    assert_named(results, damaged.name, rank=1)


def drop_parts(manifest: Path) -> None:
    """Rewrite a sharded manifest as ddpctx wrote it before per-entry checksums: the CRC-32 of
    each whole file (format 1, as it was then)."""
    body = json.loads(manifest.read_text().splitlines()[0])
    body["format"], body["algorithm"] = "ddpctx-sums-1", "crc32"
    for name, entry in body["files"].items():
        entry.pop("parts", None)
        entry.pop("digest", None)
        entry["crc32"] = f"{zlib.crc32((manifest.parent / name).read_bytes()):08x}"
    text = json.dumps(body, separators=(",", ":"), sort_keys=True)
    manifest.write_text(f"{text}\ncrc32 {zlib.crc32(text.encode()):08x}\n")


def test_a_checkpoint_with_a_manifest_from_before_per_entry_sums_loads_and_is_verified(
    run_distributed: Any, tmp_path: Path
) -> None:
    states = saved_copies(run_distributed, tmp_path, True)
    for rank in (0, 1):
        for checkpoint in (tmp_path / f"rank{rank}" / "run").glob("checkpoint-*"):
            drop_parts(checkpoint / "ddpctx.sums")
    results = run_distributed(load_own_copy, str(tmp_path), True, timeout=90)
    assert_everyone_loaded(results, states[1], epoch=1)  # it loads as before
    damaged = newest_in(tmp_path, 1) / "__1_0.distcp"
    flip(damaged, damaged.stat().st_size // 2)  # each shard rank 1 reads is verified whole
    results = run_distributed(load_own_copy, str(tmp_path), True, timeout=90)
    assert_everyone_loaded(results, states[0], epoch=0)
    assert_named(results, damaged.name, rank=1)


def checkpoint_files(root: Path) -> list[str]:
    """Every file of rank 0's newest checkpoint, relative to its run directory."""
    newest = newest_in(root, 0)
    if newest.is_file():
        return [newest.name, newest.name + ".sums"]
    return [f"{newest.name}/{p.name}" for p in sorted(newest.iterdir())]


@pytest.mark.slow  # 2-rank loads, one per example: ~10 s each
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
def test_a_byte_flipped_anywhere_in_one_ranks_copy_is_caught_by_the_rank_that_reads_it(
    run_distributed: Any, tmp_path: Path, mode: str
) -> None:
    shard = mode == "sharded"
    states = saved_copies(run_distributed, tmp_path, shard)
    names = checkpoint_files(tmp_path)

    # no shrinking: a failure is reported as drawn (each example is a 2-rank load)
    @settings(max_examples=20, deadline=None, database=None, phases=(Phase.generate,))
    @given(st.sampled_from(names), st.sampled_from([0, 1]), st.data())
    def flipped(name: str, rank: int, data: st.DataObject) -> None:
        path = tmp_path / f"rank{rank}" / "run" / name
        offset = data.draw(st.integers(0, path.stat().st_size - 1), label="offset")
        mask = data.draw(st.integers(1, 255), label="mask")
        original = flip(path, offset, mask)
        try:
            results = run_distributed(load_own_copy, str(tmp_path), shard, timeout=90)
        finally:
            path.write_bytes(original)
        other_ranks_shard = (
            Path(name).name.startswith("__") and Path(name).name != f"__{rank}_0.distcp"
        )
        if other_ranks_shard and results[0]["meta"] == {"epoch": 1}:
            # rank ``rank`` read none of the flipped bytes of another rank's shard (the others
            # read their own copies): the newest loads, exactly as saved, on every rank
            assert_everyone_loaded(results, states[1], epoch=1)
            return
        assert_everyone_loaded(results, states[0], epoch=0)
        assert_named(results, Path(name).name, rank)

    flipped()


def save_thrice_measuring_the_last(folder: str, shard: bool) -> tuple[int, int]:
    """Three saves with keep=2; the bytes this process read during the third, and one's size."""

    def bytes_read() -> int:
        lines = Path("/proc/self/io").read_text().splitlines()
        return int(next(line.split()[1] for line in lines if line.startswith("rchar:")))

    ctx = context()
    torch.manual_seed(0)
    big = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))  # 4 MiB of weights
    model = ctx.shard(big, blocks=[nn.Linear]) if shard else ctx.wrap(big)
    for epoch in range(2):
        ctx.save_checkpoint(folder, model=model, keep=2, epoch=epoch)
    size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file()) // 2
    before = bytes_read()
    ctx.save_checkpoint(folder, model=model, keep=2, epoch=2)
    return bytes_read() - before, size


@pytest.mark.parametrize("mode", MODES)
def test_keep_does_not_reread_the_previous_checkpoint_at_each_save(
    run_distributed: Any, tmp_path: Path, mode: str
) -> None:
    # before, keep=2 read the whole previous checkpoint at every save to see that it loads
    ((read, size),) = run_distributed(
        save_thrice_measuring_the_last, str(tmp_path), mode == "sharded", world_size=1
    )
    # nothing is read back: a .pt is hashed as it is written, and each shard as DCP writes it
    # (before, a sharded save read its own shards back once to checksum them)
    allowed = size // 2
    assert read < allowed, f"the save read {read} bytes; a checkpoint is {size}"
