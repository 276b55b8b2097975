"""torch.save's zip CRC-32 is skipped where ddpctx's manifest records the file, kept elsewhere.

``torch.load`` never checks a zip record's CRC-32 (a flipped bit loads silently), and
computing it is a third of a ``torch.save`` of large tensors; a checkpoint's manifest
hash, computed as its bytes are written, is what a load checks. So a checkpoint's files
are written without the zip CRC-32, while ``ctx.save`` and exports (no manifest) keep it.
torch's switch is process-wide: nested and overlapping blocks, in any threads, must
leave the setting as they found it -- checked against a model of it (hypothesis).
"""

from __future__ import annotations

import io
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from ddpctx import DistContext, distributed
from ddpctx.checkpoint.sums import SHARDED_MANIFEST, sidecar
from ddpctx.utils import atomic
from ddpctx.utils.atomic import atomic_save, without_zip_crc
from tests.helpers import shared_folder, two_sharded_layers

serialization: Any = torch.serialization


@pytest.fixture(autouse=True)
def _crc_restored() -> Any:
    before = serialization.get_crc32_options()
    yield
    serialization.set_crc32_options(before)


def crcs(path: Path) -> list[int]:
    """The CRC-32 fields of a torch.save file's data records."""
    with zipfile.ZipFile(path) as archive:
        return [info.CRC for info in archive.infolist() if "/data/" in info.filename]


def test_a_recorded_file_is_written_without_zip_crcs_and_loads(tmp_path: Path) -> None:
    seen: list[tuple[int, str]] = []
    atomic_save({"w": torch.arange(64.0)}, tmp_path / "a.pt", seen.append)
    atomic_save({"w": torch.arange(64.0)}, tmp_path / "b.pt")  # no manifest
    assert crcs(tmp_path / "a.pt") == [0]
    assert crcs(tmp_path / "b.pt") != [0]
    with zipfile.ZipFile(tmp_path / "b.pt") as archive:
        assert archive.testzip() is None  # every CRC right
    loaded = torch.load(tmp_path / "a.pt", weights_only=True)
    assert torch.equal(loaded["w"], torch.arange(64.0))
    assert serialization.get_crc32_options() is True  # restored


def test_a_setting_already_off_stays_off(tmp_path: Path) -> None:
    serialization.set_crc32_options(False)
    atomic_save({"w": torch.ones(3)}, tmp_path / "a.pt", lambda saved: None)
    assert serialization.get_crc32_options() is False


class _GlobalSwitch:
    """torch's switch as torch before 2.13 held it: one setting for the whole process."""

    def __init__(self) -> None:
        self.value = True

    def set(self, value: bool) -> None:
        self.value = value

    def get(self) -> bool:
        return self.value


@pytest.fixture(params=["torch's own (per thread)", "process-wide (older torch)"])
def switch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """How the CRC setting is read: per thread (``get(thread)``) -- and whether it is global."""
    atomic._context_local.cache_clear()
    if request.param.startswith("process"):
        fake = _GlobalSwitch()
        monkeypatch.setattr(serialization, "set_crc32_options", fake.set)
        monkeypatch.setattr(serialization, "get_crc32_options", fake.get)
    yield request.param.startswith("process")
    atomic._context_local.cache_clear()


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    found=st.booleans(),
    moves=st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=24),
)
def test_overlapping_blocks_in_threads_restore_the_setting_they_found(
    switch: bool, found: bool, moves: list[tuple[int, bool]]
) -> None:
    # Three threads each enter (True) or leave (False) blocks in the order drawn; a thread
    # leaves only blocks it entered. Inside a block the CRC is off in that thread (in every
    # thread, for a process-wide switch); once the blocks have ended, each thread sees the
    # setting it had before (the one found before the first, process-wide).
    process_wide = switch
    workers = [_Worker() for _ in range(3)]
    try:
        for worker in workers:  # each thread's own setting (the same one, process-wide)
            worker.run(lambda: serialization.set_crc32_options(found))
        assert atomic._context_local() is not process_wide
        stacks: list[list[Any]] = [[], [], []]
        for who, enter in moves:
            if enter:
                stacks[who].append(workers[who].run(_enter))
            elif stacks[who]:
                workers[who].run(_leave(stacks[who].pop()))
            for index, worker in enumerate(workers):
                off = any(stacks) if process_wide else bool(stacks[index])
                assert worker.run(serialization.get_crc32_options) is (False if off else found)
        for who, stack in enumerate(stacks):
            while stack:
                workers[who].run(_leave(stack.pop()))
        for worker in workers:
            assert worker.run(serialization.get_crc32_options) is found
    finally:
        for worker in workers:
            worker.stop()


def _leave(block: Any) -> Any:
    return lambda: block.__exit__(None, None, None)


def _enter() -> Any:
    block = without_zip_crc()
    block.__enter__()
    return block


class _Worker:
    """A thread that runs what it is given, one call at a time, and returns its result."""

    def __init__(self) -> None:
        self._calls: list[Any] = []
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def run(self, call: Any) -> Any:
        done = threading.Event()
        box: list[Any] = []
        with self._ready:
            self._calls.append((call, box, done))
            self._ready.notify()
        assert done.wait(10)
        return box[0]

    def stop(self) -> None:
        with self._ready:
            self._calls.append(None)
            self._ready.notify()
        self._thread.join(10)

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._calls:
                    self._ready.wait()
                item = self._calls.pop(0)
            if item is None:
                return
            call, box, done = item
            box.append(call())
            done.set()


def test_ctx_save_keeps_the_zip_crcs_a_checkpoint_skips_them(tmp_path: Path) -> None:
    with distributed() as ctx:
        model = ctx.wrap(nn.Linear(4, 3))
        ctx.save({"w": torch.arange(8.0)}, tmp_path / "plain.pt")
        path = ctx.save_checkpoint(tmp_path / "run", model=model, epoch=0)
        assert sidecar(path).exists()  # a manifest records it
        assert crcs(path)
        assert set(crcs(path)) == {0}
        assert 0 not in crcs(tmp_path / "plain.pt")
        ctx.load_checkpoint(tmp_path / "run", model=model)  # verified by the manifest
    assert serialization.get_crc32_options() is True


@pytest.mark.distributed(world_size=2, timeout=90)
def test_a_sharded_checkpoints_shards_skip_the_zip_crcs_and_load(
    dist_ctx: DistContext, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ctx = dist_ctx
    folder, model = shared_folder(ctx, tmp_path_factory), two_sharded_layers(ctx)
    path = ctx.save_checkpoint(folder, model=model, epoch=0)
    assert (path / SHARDED_MANIFEST).exists()
    assert serialization.get_crc32_options() is True
    from ddpctx.checkpoint.dcpread import read_metadata

    seen = []
    for info in read_metadata(path / ".metadata", None).storage_data.values():
        if info.relative_path.startswith(f"__{ctx.rank}_"):  # this rank's entries
            data = (path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
            with zipfile.ZipFile(io.BytesIO(data)) as archive:  # each entry: a torch.save zip
                seen += [i.CRC for i in archive.infolist() if "/data/" in i.filename]
    assert seen
    assert set(seen) == {0}
    assert ctx.load_checkpoint(folder, model=model) == {"epoch": 0}
