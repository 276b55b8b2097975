"""Every reader picks the same checkpoint, whatever happened to the newest one's files.

Two checkpoints (steps 1 and 2, every weight filled with its step) are saved by two
real ranks (gloo), as DDP ``.pt`` files (``ctx.wrap``) or sharded ``.dcp`` folders
(``ctx.shard``); the newest is then altered as the outside attack did: a file its
manifest lists is gone, or is a FIFO; a shard no rank reads is damaged; two
checkpoints share a number. The four readers -- ``checkpoint_meta``, ``load_weights``,
``python -m ddpctx export`` (its entry point) and ``ctx.load_checkpoint`` at 2 ranks --
must decide alike, each warning with the file's name, and none may hang (each runs on
the plugin's ranks, under a timeout).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpctx import checkpoint_meta, current, load_weights
from ddpctx.checkpoint.sums import file_sum, sidecar, write_manifest
from ddpctx.cli import main as cli

pytestmark = pytest.mark.timeout(300)

#: How each run builds its model: DDP, sharded, and sharded so small that rank 1's shard
#: holds empty chunks alone (a file no rank's load reads).
HOWS = ("wrap", "shard", "shard-tiny")
READERS = ("checkpoint_meta", "load_weights", "export", "load_checkpoint")


def model_for(how: str) -> nn.Module:
    torch.manual_seed(0)
    if how == "shard-tiny":
        return nn.Sequential(nn.Linear(4, 1))
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def placed(how: str) -> nn.Module:
    ctx = current()
    assert ctx is not None
    model = model_for(how)
    return ctx.wrap(model) if how == "wrap" else ctx.shard(model)


def save_steps(folder: str, how: str, steps: list[int]) -> None:
    """On each rank: a checkpoint per step, every weight filled with its step."""
    ctx = current()
    assert ctx is not None
    model = placed(how)
    for step in steps:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(float(step))
        ctx.save_checkpoint(folder, model=model, step=step, keep=10)


def one_step(weights: dict[str, torch.Tensor]) -> int:
    """The step every tensor of one read holds."""
    values = {float(v) for tensor in weights.values() for v in (tensor.min(), tensor.max())}
    assert len(values) == 1, f"one read mixes checkpoints: {sorted(values)}"
    return int(values.pop())


def loaded_on_a_rank(folders: list[str], how: str) -> tuple[int | str, list[str]]:
    """``ctx.load_checkpoint`` on this rank (of its own view, ``folders[rank]``): the step
    restored (the weights' step, checked against the meta's) or the error, and the warnings."""
    ctx = current()
    assert ctx is not None
    model = placed(how)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            meta = ctx.load_checkpoint(folders[ctx.rank], model=model)
        except Exception as error:
            return f"{type(error).__name__}: {error}", [str(w.message) for w in caught]
    assert meta is not None
    full = ctx.full_state_dict(model)
    if ctx.is_main:
        assert one_step(full) == meta["step"], (full, meta)
    return int(meta["step"]), [str(w.message) for w in caught]


def read_in_one_process(reader: str, folder: str) -> tuple[int | str, list[str]]:
    """A one-process reader's choice of ``folder``: the step it read (or its error), warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if reader == "checkpoint_meta":
                meta = checkpoint_meta(folder)
                assert meta is not None
                step: int | str = int(meta["step"])
            elif reader == "load_weights":
                step = one_step(load_weights(folder))
            else:
                out = Path(folder).parent / "exported.pt"
                assert cli(["export", folder, str(out)]) == 0
                exported = torch.load(out, weights_only=True)
                step = one_step(exported["model"])
                assert exported["meta"]["step"] == step
        except Exception as error:
            step = f"{type(error).__name__}: {error}"
    return step, [str(w.message) for w in caught]


def every_reader(
    run_distributed: Any, folder: Path, how: str, views: list[Path] | None = None
) -> dict[str, list[tuple[int | str, list[str]]]]:
    """Each reader's choice (and warnings), per process: three one-process readers, each on
    a rank of its own, and ``load_checkpoint`` at 2 ranks (rank r reading ``views[r]``)."""
    said = {
        reader: run_distributed(read_in_one_process, reader, str(folder), world_size=1, timeout=60)
        for reader in READERS[:3]
    }
    rank_folders = [str(view) for view in (views or [folder, folder])]
    said["load_checkpoint"] = run_distributed(
        loaded_on_a_rank, rank_folders, how, world_size=2, timeout=120
    )
    return said


_SAVED: dict[str, Path] = {}


