"""What checkpoint checksums cost: CRC-32 speed, and a ~1 GiB checkpoint saved and loaded.

Run:  python benchmarks/bench_checksums.py [--gib 1.0] [--rounds 3]

Prints markdown rows for BENCHMARKS.md, in one process (world size 1):

- CRC-32 (``zlib.crc32``, what ddpctx records) over an in-memory buffer, and
  ``ddpctx.checkpoint.sums.file_sum`` over a file in the page cache (what a
  load verifies), in GiB/s; BLAKE2b and SHA-256 beside them for comparison;
- the median time of ``ctx.save_checkpoint`` of a model of ``--gib`` GiB of
  float32 weights (the CRC is computed while the bytes are written), and of
  the same save with the CRC patched out (a save as before checksums), and of
  ``ctx.load_checkpoint`` with verification (the manifest is there) and
  without (the manifest removed: the path of a checkpoint written before
  checksums), interleaved round by round.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import statistics
import tempfile
import time
import types
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ddpctx import distributed
from ddpctx.checkpoint.sums import file_sum, sidecar
from ddpctx.utils import atomic


def speed(work: object, size: int, rounds: int = 3) -> float:
    """GiB/s of the best of ``rounds`` calls of ``work()``."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        work()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return size / best / 2**30


@contextlib.contextmanager
def without_crc() -> Iterator[None]:
    """The byte sink's CRC replaced by a no-op: a save as it was before checksums."""
    real = vars(atomic)["zlib"]
    setattr(atomic, "zlib", types.SimpleNamespace(crc32=lambda data, value=0: 0))  # noqa: B010
    try:
        yield
    finally:
        setattr(atomic, "zlib", real)  # noqa: B010


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-checksums-"))
    try:
        data = os.urandom(256 << 20)
        print("| hash | GiB/s |\n|---|---:|")
        print(f"| CRC-32 (zlib), memory | {speed(lambda: zlib.crc32(data), len(data)):.2f} |")
        blake = speed(lambda: hashlib.blake2b(data).digest(), len(data))
        print(f"| BLAKE2b, memory | {blake:.2f} |")
        sha = speed(lambda: hashlib.sha256(data).digest(), len(data))
        print(f"| SHA-256, memory | {sha:.2f} |")
        big = folder / "big.bin"
        with big.open("wb") as stream:
            for _ in range(4):
                stream.write(data)
        cached = speed(lambda: file_sum(big), 1 << 30)
        print(f"| CRC-32, 1 GiB file in the page cache | {cached:.2f} |")
        big.unlink()
        data = b""

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
                with without_crc():
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
        print(f"| save_checkpoint (CRC while writing) | {statistics.median(saves):.2f} |")
        print(f"| save_checkpoint, CRC patched out | {statistics.median(plain_saves):.2f} |")
        print(f"| load_checkpoint, verified | {statistics.median(verified):.2f} |")
        print(f"| load_checkpoint, no manifest | {statistics.median(unverified):.2f} |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
