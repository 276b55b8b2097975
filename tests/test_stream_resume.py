"""Streams resumed mid-epoch: by their saved state, by replay, or named when they cannot be.

The SIGKILL-and-torchrun cases are in the equivalence matrix (tests/test_equivalence.py,
the ``:stream`` cells).
"""

from __future__ import annotations

import contextlib
import json
import random
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset

from ddpctx import current, distributed
from ddpctx.data.streamloader import StreamReplayWarning
from ddpctx.data.streamsplit import NotReplayable

#: Replay's once-per-resume note is asserted where it is the subject, silenced elsewhere.
pytestmark = pytest.mark.filterwarnings("ignore::ddpctx.data.streamloader.StreamReplayWarning")


class Noisy(IterableDataset[torch.Tensor]):
    """37 numbered samples with a random draw each, numbered anew every epoch."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        for number in range(37):
            yield torch.tensor([number + 1000.0 * self.epoch, random.random()])


class Resumable(Noisy):
    """The same samples, with the Stateful protocol: it reads on from its saved position."""

    def __init__(self) -> None:
        super().__init__()
        self.read = 0
        self.loaded = False

    def state_dict(self) -> dict[str, int]:
        return {"read": self.read, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.read, self.epoch, self.loaded = state["read"], state["epoch"], True

    def __iter__(self) -> Iterator[torch.Tensor]:
        first = self.read if self.loaded else 0
        self.loaded = False
        for number in range(first, 37):
            self.read = number + 1
            yield torch.tensor([number + 1000.0 * self.epoch, random.random()])


class Clocked(Noisy):
    """Not deterministic: what it yields depends on the time."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        for number in range(37):
            yield torch.tensor([float(number), float(time.perf_counter_ns() % 1000)])


DATASETS = {"replayed": Noisy, "stateful": Resumable, "clocked": Clocked}


def run(
    kind: str,
    folder: Path,
    *,
    workers: int = 0,
    buffer: int = 0,
    stop_at: int | None = None,
) -> list[torch.Tensor]:
    """Two epochs, batches of 4; with ``stop_at``, save at that step and stop; resume first."""
    read = []
    active = current()  # a rank of the plugin's pool is inside distributed() already
    with contextlib.nullcontext(active) if active is not None else distributed(seed=3) as ctx:
        model = nn.Linear(2, 1)
        loader = ctx.dataloader(
            DATASETS[kind](), batch_size=4, num_workers=workers, shuffle_buffer=buffer or None
        )
        meta = ctx.load_checkpoint(folder, model=model)
        epoch0, step = (meta["epoch"], meta["step"]) if meta else (0, 0)
        for epoch in ctx.epochs(2, start=epoch0):
            for batch in loader:
                read.append(batch)
                step += 1
                if step == stop_at:
                    ctx.save_checkpoint(folder, model=model, epoch=epoch, step=step)
                    return read
    return read


