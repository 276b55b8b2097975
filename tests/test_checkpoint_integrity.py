"""Checkpoints that refuse to lie: a full disk, a second writer, a dead rank, a flipped byte.

Real ranks from the plugin's pool or torchrun, a real gloo group, real files
(a real, small tmpfs for a full disk where this process may mount one).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ddpctx import DistContext, RankError, current, distributed
from ddpctx.checkpoint.sums import (
    OF_PARTS,
    RefusedCheckpoint,
    file_record,
    read_manifest,
    tiles,
    write_manifest,
)
from ddpctx.utils import digest
from tests.helpers import (
    REPO,
    checkpoint_names,
    child_env,
    child_pids,
    patience,
    start_torchrun,
    still_running,
    torchrun_command,
)


def context() -> DistContext:
    ctx = current()
    assert ctx is not None
    return ctx


def tiny_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def big_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256))  # ~1 MiB a rank


@contextlib.contextmanager
def small_tmpfs(size: str) -> Iterator[Path]:
    """A real filesystem of ``size`` (needs the right to mount; skipped without it)."""
    where = Path(f"/tmp/ddpctx-tmpfs-{uuid.uuid4().hex[:8]}")
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        timeout=30,
    )
    if mounted.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)
        with contextlib.suppress(OSError):
            where.rmdir()


def save_sharded_until_full(folder: str, async_save: bool) -> dict[str, Any]:
    ctx = context()
    model = ctx.shard(tiny_model(), blocks=[nn.Linear])
    first = ctx.save_checkpoint(folder, model=model, epoch=0)
    big = ctx.shard(big_model(), blocks=[nn.Linear])
    caught: BaseException | None = None
    try:
        ctx.save_checkpoint(folder, model=big, epoch=1, async_save=async_save)
        ctx.finish_checkpoint()
    except BaseException as error:  # what arrives must be an OSError: record whatever it is
        caught = error
    left = sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith("."))
    fresh = ctx.shard(tiny_model(seed=3), blocks=[nn.Linear])
    meta = ctx.load_checkpoint(folder, model=fresh)  # after rank 0 removed the temporary
    return {
        "temporaries": [p.name for p in Path(folder).iterdir() if p.name.startswith(".check")],
        "first": first.name,
        "type": type(caught).__name__,
        "is_os_error": isinstance(caught, OSError),
        "errno": getattr(caught, "errno", None),
        "message": str(caught),
        "left": left,
        "meta": meta,
    }


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_during_a_sharded_save_is_an_os_error_naming_the_path(
    run_distributed: Any, async_save: bool
) -> None:
    with small_tmpfs("600k") as disk:
        folder = disk / "run"
        results = run_distributed(
            save_sharded_until_full, str(folder), async_save, world_size=2, timeout=90
        )
    for rank, result in enumerate(results):
        assert result["is_os_error"], (rank, result["type"], result["message"])
        assert result["errno"] == errno.ENOSPC, result
        assert "no space left on device" in result["message"]
        assert str(folder) in result["message"]
        assert result["left"] == [result["first"]]  # nothing half-written was published
        assert result["temporaries"] == []  # nor left behind
        assert result["meta"] == {"epoch": 0}


def die_after_the_async_write_before_finishing(folder: str) -> None:
    """Rank 1's async write completes; it is SIGKILLed before finish_checkpoint; rank 0 finishes."""
    ctx = context()
    model = ctx.shard(tiny_model(), blocks=[nn.Linear])
    ctx.save_checkpoint(folder, model=model, epoch=0)
    ctx.save_checkpoint(folder, model=model, async_save=True, epoch=1)
    future = ctx._pending.future
    assert future is not None
    future.result()  # this rank's part (and DCP's metadata) is on disk: complete, loadable
    ctx.barrier()
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    ctx.finish_checkpoint()  # rank 0: must not publish what rank 1 never confirmed


@pytest.mark.slow
def test_an_async_save_is_not_published_when_a_rank_died_before_finishing_it(
    run_distributed: Any, tmp_path: Path
) -> None:
    with pytest.raises(RankError):
        run_distributed(die_after_the_async_write_before_finishing, str(tmp_path), timeout=60)
    left = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert left == ["checkpoint-000001-epoch0.dcp"]


