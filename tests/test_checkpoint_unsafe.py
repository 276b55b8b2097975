"""A checkpoint carrying pickled code is refused as unsafe, by every reader, and never runs.

The payloads are real: an object whose unpickling runs ``os.system("touch
MARKER")``, put where a tampered checkpoint would carry it -- DCP's
``.metadata`` (which torch's own reader unpickles with ``pickle.load``), a
sharded checkpoint's ``ddpctx.pt``, a DDP ``.pt``, and a non-tensor entry of
a shard (which DCP's planner loads with ``weights_only=False``), a tensor
entry (which ddpctx builds on the mapped shard's bytes) -- with the
checksum manifest removed, or forged to match (anyone can recompute a CRC).
Every reader -- ``checkpoint_meta``, ``load_weights``, ``python -m ddpctx
export`` (``.pt`` and ``--safetensors``), ``ctx.load_checkpoint`` on one
rank and on two (a real gloo group) -- must leave MARKER uncreated and fail
with an error naming the file and saying it was refused as unsafe (never
skip it for an older checkpoint, which would hide the tampering).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpctx import checkpoint_meta, current, load_weights
from ddpctx.checkpoint.sums import SHARDED_MANIFEST, sidecar
from ddpctx.cli import main as cli
from tests.helpers import REPO, child_env, patience

pytestmark = pytest.mark.timeout(120)  # each test (a 2-rank load is about a second)
KINDS = ["ddp-pt", "dcp-metadata", "dcp-state", "dcp-entry", "dcp-tensor"]
#: The file of the newest checkpoint each kind of payload is put in ("" : the .pt itself).
CARRIER = {"ddp-pt": "", "dcp-metadata": ".metadata", "dcp-state": "ddpctx.pt"}
NO_OPTIMIZER = ("checkpoint_meta", "export-pt", "export-safetensors")  # readers of the model only
READERS = ["checkpoint_meta", "load_weights", "export-pt", "export-safetensors", "load-1", "load-2"]


class RunsCode:
    """Unpickled by a general unpickler, it runs ``touch marker`` (any code could run)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def train_and_save(folder: str, shard: bool) -> None:
    """Two checkpoints (epochs 0 and 1) with an AdamW state."""
    ctx = current()
    assert ctx is not None
    model = ctx.shard(net(), blocks=[nn.Linear]) if shard else ctx.wrap(net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for epoch in range(2):
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        ctx.save_checkpoint(folder, model=model, optimizer=optimizer, epoch=epoch)


_SAVED: dict[str, Path] = {}


@pytest.fixture
def saved(run_distributed: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A DDP and a sharded checkpoint directory, saved once for the module by one rank.

    On a rank of the plugin's pool, never in this process: ranks of pools started later
    are forked from it, and must not inherit what a sharded model leaves behind.
    """
    if not _SAVED:
        root = tmp_path_factory.mktemp("saved")
        for kind, shard in (("ddp", False), ("dcp", True)):
            run_distributed(train_and_save, str(root / kind), shard, world_size=1, timeout=90)
            _SAVED[kind] = root / kind
    return _SAVED


def newest(folder: Path) -> Path:
    return max(p for p in folder.glob("checkpoint-*") if not p.name.endswith(".sums"))


def forge_manifest(manifest: Path, spans: dict[str, list[tuple[int, int]]]) -> None:
    """A manifest that matches the files beside it, as anyone can write one: sizes and CRC-32s
    of every file, and of every entry of the shards (``spans``: name -> offsets and lengths)."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(manifest.parent.iterdir()):
        if path.name == manifest.name or path.name.startswith(".checkpoint-"):
            continue
        if manifest.name.endswith(".pt.sums") and path.name != manifest.name[:-5]:
            continue
        data = path.read_bytes()
        files[path.name] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
        if path.name in spans:
            files[path.name]["parts"] = [
                [o, n, f"{zlib.crc32(data[o : o + n]):08x}"] for o, n in sorted(spans[path.name])
            ]
    body = json.dumps(
        {"format": "ddpctx-sums-1", "algorithm": "crc32", "files": files},
        separators=(",", ":"),
        sort_keys=True,
    )
    manifest.write_text(f"{body}\ncrc32 {zlib.crc32(body.encode()):08x}\n")


def tamper(folder: Path, kind: str, marker: Path, manifest: bool) -> Path:
    """Put the payload in the newest checkpoint; forge its manifest or remove it. The carrier."""
    checkpoint = newest(folder)
    if kind == "ddp-pt":
        carrier = checkpoint
        state = torch.load(carrier, weights_only=False)
        state["meta"]["note"] = RunsCode(marker)
        torch.save(state, carrier)
        if manifest:
            forge_manifest(sidecar(carrier), {})
        else:
            sidecar(carrier).unlink()
        return carrier
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # ours, as saved above
    if kind == "dcp-state":
        carrier = checkpoint / "ddpctx.pt"
        state = torch.load(carrier, weights_only=False)
        state["meta"]["note"] = RunsCode(marker)
        torch.save(state, carrier)
    elif kind == "dcp-metadata":
        carrier = checkpoint / ".metadata"
        metadata.storage_meta.modules.append(RunsCode(marker))
        carrier.write_bytes(pickle.dumps(metadata))
    else:  # an optimizer's non-tensor entry (its learning rate), or a weight (a tensor entry,
        # read in place from the mapped shard), pointed at a pickled payload
        wanted = "param_groups.0.lr" if kind == "dcp-entry" else "0.weight"
        index = next(i for i in metadata.storage_data if i.fqn.endswith(wanted))
        info = metadata.storage_data[index]
        carrier = checkpoint / info.relative_path
        blob = io.BytesIO()
        torch.save(RunsCode(marker), blob)
        offset = carrier.stat().st_size
        with carrier.open("ab") as stream:
            stream.write(blob.getvalue())
        info.offset, info.length = offset, len(blob.getvalue())
        (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    if manifest:  # forged: every size and CRC recomputed, each entry's too
        spans: dict[str, list[tuple[int, int]]] = {}
        for info in metadata.storage_data.values():
            spans.setdefault(info.relative_path, []).append((info.offset, info.length))
        forge_manifest(checkpoint / SHARDED_MANIFEST, spans)
    else:
        (checkpoint / SHARDED_MANIFEST).unlink()
    return carrier


def load_in_a_run(folder: str, shard: bool) -> str:
    """``ctx.load_checkpoint`` with an optimizer on this rank; its error ('' if none)."""
    ctx = current()
    assert ctx is not None
    model = ctx.shard(net(), blocks=[nn.Linear]) if shard else ctx.wrap(net())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    try:
        ctx.load_checkpoint(folder, model=model, optimizer=optimizer, allow_world_size_change=True)
    except Exception as error:
        return str(error)
    return ""


def read(reader: str, folder: Path, shard: bool, run_distributed: Any, capsys: Any) -> list[str]:
    """What ``reader`` said of ``folder`` (its errors; '' for one that read it), per rank."""
    try:
        if reader == "checkpoint_meta":
            checkpoint_meta(folder)
        elif reader == "load_weights":
            load_weights(folder, optimizer=True)
        elif reader.startswith("export"):
            suffix = ".safetensors" if reader == "export-safetensors" else ".pt"
            capsys.readouterr()
            code = cli(["export", str(folder), str(folder.parent / f"model{suffix}")])
            return [capsys.readouterr().err if code else ""]
        else:  # a real run of one rank, or of two (a gloo group), on the plugin's ranks
            said: list[str] = run_distributed(
                load_in_a_run, str(folder), shard, world_size=int(reader[-1]), timeout=90
            )
            return said
    except Exception as error:
        return [str(error)]
    return [""]


def cases() -> Iterator[Any]:
    for kind in KINDS:
        for reader in READERS:
            if kind == "dcp-entry" and reader in NO_OPTIMIZER:
                continue  # they read no optimizer entry: the payload is never read
            if kind == "dcp-tensor" and reader == "checkpoint_meta":
                continue  # it reads no weight
            for manifest in (True, False):
                ids = f"{kind}-{reader}-{'forged' if manifest else 'no'}-manifest"
                yield pytest.param(kind, reader, manifest, id=ids)


@pytest.mark.filterwarnings("ignore:.*has no checksum manifest")
@pytest.mark.parametrize(("kind", "reader", "manifest"), list(cases()))
def test_a_checkpoint_carrying_pickled_code_is_refused_as_unsafe_by_every_reader(
    saved: dict[str, Path],
    tmp_path: Path,
    run_distributed: Any,
    capsys: Any,
    kind: str,
    reader: str,
    manifest: bool,
) -> None:
    shard = kind.startswith("dcp")
    folder = tmp_path / "run"
    shutil.copytree(saved["dcp" if shard else "ddp"], folder)
    marker = tmp_path / "ran-the-payload"
    carrier = tamper(folder, kind, marker, manifest)
    said = read(reader, folder, shard, run_distributed, capsys)
    assert not marker.exists(), f"the payload in {carrier.name} ran ({reader})"
    for message in said:
        assert "refused as unsafe" in message, said
        assert str(carrier) in message, said
        assert "trying an older checkpoint" not in message, said


@pytest.mark.slow  # a fresh interpreter: ~5 s
def test_python_m_ddpctx_export_refuses_a_metadata_carrying_code(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "run"
    shutil.copytree(saved["dcp"], folder)
    marker = tmp_path / "ran-the-payload"
    carrier = tamper(folder, "dcp-metadata", marker, manifest=True)
    done = subprocess.run(
        [sys.executable, "-m", "ddpctx", "export", str(folder), str(tmp_path / "model.pt")],
        capture_output=True,
        text=True,
        timeout=patience(120),
        env=child_env(),
        cwd=REPO,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "refused as unsafe" in done.stderr
    assert str(carrier) in done.stderr
    assert not marker.exists()
    assert not (tmp_path / "model.pt").exists()


def test_a_metadata_naming_a_shard_outside_its_checkpoint_is_refused(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    # DCP joins each shard's name to the checkpoint's directory: '../x' read another file
    folder = tmp_path / "run"
    shutil.copytree(saved["dcp"], folder)
    checkpoint = newest(folder)
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # ours, as saved above
    outside = tmp_path / "elsewhere.distcp"
    for info in metadata.storage_data.values():
        shutil.copy(checkpoint / info.relative_path, outside)
        info.relative_path = "../../elsewhere.distcp"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    forge_manifest(checkpoint / SHARDED_MANIFEST, {})
    with pytest.raises(RuntimeError, match="refused as unsafe") as refused:
        load_weights(folder)
    assert str(checkpoint / ".metadata") in str(refused.value)
    assert "outside the checkpoint" in str(refused.value)
