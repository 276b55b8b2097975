"""What a reader's own walks of a checkpoint cost, beside torch's unpickling of the same file.

Run:  python benchmarks/bench_readers.py [--items 500000] [--rounds 5]

Prints markdown rows for BENCHMARKS.md, in one process. Before it unpickles a
checkpoint's ``.pt``, every reader walks its pickle's opcodes
(:mod:`ddpctx.checkpoint.claims`, what it claims to allocate), and after, the
value it loaded (:mod:`ddpctx.checkpoint.shape`, how deep it nests and what it
expands to). Each file is timed in CPU seconds (``time.process_time``: a busy
machine's other processes do not count), round by round, interleaved:

- ``torch.load``: ``torch.load(weights_only=True, mmap=True)``, as a reader loads it;
- the opcode walk (``check_torch_file``) and the value walk (``check_loaded``);
- ``checkpoint_meta`` of the file, the whole read: choosing it, verifying its
  checksums, both walks and the unpickling, once.

The files: the outside attack's -- a meta dict built by ``--items`` ``SETITEMS``
opcodes, one per item (a 4 MB pickle at 500,000), and at twice as many (the
walks must grow as torch's does: linearly) -- one whose ``SETITEMS`` all set
one key (a pickle of opcodes and no value), and a checkpoint of a model of 300
tensors with its AdamW state. Ratios are to ``torch.load`` of the same file in
the same round (paired), their median over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import tempfile
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpctx.checkpoint.claims import check_torch_file
from ddpctx.checkpoint.files import FORMAT
from ddpctx.checkpoint.shape import check_loaded
from ddpctx.checkpoint.sums import file_sum, sidecar, write_manifest
from ddpctx.checkpoint.weights import checkpoint_meta

STEPS = ("torch.load", "opcode walk", "value walk", "checkpoint_meta")


def with_pickle(path: Path, body: bytes) -> Path:
    """A torch file at ``path`` whose ``data.pkl`` is ``body``, and its checksum manifest."""

    class Pickler:
        def __init__(self, stream: Any, protocol: int) -> None:
            self.stream = stream

        def dump(self, _: object) -> None:
            self.stream.write(body)

    torch.save({}, path, pickle_module=types.SimpleNamespace(Pickler=Pickler, __name__="given"))
    write_manifest(sidecar(path), {path.name: file_sum(path)})
    return path


def setitems_pt(path: Path, items: int, distinct: bool = True) -> Path:
    """A checkpoint whose meta is a dict built by ``items`` SETITEMS, one item each (distinct
    int keys, or one key set again and again)."""
    head = bytearray(b"\x80\x02}(")  # {"format": ..., "world_size": 1, ..., "meta": {...}}
    for key, value in (("format", FORMAT), ("world_size", 1), ("step", 1)):
        head += _unicode(key) + (_unicode(value) if isinstance(value, str) else b"K\x01")
    for key in ("model", "rng"):
        head += _unicode(key) + b"}"
    head += _unicode("meta") + b"}"
    if distinct:
        body = b"".join(b"(J" + struct.pack("<i", n) + b"Nu" for n in range(items))
    else:
        body = b"(K\x00Nu" * items
    return with_pickle(path, bytes(head) + body + b"u.")


def _unicode(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def model_pt(path: Path, tensors: int = 300) -> Path:
    """A ddpctx-format checkpoint of ``tensors`` small Linear weights with an AdamW state."""
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(tensors // 2)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 8)).sum().backward()
    optimizer.step()
    state = {
        "format": FORMAT,
        "world_size": 1,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "meta": {"epoch": 1},
        "rng": [],
        "step": 1,
    }
    torch.save(state, path)
    write_manifest(sidecar(path), {path.name: file_sum(path)})
    return path


def cpu(work: Callable[[], Any]) -> float:
    began = time.process_time()
    work()
    return time.process_time() - began


def one_round(path: Path) -> dict[str, float]:
    """CPU seconds of each step of :data:`STEPS` on ``path``."""
    size = path.stat().st_size
    loaded: list[Any] = []

    def opcodes() -> None:
        with open(path, "rb") as stream:
            check_torch_file(stream, size, path)

    times = {
        "torch.load": cpu(lambda: loaded.append(torch.load(path, weights_only=True, mmap=True))),
        "opcode walk": cpu(opcodes),
        "value walk": cpu(lambda: check_loaded(loaded[0], size, path)),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times["checkpoint_meta"] = cpu(lambda: checkpoint_meta(path))
    return times


def measure(paths: list[Path], rounds: int) -> dict[Path, list[dict[str, float]]]:
    """Every file's steps, ``rounds`` times, the files interleaved round by round."""
    found: dict[Path, list[dict[str, float]]] = {path: [] for path in paths}
    for _ in range(rounds):
        for path in paths:
            found[path].append(one_round(path))
    return found


def best(times: list[dict[str, float]]) -> dict[str, float]:
    """Each step's least time over the rounds (the one least disturbed)."""
    return {step: min(each[step] for each in times) for step in STEPS}


def ratio(times: list[dict[str, float]], step: str) -> float:
    """The median over rounds of ``step``'s time over ``torch.load``'s, in that round."""
    return statistics.median(each[step] / each["torch.load"] for each in times)


def rows(found: dict[Path, list[dict[str, float]]], names: dict[Path, str]) -> list[str]:
    lines = [
        "| file | size | torch.load | opcode walk | value walk | checkpoint_meta |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for path, times in found.items():
        cells = [f"{statistics.median(t['torch.load'] for t in times) * 1e3:.0f} ms"]
        for step in STEPS[1:]:
            middle = statistics.median(t[step] for t in times) * 1e3
            cells.append(f"{middle:.0f} ms ({ratio(times, step):.2f}x)")
        size = path.stat().st_size / 1e6
        lines.append(f"| {names[path]} | {size:.1f} MB | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=500_000)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    items = options.items
    names = {
        setitems_pt(folder / "checkpoint-000001.pt", items): f"{items:,} SETITEMS",
        setitems_pt(folder / "checkpoint-000002.pt", 2 * items): f"{2 * items:,} SETITEMS",
        setitems_pt(folder / "checkpoint-000003.pt", items, False): f"{items:,} SETITEMS, 1 key",
        model_pt(folder / "checkpoint-000004.pt"): "300 tensors + AdamW",
    }
    found = measure(list(names), options.rounds)
    print(f"CPU seconds, median of {options.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    print("\n".join(rows(found, names)))
    small, large = (best(found[path]) for path in list(names)[:2])
    growth = ", ".join(f"{step} {large[step] / small[step]:.2f}x" for step in STEPS)
    print(f"\ntwice the SETITEMS (best of the rounds): {growth}")


if __name__ == "__main__":
    main()