def try_to_save(folder: str, kind: str) -> str:
    ctx = context()
    model = tiny_model(1)
    model = ctx.shard(model, blocks=[nn.Linear]) if kind != "ddp" else ctx.wrap(model)
    try:
        ctx.save_checkpoint(folder, model=model, epoch=5, async_save=kind == "shard-async")
        ctx.finish_checkpoint()
    except Exception as error:
        return str(error)
    return "saved"


def resume_and_save(folder: str, kind: str) -> dict[str, Any]:
    ctx = context()
    model = tiny_model(1)
    model = ctx.shard(model, blocks=[nn.Linear]) if kind == "shard" else ctx.wrap(model)
    meta = ctx.load_checkpoint(folder, model=model)
    path = ctx.save_checkpoint(folder, model=model, epoch=7)
    return {"meta": meta, "path": path.name}


def start_writer(folder: Path, kind: str, signals: Path) -> subprocess.Popen[str]:
    signals.mkdir()
    return start_torchrun(WRITER, str(folder), kind, str(signals))


def wait_for_saved(job: subprocess.Popen[str], signals: Path) -> int:
    deadline = time.monotonic() + patience(120)
    while not (signals / "saved").exists():
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, "the first job never saved"
        time.sleep(0.1)
    time.sleep(0.1)
    return int((signals / "saved").read_text())


WRITER = REPO / "tests" / "scripts" / "checkpoint_writer.py"


def kill_job(job: subprocess.Popen[str]) -> None:
    """SIGKILL torchrun and its workers (each in a session of its own), and wait for them."""
    workers = child_pids(job.pid)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    job.communicate()
    assert not still_running(workers), "a worker outlived SIGKILL"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "shard", "shard-async"])
def test_a_second_job_saving_into_the_same_directory_is_refused_naming_the_first(
    run_distributed: Any, tmp_path: Path, kind: str
) -> None:
    folder, signals = tmp_path / "run", tmp_path / "signals"
    first = start_writer(folder, kind, signals)
    try:
        pid = wait_for_saved(first, signals)
        said = run_distributed(try_to_save, str(folder), kind, world_size=2, timeout=90)
        (signals / "release").write_text("go")
        _, err = first.communicate(timeout=patience(120))
    finally:
        if first.poll() is None:
            kill_job(first)
    assert first.returncode == 0, err[-3000:]
    for message in said:  # every rank of the second job is refused, naming the first
        assert "another job is writing checkpoints to" in message, message
        assert f"pid {pid}" in message, message
        assert socket.gethostname() in message, message
        assert "TORCHELASTIC_RUN_ID=" in message, message
    suffix = ".pt" if kind == "ddp" else ".dcp"
    assert not (folder / ".ddpctx-writer.lock").exists()  # let go when the first job ended
    assert checkpoint_names(folder) == [  # the first job's checkpoints only
        f"checkpoint-000001-epoch0{suffix}",
        f"checkpoint-000002-epoch1{suffix}",
    ]


@pytest.mark.slow
def test_a_sigkilled_job_leaves_no_claim_on_its_directory(
    run_distributed: Any, tmp_path: Path
) -> None:
    folder, signals = tmp_path / "run", tmp_path / "signals"
    first = start_writer(folder, "shard", signals)
    try:
        wait_for_saved(first, signals)
    finally:
        kill_job(first)
    again = run_distributed(resume_and_save, str(folder), "shard", world_size=2, timeout=90)
    assert again[0] == {"meta": {"epoch": 0}, "path": "checkpoint-000002-epoch7.dcp"}


@pytest.mark.slow
def test_a_torchrun_restart_of_the_same_job_takes_its_directory_over(tmp_path: Path) -> None:
    folder, signals = tmp_path / "run", tmp_path / "signals"
    signals.mkdir()
    command = torchrun_command(
        WRITER,
        str(folder),
        "ddp",
        str(signals),
        launcher_args=("--standalone", "--max-restarts=1"),
    )
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=patience(240),
        env=child_env(DIE_ON_FIRST_ATTEMPT="1"),
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert checkpoint_names(folder) == [
        "checkpoint-000001-epoch0.pt",
        "checkpoint-000002-epoch1.pt",
    ]


