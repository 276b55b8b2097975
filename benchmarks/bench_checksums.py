"""What checkpoint checksums cost: the candidate hashes' speed, and a checkpoint saved and loaded.

Run:  python benchmarks/bench_checksums.py [--gib 1.0] [--rounds 3] [--hash-only]

Prints markdown rows for BENCHMARKS.md, in one process (world size 1):

- each candidate hash over a 256 MiB buffer in memory, best of ``--rounds``,
  in GiB/s: XXH3-64 (``xxhash``, what ddpctx records), hardware CRC32C
  (``crc32c`` and ``google-crc32c``, where installed), ``zlib.crc32`` (what
  ddpctx recorded before, and records without ``xxhash``), BLAKE2b and
  SHA-256; also XXH3-64 fed in 1 MiB pieces (a running sum, as while
  writing) and ``ddpctx.checkpoint.sums.file_sum`` over a 1 GiB file in the
  page cache (what a load verifies);
- unless ``--hash-only``: the median time of ``ctx.save_checkpoint`` of a
  model of ``--gib`` GiB of float32 weights (the checksum computed while the
  bytes are written), and of the same save with hashing patched out (a save
  as before checksums), and of ``ctx.load_checkpoint`` with verification (the
  manifest is there) and without (the manifest removed: the path of a
  checkpoint written before checksums), interleaved round by round.

The load average (``os.getloadavg``) is printed with the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import os
import shutil
import statistics
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from ddpctx import distributed
from ddpctx.checkpoint.sums import file_sum, sidecar
from ddpctx.utils import atomic
from ddpctx.utils.digest import chosen


def speed(work: object, size: int, rounds: int = 3) -> float:
    """GiB/s of the best of ``rounds`` calls of ``work()``."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        work()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return size / best / 2**30


class _NoHash:
    def update(self, data: object, /) -> None:
        pass

    def hexdigest(self) -> str:
        return "0"


@contextlib.contextmanager
def without_hash() -> Iterator[None]:
    """The byte sink's running hash replaced by a no-op: a save as it was before checksums."""
    real = vars(atomic)["hasher"]
    setattr(atomic, "hasher", lambda algorithm: _NoHash())  # noqa: B010
    try:
        yield
    finally:
        setattr(atomic, "hasher", real)  # noqa: B010


def candidates(data: bytes) -> list[tuple[str, Callable[[], object]]]:
    """Each hash to measure over ``data`` that is installed here: (name, work)."""
    found: list[tuple[str, Callable[[], object]]] = []
    with contextlib.suppress(ImportError):
        xxhash = importlib.import_module("xxhash")
        found.append(("XXH3-64 (`xxhash`), memory", lambda: xxhash.xxh3_64(data).intdigest()))

        def pieces() -> object:
            running, view = xxhash.xxh3_64(), memoryview(data)
            for start in range(0, len(data), 1 << 20):
                running.update(view[start : start + (1 << 20)])
            return running.intdigest()

        found.append(("XXH3-64, memory, a running sum of 1 MiB pieces", pieces))
        found.append(("XXH64 (`xxhash`), memory", lambda: xxhash.xxh64(data).intdigest()))
    with contextlib.suppress(ImportError):
        crc32c = importlib.import_module("crc32c")
        found.append(("CRC32C (`crc32c`), memory", lambda: crc32c.crc32c(data)))
    with contextlib.suppress(ImportError):
        google = importlib.import_module("google_crc32c")
        found.append(("CRC32C (`google-crc32c`), memory", lambda: google.value(data)))
    found.append(("CRC-32 (`zlib.crc32`), memory", lambda: zlib.crc32(data)))
    found.append(("BLAKE2b, memory", lambda: hashlib.blake2b(data).digest()))
    found.append(("SHA-256, memory", lambda: hashlib.sha256(data).digest()))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hash-only", action="store_true", help="only the hashes' speeds")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-checksums-"))
    try:
        data = os.urandom(256 << 20)
        print(f"load average (1, 5, 15 min): {os.getloadavg()}; ddpctx records {chosen()}\n")
        print(f"| hash | GiB/s (best of {args.rounds}) |\n|---|---:|")
        for name, work in candidates(data):
            print(f"| {name} | {speed(work, len(data), args.rounds):.2f} |")
        big = folder / "big.bin"
        with big.open("wb") as stream:
            for _ in range(4):
                stream.write(data)
        cached = speed(lambda: file_sum(big), 1 << 30, args.rounds)
        print(f"| `file_sum` ({chosen()}), 1 GiB file in the page cache | {cached:.2f} |")
        big.unlink()
        data = b""
        print(f"\nload average after: {os.getloadavg()}")
        if args.hash_only:
            return

        elements = int(args.gib * 2**30 / 4)
        model = nn.Linear(elements // 1024, 1024, bias=False)
        saves, plain_saves, verified, unverified = [], [], [], []
        with distributed() as ctx, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for round_ in range(args.rounds):
                run = folder / f"run{round_}"
                start = time.perf_counter()
                path = ctx.save_checkpoint(run, model=model, epoch=round_)
                saves.append(time.perf_counter() - start)
                start = time.perf_counter()
                ctx.load_checkpoint(run, model=model)
                verified.append(time.perf_counter() - start)
                plain = folder / f"plain{round_}"
                with without_hash():
                    start = time.perf_counter()
                    ctx.save_checkpoint(plain, model=model, epoch=round_)
                    plain_saves.append(time.perf_counter() - start)
                shutil.rmtree(plain)
                manifest = sidecar(path).read_bytes()
                sidecar(path).unlink()
                start = time.perf_counter()
                ctx.load_checkpoint(run, model=model)
                unverified.append(time.perf_counter() - start)
                sidecar(path).write_bytes(manifest)
                shutil.rmtree(run)
        size = elements * 4 / 2**30
        print(f"\n{size:.2f} GiB checkpoint, median of {args.rounds} rounds:\n")
        print("| operation | seconds |\n|---|---:|")
        print(f"| save_checkpoint (hashed while writing) | {statistics.median(saves):.2f} |")
        print(f"| save_checkpoint, hashing patched out | {statistics.median(plain_saves):.2f} |")
        print(f"| load_checkpoint, verified | {statistics.median(verified):.2f} |")
        print(f"| load_checkpoint, no manifest | {statistics.median(unverified):.2f} |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