@pytest.fixture
def two_saved(run_distributed: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``two_saved(how, into)``: a copy, at ``into``, of two checkpoints saved by 2 ranks."""

    def copy(how: str, into: Path) -> Path:
        if how not in _SAVED:
            where = tmp_path_factory.mktemp(how) / "run"
            run_distributed(save_steps, str(where), how, [1, 2], world_size=2, timeout=120)
            _SAVED[how] = where
        shutil.copytree(_SAVED[how], into)
        return into

    return copy


def newest(folder: Path) -> Path:
    return max(p for p in folder.glob("checkpoint-*") if not p.name.endswith(".sums"))


def assert_all_chose(said: dict[str, list[tuple[int | str, list[str]]]], step: int) -> None:
    chosen = {reader: [found for found, _ in each] for reader, each in said.items()}
    assert all(found == [step] * len(found) for found in chosen.values()), said


def assert_each_warned(said: dict[str, list[tuple[int | str, list[str]]]], *words: str) -> None:
    """Every reader warned (on one rank at least) with each of ``words`` in one warning."""
    for reader, each in said.items():
        warned = [text for _, texts in each for text in texts]
        assert any(all(w in text for w in words) for text in warned), (reader, words, warned)


# -- a file the newest checkpoint's manifest lists is gone


def lose_a_listed_file(checkpoint: Path, how: str) -> str:
    """Remove a file the manifest of ``checkpoint`` lists; its name."""
    if how == "wrap":  # a .pt's manifest lists the .pt alone: one that lists another file too
        write_manifest(
            sidecar(checkpoint), {checkpoint.name: file_sum(checkpoint), "notes.bin": (5, "0")}
        )
        return "notes.bin"
    (checkpoint / "__1_0.distcp").unlink()  # rank 1's shard (empty chunks only when tiny)
    return "__1_0.distcp"


@pytest.mark.parametrize("how", HOWS)
def test_a_listed_file_gone_from_the_newest_checkpoint_makes_every_reader_use_the_older(
    two_saved: Any, run_distributed: Any, tmp_path: Path, how: str
) -> None:
    # Found by the outside attack: checkpoint_meta, load_weights and the export used the
    # older checkpoint with a warning, and load_checkpoint restored the newer one in silence
    # (no rank reads a shard of empty chunks, nor a .pt manifest's other files).
    folder = two_saved(how, tmp_path / "run")
    lost = lose_a_listed_file(newest(folder), how)
    said = every_reader(run_distributed, folder, how)
    assert_all_chose(said, 1)
    assert_each_warned(said, newest(folder).name, lost, "missing")


def test_a_shard_one_rank_lacks_and_another_holds_is_no_damage(
    two_saved: Any, run_distributed: Any, tmp_path: Path
) -> None:
    # Ranks may not share a file system: rank 1's view lacks rank 0's shard, which it does
    # not read. Every file is held by some rank, so the newest loads on both.
    folder = two_saved("shard", tmp_path / "run")
    view = tmp_path / "view-of-rank-1"
    shutil.copytree(folder, view)
    (newest(view) / "__0_0.distcp").unlink()
    said = run_distributed(loaded_on_a_rank, [str(folder), str(view)], "shard", world_size=2)
    assert [step for step, _ in said] == [2, 2], said
    assert [texts for _, texts in said] == [[], []], said


def test_a_shard_lacking_on_the_rank_that_reads_it_sends_every_rank_to_the_older(
    two_saved: Any, run_distributed: Any, tmp_path: Path
) -> None:
    folder = two_saved("shard", tmp_path / "run")
    view = tmp_path / "view-of-rank-1"
    shutil.copytree(folder, view)
    (newest(view) / "__1_0.distcp").unlink()  # rank 1 reads it; rank 0 holds it
    said = run_distributed(loaded_on_a_rank, [str(folder), str(view)], "shard", world_size=2)
    assert [step for step, _ in said] == [1, 1], said
    assert any("__1_0.distcp" in text and "rank 1" in text for text in said[0][1]), said


def test_a_flipped_byte_in_a_shard_no_rank_reads_makes_every_reader_use_the_older(
    two_saved: Any, run_distributed: Any, tmp_path: Path
) -> None:
    # Rank 1's shard of a tiny model holds empty chunks alone: no load plan reads it, and a
    # damaged one was restored by load_checkpoint while the other readers skipped it.
    folder = two_saved("shard-tiny", tmp_path / "run")
    shard = newest(folder) / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    said = every_reader(run_distributed, folder, "shard-tiny")
    assert_all_chose(said, 1)
    assert_each_warned(said, "__1_0.distcp", "damaged")


# -- a FIFO named like a checkpoint's file


def plant_a_fifo(folder: Path, where: str) -> tuple[str, int]:
    """A FIFO in place of a checkpoint's file (see :data:`FIFOS`); its name, the step expected."""
    if where == "new-pt":  # a number of its own, no manifest (made with mkfifo)
        os.mkfifo(folder / "checkpoint-000003.pt")
        return "checkpoint-000003.pt", 2
    checkpoint = newest(folder)
    target = {"newest-pt": checkpoint}.get(where) or checkpoint / where.removeprefix("dcp:")
    target.unlink()
    os.mkfifo(target)
    return target.name, 1


FIFOS = ["new-pt", "newest-pt", "dcp:ddpctx.pt", "dcp:.metadata", "dcp:__0_0.distcp"]


@pytest.mark.parametrize("where", FIFOS)
def test_a_fifo_named_like_a_checkpoint_file_is_said_as_one_and_never_waited_on(
    two_saved: Any, run_distributed: Any, tmp_path: Path, where: str
) -> None:
    # Found by the outside attack: a FIFO checkpoint-000003.pt hung every reader opening it;
    # with its manifest, it was "0 bytes" (torn). It is damage, as a FIFO manifest is.
    how = "shard" if where.startswith("dcp:") else "wrap"
    folder = two_saved(how, tmp_path / "run")
    name, step = plant_a_fifo(folder, where)
    said = every_reader(run_distributed, folder, how)
    assert_all_chose(said, step)
    assert_each_warned(said, name, "is a FIFO (a named pipe), not a regular file")
    for reader, each in said.items():
        assert not any("0 bytes" in text for _, texts in each for text in texts), (reader, each)


def test_a_save_beside_a_fifo_named_like_a_checkpoint_does_not_wait_on_it(
    two_saved: Any, run_distributed: Any, tmp_path: Path
) -> None:
    # Pruning asks whether older checkpoints load: the FIFO is one that does not.
    folder = two_saved("wrap", tmp_path / "run")
    plant_a_fifo(folder, "new-pt")
    run_distributed(save_steps, str(folder), "wrap", [4], world_size=2, timeout=60)
    said = every_reader(run_distributed, folder, "wrap")
    assert_all_chose(said, 4)


# -- two checkpoints of one number


def renumbered(checkpoint: Path, name: str) -> Path:
    """``checkpoint`` renamed ``name``, its manifest with it (as a copy from elsewhere would be)."""
    target = checkpoint.with_name(name)
    checkpoint.rename(target)
    if target.is_file():
        sidecar(checkpoint).unlink()
        write_manifest(sidecar(target), {target.name: file_sum(target)})
    return target


def test_two_files_of_one_number_are_named_and_every_reader_uses_the_same(
    two_saved: Any, run_distributed: Any, tmp_path: Path
) -> None:
    # Found by the outside attack: the readers took the later name without a word.
    folder = two_saved("wrap", tmp_path / "run")
    run_distributed(save_steps, str(folder), "wrap", [3], world_size=2, timeout=60)
    renumbered(folder / "checkpoint-000003-step3.pt", "checkpoint-000002-step3.pt")
    said = every_reader(run_distributed, folder, "wrap")
    assert_all_chose(said, 3)
    both = ("checkpoint-000002-step2.pt", "checkpoint-000002-step3.pt")
    assert_each_warned(said, *both, "numbered 000002", "Using 'checkpoint-000002-step3.pt'")


def test_a_file_and_a_sharded_checkpoint_of_one_number_are_named_and_every_reader_uses_the_same(
    two_saved: Any, run_distributed: Any, tmp_path: Path
) -> None:
    # Before: checkpoint_meta, load_weights, the export and an unsharded load took the .pt,
    # a sharded load the .dcp, in silence. Of one number the .dcp is taken: every model loads it.
    folder = two_saved("wrap", tmp_path / "run")
    sharded = two_saved("shard", tmp_path / "sharded")
    run_distributed(save_steps, str(sharded), "shard", [5], world_size=2, timeout=60)
    shutil.copytree(sharded / "checkpoint-000003-step5.dcp", folder / "checkpoint-000002-step5.dcp")
    said = every_reader(run_distributed, folder, "wrap")
    said["load_checkpoint, sharded"] = run_distributed(
        loaded_on_a_rank, [str(folder)] * 2, "shard", world_size=2, timeout=120
    )
    assert_all_chose(said, 5)
    both = ("checkpoint-000002-step2.pt", "checkpoint-000002-step5.dcp")
    assert_each_warned(said, *both, "Using 'checkpoint-000002-step5.dcp'")


def test_a_save_after_two_checkpoints_of_one_number_numbers_past_them(
    two_saved: Any, run_distributed: Any, tmp_path: Path
) -> None:
    folder = two_saved("wrap", tmp_path / "run")
    shutil.copy(folder / "checkpoint-000002-step2.pt", folder / "checkpoint-000002-copy.pt")
    run_distributed(save_steps, str(folder), "wrap", [7], world_size=2, timeout=60)
    assert (folder / "checkpoint-000003-step7.pt").is_file()
    said = every_reader(run_distributed, folder, "wrap")
    assert_all_chose(said, 7)