def flip_byte(path: Path, offset: int, mask: int) -> bytes:
    """XOR one byte of ``path`` with ``mask``; the original bytes, to put back."""
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[offset] ^= mask
    path.write_bytes(bytes(damaged))
    return original


def load_newest(folder: str, shard: bool) -> dict[str, Any]:
    """Load the newest loadable checkpoint into a fresh model; its meta, weights, warnings."""
    ctx = context()
    model = tiny_model(5)
    model = ctx.shard(model, blocks=[nn.Linear]) if shard else ctx.wrap(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = ctx.load_checkpoint(folder, model=model)
    return {
        "meta": meta,
        "weights": ctx.full_state_dict(model),
        "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning],
    }


def save_two(folder: str, shard: bool) -> list[str]:
    """Checkpoint 1 holds tiny_model(0) (epoch 0), checkpoint 2 tiny_model(1) (epoch 1)."""
    ctx = context()
    paths = []
    for epoch in (0, 1):
        model = tiny_model(epoch)
        model = ctx.shard(model, blocks=[nn.Linear]) if shard else ctx.wrap(model)
        paths.append(ctx.save_checkpoint(folder, model=model, epoch=epoch).name)
    return paths


def assert_the_older_one_loaded(result: dict[str, Any], damaged: str) -> None:
    assert result["meta"] == {"epoch": 0}, result["warnings"]
    expected = tiny_model(0).state_dict()
    assert result["weights"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(result["weights"][key], value), key
    said = [m for m in result["warnings"] if "damaged" in m or "torn" in m or "lacks" in m]
    assert any(damaged in m for m in said), result["warnings"]


def newest_files(folder: Path) -> list[Path]:
    """Every file of the newest checkpoint: a .pt and its manifest, or a .dcp's files."""
    newest = max(
        (p for p in folder.iterdir() if p.name.startswith("checkpoint-") and p.suffix != ".sums"),
        key=lambda p: p.name,
    )
    if newest.is_dir():
        return sorted(newest.iterdir())
    return [newest, newest.with_name(newest.name + ".sums")]


@pytest.mark.slow
def test_a_flipped_byte_anywhere_in_the_newest_file_checkpoint_loads_the_older_one(
    tmp_path: Path,
) -> None:
    with distributed() as ctx:
        save_two(str(tmp_path), shard=False)
        files = newest_files(tmp_path)

        @settings(max_examples=60, deadline=None, database=None)
        @given(st.sampled_from(files), st.data())
        def flipped(path: Path, data: st.DataObject) -> None:
            offset = data.draw(st.integers(0, path.stat().st_size - 1), label="offset")
            mask = data.draw(st.integers(1, 255), label="mask")
            original = flip_byte(path, offset, mask)
            try:
                assert_the_older_one_loaded(load_newest(str(tmp_path), False), path.name)
            finally:
                path.write_bytes(original)

        flipped()
        assert ctx.load_checkpoint(tmp_path, model=tiny_model(5)) == {"epoch": 1}


@pytest.mark.slow
def test_a_flipped_byte_anywhere_in_the_newest_sharded_checkpoint_loads_the_older_one(
    run_distributed: Any, tmp_path: Path
) -> None:
    run_distributed(save_two, str(tmp_path), True, world_size=2)
    files = newest_files(tmp_path)
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "ddpctx.pt", "ddpctx.sums"} <= {
        p.name for p in files
    }

    @settings(max_examples=25, deadline=None, database=None)
    @given(st.sampled_from(files), st.data())
    def flipped(path: Path, data: st.DataObject) -> None:
        offset = data.draw(st.integers(0, path.stat().st_size - 1), label="offset")
        mask = data.draw(st.integers(1, 255), label="mask")
        original = flip_byte(path, offset, mask)
        try:
            result = run_distributed(load_newest, str(tmp_path), True, world_size=2)[0]
            assert_the_older_one_loaded(result, path.name)
        finally:
            path.write_bytes(original)

    flipped()
    assert run_distributed(load_newest, str(tmp_path), True)[0]["meta"] == {"epoch": 1}


def load_counting_collectives(folder: str) -> dict[str, Any]:
    """A sharded load into a fresh model, counting the collectives it issues by kind."""
    import torch.distributed as dist

    ctx = context()
    model = ctx.shard(tiny_model(5), blocks=[nn.Linear])
    kinds = ["all_reduce", "all_gather", "all_gather_object", "gather_object"]
    kinds += ["scatter_object_list", "broadcast_object_list", "broadcast", "barrier"]
    counts = dict.fromkeys(kinds, 0)
    originals = {kind: getattr(dist, kind) for kind in kinds}

    def counting(kind: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[kind] += 1
            return originals[kind](*args, **kwargs)

        return call

    for kind in kinds:
        setattr(dist, kind, counting(kind))
    try:
        meta = ctx.load_checkpoint(folder, model=model)
    finally:
        for kind, original in originals.items():
            setattr(dist, kind, original)
    return {"meta": meta, "counts": counts, "weights": ctx.full_state_dict(model)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_sharded_load_takes_no_object_collective_but_the_listing(
    run_distributed: Any, tmp_path: Path, world_size: int
) -> None:
    # DCP's own load gathered and scattered the plans and gathered every rank's outcome
    # (three object collectives, ~4-10 ms at 3 ranks); a load's plan is each rank's own,
    # and what the ranks found is one 1-element vote after the small files, one after
    # the shards.
    run_distributed(save_two, str(tmp_path), True, world_size=world_size)
    results = run_distributed(load_counting_collectives, str(tmp_path), world_size=world_size)
    for result in results:
        assert result["meta"] == {"epoch": 1}
        counts = result["counts"]
        objects = counts["all_gather_object"] + counts["gather_object"]
        assert objects + counts["scatter_object_list"] == 0, counts
        assert counts["broadcast_object_list"] <= 1, counts  # rank 0's listing
    expected = tiny_model(1).state_dict()
    for key, value in expected.items():
        assert torch.equal(results[0]["weights"][key], value), key


def fail_reading_shards_on(folder: str, failing: int) -> str:
    """A load whose DCP read fails on rank ``failing`` with an error that is no damage."""
    from ddpctx.checkpoint import dcpread

    ctx = context()
    model = ctx.shard(tiny_model(5), blocks=[nn.Linear])
    kept = dcpread.Reader.read_data

    def unreadable(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied", "__0_0.distcp")

    if ctx.rank == failing:
        dcpread.Reader.read_data = unreadable  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        ctx.load_checkpoint(folder, model=model)
    except Exception as error:  # what each rank raised is the result
        return f"{type(error).__name__}: {error} after {time.monotonic() - started:.1f} s"
    finally:
        dcpread.Reader.read_data = kept  # type: ignore[method-assign]  # a warm pool's rank
    return "loaded"


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_that_cannot_read_its_shards_fails_every_rank_within_seconds_naming_it(
    run_distributed: Any, tmp_path: Path, world_size: int
) -> None:
    run_distributed(save_two, str(tmp_path), True, world_size=world_size)
    failing = world_size - 1
    said = run_distributed(fail_reading_shards_on, str(tmp_path), failing, world_size=world_size)
    for rank, text in enumerate(said):
        seconds = float(text.rsplit(" after ", 1)[1].removesuffix(" s"))
        assert seconds < patience(10.0), said
        if rank == failing:
            assert text.startswith("RuntimeError: DCP could not read the shards of"), said
            assert "PermissionError" in text, said
            assert "Make the files named readable" in text, said  # and the fix
        else:
            assert text.startswith(f"RuntimeError: rank {failing} failed to read"), said
            assert "Permission denied" in text, said


@pytest.mark.parametrize("manifest", [True, False], ids=["verified", "no-manifest"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_shard_cut_to_half_is_skipped_and_the_older_checkpoint_loads(
    run_distributed: Any, tmp_path: Path, world_size: int, manifest: bool
) -> None:
    run_distributed(save_two, str(tmp_path), True, world_size=world_size)
    if not manifest:  # as written by a ddpctx that recorded no checksums
        next(p for p in newest_files(tmp_path) if p.name == "ddpctx.sums").unlink()
    shard = next(p for p in newest_files(tmp_path) if p.name == "__1_0.distcp")
    with shard.open("r+b") as stream:
        stream.truncate(shard.stat().st_size // 2)
    result = run_distributed(load_newest, str(tmp_path), True, world_size=world_size)[0]
    assert_the_older_one_loaded(result, "__1_0.distcp")


@pytest.mark.parametrize("shard", [False, True], ids=["file", "sharded"])
def test_a_checkpoint_without_a_manifest_loads_with_a_warning_that_it_is_unverified(
    run_distributed: Any, tmp_path: Path, shard: bool
) -> None:
    run_distributed(save_two, str(tmp_path), shard, world_size=2)
    manifest = [p for p in newest_files(tmp_path) if p.name.endswith(".sums")]
    manifest[0].unlink()  # as written by a ddpctx that recorded no checksums
    result = run_distributed(load_newest, str(tmp_path), shard, world_size=2)[0]
    assert result["meta"] == {"epoch": 1}
    assert any("has no checksum manifest" in m for m in result["warnings"]), result["warnings"]


def test_a_full_disk_while_writing_a_manifest_names_it() -> None:
    with small_tmpfs("64k") as disk:
        (disk / "filler").write_bytes(b"x" * 60_000)  # a 64k tmpfs: too little left for 10k
        with pytest.raises(OSError, match=r"no space left on device while saving '.*a\.sums'"):
            write_manifest(disk / "a.sums", {f"f{i}.bin": (i, "0" * 8) for i in range(400)})
        assert [p.name for p in disk.iterdir()] == ["filler"]  # no temporary left


def test_a_run_that_skipped_a_damaged_newest_checkpoint_saves_again(tmp_path: Path) -> None:
    # Found by the merged-whole attack: the resumed run's first save was refused with a false
    # "another job is writing checkpoints to the same directory", at every restart.
    with distributed(seed=0) as ctx:
        model = ctx.wrap(torch.nn.Linear(2, 1))
        ctx.save_checkpoint(tmp_path, model=model, epoch=0, step=10)
        newest = ctx.save_checkpoint(tmp_path, model=model, epoch=1, step=20)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    with distributed(seed=0) as ctx:
        model = ctx.wrap(torch.nn.Linear(2, 1))
        with pytest.warns(RuntimeWarning, match="damaged"):
            meta = ctx.load_checkpoint(tmp_path, model=model)
        assert meta is not None
        assert meta["step"] == 10
        saved = ctx.save_checkpoint(tmp_path, model=model, epoch=0, step=15)
        assert saved.exists()
        loaded = ctx.load_checkpoint(tmp_path, model=model)
        assert loaded is not None
        assert loaded["step"] == 15


def as_crc32_manifest(manifest: Path) -> None:
    """Rewrite ``manifest`` as a ddpctx before XXH3-64 wrote it: format 1, CRC-32 of every file
    and of every part (the same spans), its own CRC-32 trailer."""
    recorded = read_manifest(manifest)
    assert isinstance(recorded, dict)
    files: dict[str, dict[str, Any]] = {}
    for name, record in recorded.items():
        data = (manifest.parent / name).read_bytes()
        files[name] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        if record.parts:
            files[name]["parts"] = [
                [o, n, f"{zlib.crc32(data[o : o + n]):08x}"] for o, n, _ in record.parts
            ]
    body = json.dumps(
        {"format": "ddpctx-sums-1", "algorithm": "crc32", "files": files},
        separators=(",", ":"),
        sort_keys=True,
    )
    manifest.write_text(f"{body}\ncrc32 {zlib.crc32(body.encode()):08x}\n")


def renamed_algorithm(manifest: Path, algorithm: str) -> None:
    """The manifest as it is, naming another checksum algorithm (its trailer recomputed)."""
    body = json.loads(manifest.read_text().splitlines()[0])
    body["algorithm"] = algorithm
    text = json.dumps(body, separators=(",", ":"), sort_keys=True)
    manifest.write_text(f"{text}\ncrc32 {zlib.crc32(text.encode()):08x}\n")


def the_manifest(folder: Path) -> Path:
    return next(p for p in newest_files(folder) if p.name.endswith(".sums"))


@pytest.mark.parametrize("shard", [False, True], ids=["file", "sharded"])
def test_a_checkpoint_with_an_old_crc32_manifest_still_verifies_and_a_flipped_bit_is_caught(
    run_distributed: Any, tmp_path: Path, shard: bool
) -> None:
    run_distributed(save_two, str(tmp_path), shard, world_size=2)
    manifest = the_manifest(tmp_path)
    assert json.loads(manifest.read_text().splitlines()[0])["algorithm"] == "xxh3_64"
    as_crc32_manifest(manifest)
    result = run_distributed(load_newest, str(tmp_path), shard, world_size=2)[0]
    assert result["meta"] == {"epoch": 1}, result["warnings"]
    assert result["warnings"] == []  # verified, not "loaded unverified"
    # rank 1's own shard (read by rank 1 alone), or the one .pt every rank reads
    kind = "__1_0.distcp" if shard else ".pt"
    target = next(p for p in newest_files(tmp_path) if p.name.endswith(kind))
    flip_byte(target, target.stat().st_size // 2, 0x10)
    results = run_distributed(load_newest, str(tmp_path), shard, world_size=2)
    for result in results:  # every rank falls back to the same older checkpoint
        assert result["meta"] == {"epoch": 0}, result["warnings"]
    assert any("has CRC-32" in m and target.name in m for m in results[0]["warnings"])


@pytest.mark.parametrize("shard", [False, True], ids=["file", "sharded"])
def test_a_manifest_naming_an_unknown_algorithm_is_refused_naming_it(
    run_distributed: Any, tmp_path: Path, shard: bool
) -> None:
    run_distributed(save_two, str(tmp_path), shard, world_size=2)
    renamed_algorithm(the_manifest(tmp_path), "blake9")
    with pytest.raises(RankError, match=r"checksum algorithm 'blake9'.*does not know"):
        run_distributed(load_newest, str(tmp_path), shard, world_size=2)


def test_without_xxhash_checksums_are_crc32_warned_once_and_still_round_trip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    digest._xxhash.cache_clear()
    monkeypatch.setitem(sys.modules, "xxhash", None)  # ``import xxhash`` raises ImportError
    try:
        with distributed() as ctx, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = ctx.wrap(tiny_model(3))
            for epoch in range(2):
                ctx.save_checkpoint(tmp_path / "file", model=model, epoch=epoch)
                ctx.save_checkpoint(
                    tmp_path / "sharded", model=ctx.shard(tiny_model(3)), epoch=epoch
                )
            for kind in ("file", "sharded"):
                manifest = the_manifest(tmp_path / kind)
                assert json.loads(manifest.read_text().splitlines()[0])["algorithm"] == "crc32"
                fresh = tiny_model(7)
                assert ctx.load_checkpoint(tmp_path / kind, model=fresh) == {"epoch": 1}
                assert all(
                    torch.equal(a, b)
                    for a, b in zip(
                        fresh.state_dict().values(),
                        tiny_model(3).state_dict().values(),
                        strict=True,
                    )
                )
        said = [str(w.message) for w in caught if "xxhash" in str(w.message)]
        assert len(said) == 1, said
        assert "pip install xxhash" in said[0]
    finally:
        monkeypatch.undo()
        digest._xxhash.cache_clear()
    with distributed() as ctx:  # xxhash back: the CRC-32 checkpoints still verify and load
        assert ctx.load_checkpoint(tmp_path / "file", model=tiny_model(7)) == {"epoch": 1}


def test_an_xxh3_checkpoint_without_xxhash_is_refused_saying_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with distributed() as ctx:
        ctx.save_checkpoint(tmp_path, model=tiny_model(), epoch=0)
    digest._xxhash.cache_clear()
    monkeypatch.setitem(sys.modules, "xxhash", None)
    try:
        with distributed() as ctx, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(RefusedCheckpoint, match=r"XXH3-64.*pip install xxhash"):
                ctx.load_checkpoint(tmp_path, model=tiny_model())
    finally:
        monkeypatch.undo()
        digest._xxhash.cache_clear()


def test_a_sharded_save_records_each_shard_as_its_entries_hashed_as_dcp_wrote_them(
    run_distributed: Any, tmp_path: Path
) -> None:
    run_distributed(save_two, str(tmp_path), True, world_size=2)
    manifest = the_manifest(tmp_path)
    recorded = read_manifest(manifest)
    assert isinstance(recorded, dict)
    shards = [name for name in recorded if name.endswith(".distcp")]
    assert len(shards) == 2
    for name, record in recorded.items():  # differential: the bytes on disk, hashed again
        spans = [(offset, length) for offset, length, _ in record.parts]
        again = file_record(manifest.parent / name, spans, record.algorithm)
        assert again.parts == record.parts, name
        if name in shards:  # hashed once, entry by entry: the shard is its entries
            assert record.digest == OF_PARTS, name
            assert tiles(record.parts, record.size), name
        else:
            assert again.digest == record.digest, name


class _WithEmpty(nn.Module):
    """An empty buffer and a one-element parameter (one rank's shard of it holds nothing):
    entries of no elements, which no rank's load plan reads."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(4, 4)
        self.one = nn.Parameter(torch.randn(1))
        self.register_buffer("empty", torch.zeros(0, 3))


def _save_two_with_empty(folder: str) -> None:
    ctx = context()
    for epoch in (0, 1):
        model = ctx.shard(_WithEmpty(epoch), blocks=[nn.Linear])
        ctx.save_checkpoint(folder, model=model, epoch=epoch)


def _load_with_empty(folder: str) -> dict[str, Any]:
    ctx = context()
    model = ctx.shard(_WithEmpty(5), blocks=[nn.Linear])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = ctx.load_checkpoint(folder, model=model)
    return {"meta": meta, "warnings": [str(w.message) for w in caught]}


def test_a_flipped_byte_in_an_entry_no_rank_reads_is_still_caught(
    run_distributed: Any, tmp_path: Path
) -> None:
    # Found by the outside attack: the entry of an empty tensor is never in a load plan, so
    # no rank hashed it, and a damaged one loaded silently (its bytes are still the file's).
    from ddpctx.checkpoint.dcpread import read_metadata

    run_distributed(_save_two_with_empty, str(tmp_path), world_size=2, timeout=90)
    newest = max(p for p in tmp_path.iterdir() if p.name.startswith("checkpoint-"))
    metadata = read_metadata(newest / ".metadata", None)
    empty = []
    for index, info in metadata.storage_data.items():
        stored = metadata.state_dict_metadata[index.fqn]
        chunks = getattr(stored, "chunks", [])
        chunk = chunks[index.index] if index.index is not None else None
        if chunk is not None and math.prod(chunk.sizes) == 0:
            empty.append((index.fqn, info))
    assert any(fqn.endswith("empty") for fqn, _ in empty), empty
    for fqn, info in empty:
        path = newest / info.relative_path
        original = flip_byte(path, int(info.offset) + int(info.length) // 2, 0x10)
        try:
            results = run_distributed(_load_with_empty, str(tmp_path), world_size=2, timeout=90)
        finally:
            path.write_bytes(original)
        assert [r["meta"] for r in results] == [{"epoch": 0}] * 2, (fqn, results)
        said = [m for r in results for m in r["warnings"] if "damaged" in m]
        assert any(path.name in m and fqn in m for m in said), (fqn, said)
    assert run_distributed(_load_with_empty, str(tmp_path), world_size=2)[0]["meta"] == {"epoch": 1}