def same(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(map(torch.equal, first, second))


CASES = [
    pytest.param("replayed", 0, 0, 0, id="replayed"),
    pytest.param("stateful", 0, 0, 0, id="stateful"),
    pytest.param("replayed", 0, 5, 0, id="shuffle-buffer"),
    pytest.param("stateful", 2, 0, 2, marks=pytest.mark.slow, id="stateful-2workers"),
    pytest.param("replayed", 2, 5, 2, marks=pytest.mark.slow, id="buffer-2workers"),
    pytest.param("replayed", 0, 0, 2, marks=pytest.mark.slow, id="0-then-2-workers"),
    pytest.param("stateful", 2, 0, 0, marks=pytest.mark.slow, id="stateful-2-then-0-workers"),
]


@pytest.mark.parametrize(("kind", "workers", "buffer", "resumed_workers"), CASES)
def test_a_stream_resumed_mid_epoch_reads_exactly_what_an_uninterrupted_run_reads(
    tmp_path: Path, kind: str, workers: int, buffer: int, resumed_workers: int
) -> None:
    whole = run(kind, tmp_path / "whole", workers=workers, buffer=buffer)
    assert len(whole) == 20  # 10 batches per epoch
    first = run(kind, tmp_path / "cut", workers=workers, buffer=buffer, stop_at=7)
    rest = run(kind, tmp_path / "cut", workers=resumed_workers, buffer=buffer)
    assert same(first + rest, whole)


def replay_notes_on_this_rank(folder: str) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run("replayed", Path(folder))
    return sum(issubclass(w.category, StreamReplayWarning) for w in caught)


def test_a_replayed_resume_is_said_once_for_the_job_not_once_per_rank(
    run_distributed: Any, tmp_path: Path
) -> None:
    run_distributed(lambda: run("replayed", tmp_path, stop_at=3), world_size=3)
    assert run_distributed(replay_notes_on_this_rank, str(tmp_path), world_size=3) == [1, 0, 0]


def test_replay_says_its_cost_once_and_stateful_streams_need_none(tmp_path: Path) -> None:
    run("replayed", tmp_path / "a", stop_at=3)
    run("stateful", tmp_path / "b", stop_at=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run("replayed", tmp_path / "a")
        run("stateful", tmp_path / "b")
    notes = [str(w.message) for w in caught if issubclass(w.category, StreamReplayWarning)]
    assert len(notes) == 1
    where = [w.filename for w in caught if issubclass(w.category, StreamReplayWarning)]
    assert where == [__file__]  # the user's loop, not ddpctx's timing wrapper
    assert "resumes Noisy mid-epoch 0 by reading its stream again" in notes[0]
    assert "skipping the 3 batches (about 12 samples)" in notes[0]
    assert "give it both (the torchdata Stateful protocol)" in notes[0]


def test_a_stream_that_is_not_deterministic_is_named_at_resume(tmp_path: Path) -> None:
    run("clocked", tmp_path, stop_at=3)
    with pytest.raises(NotReplayable, match=r"could not resume Clocked exactly: .* batch 2 holds"):
        run("clocked", tmp_path)


def read_and_save(folder: str, stop_at: int | None, buffer: int = 0) -> list[int]:
    """Resume from ``folder`` (any world size), read on; save and stop after ``stop_at`` steps."""
    ctx = current()
    assert ctx is not None
    stream = Noisy()
    loader = ctx.dataloader(stream, batch_size=2, name="train", shuffle_buffer=buffer or None)
    model = nn.Linear(1, 1)
    ctx.load_checkpoint(folder, model=model, allow_world_size_change=True)
    read = []
    for epoch in ctx.epochs(1):
        for step, batch in enumerate(loader, start=1):
            read += [int(value) for value in batch[:, 0]]
            if step == stop_at:
                ctx.save_checkpoint(folder, model=model, epoch=epoch, step=step)
                return read
    return read


@pytest.mark.slow
def test_a_world_size_change_mid_epoch_deals_the_unread_samples_anew_exactly(
    run_distributed: Any, tmp_path: Path
) -> None:
    folder = str(tmp_path)
    first = run_distributed(read_and_save, folder, 3, world_size=2)  # 12 of 37 read
    second = run_distributed(read_and_save, folder, 2, world_size=3)  # 12 more, dealt anew
    rest = run_distributed(read_and_save, folder, None, world_size=2)  # and back to 2
    read = [n for run in (first, second, rest) for rank in run for n in rank]
    assert len(read) == len(set(read)), "a sample was read twice"
    assert len(read) >= 37 - 2 * 2, "more than a batch per rank left out"
    assert [len(rank) for rank in second] == [4, 4, 4]


@pytest.mark.slow
def test_a_world_size_change_mid_epoch_with_a_shuffle_buffer_is_refused_with_the_reason(
    run_distributed: Any, tmp_path: Path
) -> None:
    run_distributed(read_and_save, str(tmp_path), 3, 4, world_size=2)
    with pytest.raises(Exception, match=r"saved mid-epoch 0 by 2 ranks; this run has 3, .*"):
        run_distributed(read_and_save, str(tmp_path), None, 4, world_size=3)


def hugging_face_run(files: list[str], folder: str, stop_at: int | None) -> list[list[int]]:
    import datasets

    ctx = current()
    assert ctx is not None
    stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    loader = ctx.dataloader(stream, batch_size=3, num_workers=2)
    model = nn.Linear(1, 1)
    meta = ctx.load_checkpoint(folder, model=model)
    epoch0, step = (meta["epoch"], meta["step"]) if meta else (0, 0)
    read = []
    for epoch in ctx.epochs(2, start=epoch0):
        for batch in loader:
            read.append(batch["id"].tolist())
            step += 1
            if step == stop_at:
                ctx.save_checkpoint(folder, model=model, epoch=epoch, step=step)
                return read
    return read


@pytest.mark.slow
@pytest.mark.integration("datasets")
def test_a_hugging_face_streaming_dataset_is_split_by_node_and_resumed_exactly(
    run_distributed: Any, tmp_path: Path
) -> None:
    files = []
    for shard in range(4):  # four files: each rank gets two, each worker one
        path = tmp_path / f"part{shard}.jsonl"
        path.write_text("".join(json.dumps({"id": shard * 100 + i}) + "\n" for i in range(10)))
        files.append(str(path))
    whole = run_distributed(hugging_face_run, files, str(tmp_path / "a"), None, world_size=2)
    ids = [i for rank in whole for batch in rank for i in batch]
    assert sorted(ids) == sorted(2 * [shard * 100 + i for shard in range(4) for i in range(10)])
    first = run_distributed(hugging_face_run, files, str(tmp_path / "b"), 5, world_size=2)
    rest = run_distributed(hugging_face_run, files, str(tmp_path / "b"), None, world_size=2)
    assert [a + b for a, b in zip(first, rest, strict=True)] == whole


def test_a_loader_made_after_the_load_resumes_and_a_map_position_is_not_taken_for_a_stream(
    tmp_path: Path,
) -> None:
    whole = run("stateful", tmp_path / "whole")
    run("stateful", tmp_path / "cut", stop_at=7)
    with distributed(seed=3) as ctx:
        meta = ctx.load_checkpoint(tmp_path / "cut", model=nn.Linear(2, 1))
        assert meta is not None
        loader = ctx.dataloader(Resumable(), batch_size=4)  # made after the load
        rest = [batch for _ in ctx.epochs(2, start=meta["epoch"]) for batch in loader]
        assert loader.start == 0  # the second epoch was not resumed
    assert same(whole[:7] + rest, whole)
    with distributed(seed=3) as ctx:
        loader = ctx.dataloader(list(range(40)), batch_size=4, name="train")
        for step, _ in enumerate(loader):
            if step == 2:
                ctx.save_checkpoint(tmp_path / "map", model=nn.Linear(1, 1), epoch=0, step=2)
                break
    with distributed(seed=3) as ctx:
        ctx.load_checkpoint(tmp_path / "map", model=nn.Linear(1, 1))
        with pytest.raises(ValueError, match="reading a map-style dataset, but the loader"):
            ctx.dataloader(Noisy(), batch_size=4, name="train")


class Uneven(IterableDataset[torch.Tensor]):
    """Splits itself by rank: rank 0 holds 9 samples, rank 1 holds 3."""

    splits_itself = "ranks"

    def __iter__(self) -> Iterator[torch.Tensor]:
        ctx = current()
        assert ctx is not None
        count = 9 if ctx.rank == 0 else 3
        return iter(torch.tensor([ctx.rank * 100.0 + n]) for n in range(count))


def uneven_run(folder: str, save: bool) -> list[float]:
    ctx = current()
    assert ctx is not None
    loader = ctx.dataloader(Uneven(), batch_size=2, pad=False, name="eval")
    if not save:
        ctx.load_checkpoint(folder, model=nn.Linear(1, 1))
        return [float(v) for _ in ctx.epochs(1) for batch in loader for v in batch]
    for epoch in ctx.epochs(1):
        batches = iter(loader)
        taken = [next(batches) for _ in range(2 if ctx.rank == 0 else 0)]
        ctx.save_checkpoint(folder, model=nn.Linear(1, 1), epoch=epoch, step=len(taken))
    return []


@pytest.mark.slow
def test_a_rank_that_had_read_nothing_when_saved_reads_its_whole_share_after_the_resume(
    run_distributed: Any, tmp_path: Path
) -> None:
    run_distributed(uneven_run, str(tmp_path), True, world_size=2)
    rest = run_distributed(uneven_run, str(tmp_path), False, world_size=2)
    assert rest == [[4.0, 5.0, 6.0, 7.0, 8.0], [100.0, 101.0, 102.0]]


class WorkerHalves(IterableDataset[torch.Tensor]):
    """Splits itself between workers: worker w yields 100 * w + 0..9."""

    splits_itself = "ranks_and_workers"

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        worker = info.id if info is not None else 0
        return iter(torch.tensor([100.0 * worker + n]) for n in range(10))


def test_a_stream_splitting_itself_between_workers_keeps_its_num_workers_to_resume(
    tmp_path: Path,
) -> None:
    with distributed() as ctx:
        loader = ctx.dataloader(WorkerHalves(), batch_size=2, num_workers=2)
        for step, _ in enumerate(loader, start=1):
            if step == 3:
                ctx.save_checkpoint(tmp_path, model=nn.Linear(1, 1), epoch=0, step=step)
                break
    with distributed() as ctx:
        ctx.load_checkpoint(tmp_path, model=nn.Linear(1, 1))
        with pytest.raises(ValueError, match=r"saved reading with 2 worker\(s\) .* Resume with"):
            ctx.dataloader(WorkerHalves(), batch_size=2)
        resumed = ctx.dataloader(WorkerHalves(), batch_size=2, num_workers=2)  # still resumes
        read = [int(v) for _ in ctx.epochs(1) for batch in resumed for v in batch]
    assert read == [102, 103, 4, 5, 104, 105, 6, 7, 106, 107, 8, 9, 108, 109]
