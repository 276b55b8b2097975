"""A re-signed checkpoint that claims more than it holds is refused by every reader, cheaply.

Each payload is put in the newest of two checkpoints and its checksums re-signed
(as anyone can): a ``bytearray(50 GiB)`` or a ``torch.FloatStorage(50 Gi)`` in a
``.pt``'s meta, a tensor rebuilt over a string, a model weight expanded to 50 GB
over 4 bytes (zero strides), a ``.metadata`` that claims 50 GiB with
``BINBYTES8``, one that is a ``torch.Size``, one giving the learning rate's
entry a 50 GB length, one claiming a 50 GB tensor, one whose chunk lies outside
its tensor or whose entries share bytes; a ``.pt`` whose meta nests 100,000 deep or
expands 2^18-fold through shared lists, or that holds a second ``DATA.PKL`` torch's
case-blind zip reader reads in place of the one weighed. Every reader runs under an
address-space limit a few GiB above where it starts (a regression fails here,
it cannot eat the machine), and must refuse naming the file -- never fall
back to the older checkpoint, which is what it did before (the file was "torn").
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import re
import resource
import shutil
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpctx import checkpoint_meta, load_weights
from ddpctx.checkpoint.sums import SHARDED_MANIFEST, sidecar
from ddpctx.checkpoint.weights import read_newest
from ddpctx.cli import main as cli
from tests.test_checkpoint_unsafe import forge_manifest, load_in_a_run, newest, saved

__all__ = ["saved"]  # the fixture, shared with the unsafe-payload tests

pytestmark = pytest.mark.timeout(180)
HUGE = 50 << 30
#: How far above its start a reader's address space may grow.
HEADROOM = 3 << 30


class Calls:
    """Unpickled, it calls ``function(*args)`` (an allocation torch's allow-list admits)."""

    def __init__(self, function: Any, *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.function, self.args


DDP = {
    "bytearray": lambda: Calls(bytearray, HUGE),
    "storage": lambda: Calls(torch.FloatStorage, HUGE // 4),
    "tensor-over-a-string": lambda: Calls(
        torch._utils._rebuild_tensor_v2, "str", 0, (1,), (1,), False, OrderedDict()
    ),
}
DCP = [
    "metadata-bytes8",
    "metadata-size",
    "entry-length",
    "tensor-size",
    "chunk-outside",  # a weight's chunk at offset -1 (before: "could not be read ... again")
    "entries-overlap",  # a weight's entry over its bias's bytes (before: the same)
]
#: Meta that loads cheaply and blows up once walked: a value 100,000 lists deep (before: a bare
#: RecursionError in load_checkpoint, accepted by checkpoint_meta); 18 levels of lists each
#: holding the one below twice (2^18 paths; before: read by all, exported at 20x the file).
#: And a second ``archive/DATA.PKL`` that torch's zip reader (case-blind) reads in place of
#: the ``data.pkl`` weighed (before: its meta was what every reader returned).
PLANTED = ["deep", "laughs", "alike-names"]
KINDS = [*DDP, "expanded", *PLANTED, *DCP]
READERS = ["checkpoint_meta", "load_weights", "export-safetensors", "load-2"]


def tamper(folder: Path, kind: str) -> Path:
    """Put the payload ``kind`` in the newest checkpoint, checksums re-signed; the carrier."""
    checkpoint = newest(folder)
    if kind in PLANTED:
        plant(checkpoint, kind)
        forge_manifest(sidecar(checkpoint), {})
        return checkpoint
    if kind in DDP or kind == "expanded":
        state = torch.load(checkpoint, weights_only=False)
        if kind == "expanded":
            state["model"]["0.weight"] = torch.ones(1).expand(HUGE // 4)
        else:
            state["meta"]["note"] = DDP[kind]()
        torch.save(state, checkpoint)
        forge_manifest(sidecar(checkpoint), {})
        return checkpoint
    carrier = checkpoint / ".metadata"
    metadata = pickle.loads(carrier.read_bytes())  # ours, as saved by the fixture
    if kind == "metadata-bytes8":
        carrier.write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", HUGE) + b"x" * 64 + b".")
    elif kind == "metadata-size":
        carrier.write_bytes(pickle.dumps(torch.Size([2, 3])))
    elif kind == "entry-length":
        index = next(i for i in metadata.storage_data if i.fqn.endswith("param_groups.0.lr"))
        metadata.storage_data[index].length = HUGE
        carrier.write_bytes(pickle.dumps(metadata))
    elif kind == "chunk-outside":
        name = next(n for n in metadata.state_dict_metadata if n.endswith("0.weight"))
        chunks = metadata.state_dict_metadata[name].chunks
        offsets = torch.Size([-1, *chunks[0].offsets[1:]])
        chunks[0] = dataclasses.replace(chunks[0], offsets=offsets)
        carrier.write_bytes(pickle.dumps(metadata))
    elif kind == "entries-overlap":
        entries = metadata.storage_data
        weight = next(i for i in entries if i.fqn.endswith("0.weight"))
        bias = next(i for i in entries if i.fqn.endswith("0.bias"))
        entries[weight] = dataclasses.replace(entries[weight], offset=entries[bias].offset)
        carrier.write_bytes(pickle.dumps(metadata))
    else:
        name = next(n for n in metadata.state_dict_metadata if n.endswith("0.weight"))
        metadata.state_dict_metadata[name].size = torch.Size([HUGE // 4])
        carrier.write_bytes(pickle.dumps(metadata))
    forge_manifest(checkpoint / SHARDED_MANIFEST, {})  # whole files re-signed
    return carrier


def records(blob: bytes) -> dict[str, bytes]:
    """A torch file's records, by the names its reader gives them."""
    reader = torch._C.PyTorchFileReader(io.BytesIO(blob))
    return {name: bytes(reader.get_record(name)) for name in reader.get_all_records()}


def with_note(checkpoint: Path, opcodes: bytes) -> dict[str, bytes]:
    """``checkpoint``'s records, its meta ``note`` made of raw pickle ``opcodes``."""
    state = torch.load(checkpoint, weights_only=True)
    state["meta"]["note"] = "@@NOTE@@"
    blob = io.BytesIO()
    torch.save(state, blob)
    found = records(blob.getvalue())
    marker = b"X" + struct.pack("<I", 8) + b"@@NOTE@@"
    assert found["data.pkl"].count(marker) == 1
    found["data.pkl"] = found["data.pkl"].replace(marker, opcodes)
    return found


def write_zip(path: Path, items: list[tuple[str, bytes]]) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in items:
            archive.writestr(f"archive/{name}", data)


def plant(checkpoint: Path, kind: str) -> None:
    """Rewrite ``checkpoint`` with the meta payload ``kind`` (see :data:`PLANTED`)."""
    if kind == "deep":
        write_zip(checkpoint, [*with_note(checkpoint, b"]" * 100_000 + b"a" * 99_999).items()])
        return
    if kind == "laughs":
        memo = 60_000
        ops = b"](X" + struct.pack("<I", 64) + b"a" * 64 + b"r" + struct.pack("<I", memo)
        for level in range(memo + 1, memo + 19):
            below = b"j" + struct.pack("<I", level - 1)
            ops += b"](" + below + below + b"e" + b"r" + struct.pack("<I", level)
        write_zip(checkpoint, [*with_note(checkpoint, ops + b"e").items()])
        return
    if kind == "alike-names-only":  # any torch file: a copy of its data.pkl, planted
        good = records(checkpoint.read_bytes())
        planted = good["data.pkl"] + b"planted"  # past its STOP: read the same, told apart
    else:
        good = with_note(checkpoint, b"K\x01")
        planted = with_note(checkpoint, b"X" + struct.pack("<I", 7) + b"planted")["data.pkl"]
    items = list(good.items())
    for where in range(len(items) + 1):  # where torch's lookup (case-blind) finds the planted
        for pad in range(40):
            padding = [(f"pad{n}", b"") for n in range(pad)]
            write_zip(checkpoint, [*items[:where], ("DATA.PKL", planted), *items[where:], *padding])
            if records(checkpoint.read_bytes()).get("data.pkl") == planted:
                return
    raise AssertionError("no layout where torch reads the planted DATA.PKL")


def limited(read: Any, *args: Any) -> Any:
    """``read(*args)`` with this process's address space limited to where it is + HEADROOM."""
    status = Path("/proc/self/status").read_text()
    here = int(next(line for line in status.splitlines() if line.startswith("VmSize:")).split()[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (here * 1024 + HEADROOM, hard))
    try:
        return read(*args)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def one_reader(reader: str, folder: str) -> str:
    """What ``reader`` said of ``folder`` in this process ('' when it read it, and what)."""
    try:
        if reader == "checkpoint_meta":
            return f"read {checkpoint_meta(folder)}"
        if reader == "load_weights":
            return f"read {sorted(load_weights(folder))}"
        target = Path(folder).parent / "model.safetensors"
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            code = cli(["export", folder, str(target)])
        return said.getvalue() if code else f"exported {target}"
    except Exception as error:
        return str(error)


def chosen_by(folder: str) -> str:
    """The checkpoint every reader of one process decides on (or its refusal)."""
    try:
        found = read_newest(folder, lambda chosen: chosen.name)
    except Exception as error:
        return str(error)
    return "" if found is None else found[1]


def read_limited(reader: str, folder: str) -> str:
    return str(limited(one_reader, reader, folder))


def load_limited(folder: str, shard: bool) -> str:
    return str(limited(load_in_a_run, folder, shard))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_resigned_checkpoint_claiming_more_than_it_holds_is_refused_by_every_reader(
    saved: dict[str, Path], tmp_path: Path, run_distributed: Any, kind: str, reader: str
) -> None:
    shard = kind in DCP
    folder = tmp_path / "run"
    shutil.copytree(saved["dcp" if shard else "ddp"], folder)
    carrier = tamper(folder, kind)
    if reader == "load-2":
        said = run_distributed(load_limited, str(folder), shard, world_size=2, timeout=120)
    else:
        said = run_distributed(read_limited, reader, str(folder), world_size=1, timeout=120)
    for message in said:
        assert "refused" in message, said
        assert str(carrier) in message, said
        assert "trying an older checkpoint" not in message, said


def test_every_reader_decides_on_the_same_checkpoint_when_a_lr_entry_claims_50_gb(
    saved: dict[str, Path], tmp_path: Path, run_distributed: Any
) -> None:
    # Before: checkpoint_meta/load_weights said step 2 (they read no lr), load_checkpoint step 1.
    folder = tmp_path / "run"
    shutil.copytree(saved["dcp"], folder)
    carrier = tamper(folder, "entry-length")
    decided = limited(chosen_by, str(folder))
    loaded = run_distributed(load_limited, str(folder), True, world_size=2, timeout=120)
    for said in (decided, *loaded):
        assert "refused" in said, (decided, loaded)
        assert str(carrier) in said, (decided, loaded)


def test_a_claim_is_weighed_without_allocating_it() -> None:
    from ddpctx.checkpoint.claims import check_torch_file
    from ddpctx.checkpoint.files import RefusedCheckpoint

    blob = io.BytesIO()
    torch.save({"note": Calls(bytearray, HUGE)}, blob)
    with pytest.raises(RefusedCheckpoint, match=r"builtins.bytearray\(\) of 53687091200") as said:
        limited(check_torch_file, io.BytesIO(blob.getvalue()), len(blob.getvalue()), Path("a.pt"))
    # The claim said is the bytearray's own size (before: 16 bytes an element, 16x too big).
    claimed = int(re.search(r"what it claims to (\d+) bytes", str(said.value)).group(1))  # type: ignore[union-attr]
    assert HUGE <= claimed < HUGE + (1 << 20), str(said.value)


def test_a_deleted_newest_pt_whose_manifest_stayed_is_said_naming_it(
    saved: dict[str, Path], tmp_path: Path, run_distributed: Any
) -> None:
    # Before: every reader resumed from the older checkpoint without a word.
    folder = tmp_path / "run"
    shutil.copytree(saved["ddp"], folder)
    lost = newest(folder)
    lost.unlink()
    with pytest.warns(RuntimeWarning, match=rf"{re.escape(str(lost))}' is missing though its"):
        meta = checkpoint_meta(folder)
    assert meta == {"epoch": 0}
    said = run_distributed(warned_loading, str(folder), world_size=2, timeout=120)
    assert any(lost.name in text for text in said[0]), said


def warned_loading(folder: str) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_in_a_run(folder, False)
    return [str(w.message) for w in caught]


def test_a_legacy_format_entry_is_weighed_too() -> None:
    # A pre-zip torch file (a DCP entry of an old writer) allocates each storage it claims.
    from ddpctx.checkpoint.entries import weights_only_value
    from ddpctx.checkpoint.files import RefusedCheckpoint

    blob = io.BytesIO()
    torch.save({"note": Calls(bytearray, HUGE)}, blob, _use_new_zipfile_serialization=False)
    with pytest.raises(RefusedCheckpoint, match=r"s\.distcp' was refused: it holds builtins"):
        limited(weights_only_value, io.BytesIO(blob.getvalue()), Path("s.distcp"), "w", True)


def saves_and_loads_a_broadcast_buffer(folder: str) -> list[float]:
    import ddpctx

    ctx = ddpctx.current()
    assert ctx is not None
    model = torch.nn.Linear(2, 2)
    model.register_buffer("scale", torch.full((1,), 3.0).expand(1000))
    ctx.save_checkpoint(folder, model=model, epoch=0)
    model.scale = torch.zeros(1000)
    meta = ctx.load_checkpoint(folder, model=model)
    assert meta is not None
    assert meta["epoch"] == 0, meta
    return [float(model.scale.sum()), float(load_weights(folder)["scale"].sum())]


def test_a_small_expanded_buffer_a_user_saved_still_loads(
    tmp_path: Path, run_distributed: Any
) -> None:
    # An expanded tensor is weighed at its full size, not refused for being expanded.
    folder = str(tmp_path / "run")
    assert run_distributed(saves_and_loads_a_broadcast_buffer, folder, world_size=1) == [
        [3000.0, 3000.0]
    ]


def test_a_symlink_loop_named_like_the_newest_sharded_checkpoint_is_warned_about(
    saved: dict[str, Path], tmp_path: Path
) -> None:
    # Before: checkpoint_meta read the older checkpoint without a word.
    folder = tmp_path / "run"
    shutil.copytree(saved["dcp"], folder)
    loop = folder / "checkpoint-000009-epoch8.dcp"
    loop.symlink_to(loop.name)
    with pytest.warns(RuntimeWarning, match=rf"ignoring {re.escape(repr(str(loop)))}: it is named"):
        assert checkpoint_meta(folder) is not None


def test_a_shard_entry_with_names_alike_but_for_case_is_refused(tmp_path: Path) -> None:
    # A shard entry is a torch file read by torch's zip reader too: the same rule.
    from ddpctx.checkpoint.entries import weights_only_value
    from ddpctx.checkpoint.files import RefusedCheckpoint

    blob = io.BytesIO()
    torch.save({"w": torch.ones(2)}, blob)
    entry = tmp_path / "entry.pt"
    entry.write_bytes(blob.getvalue())
    plant(entry, "alike-names-only")
    with pytest.raises(RefusedCheckpoint, match=r"s\.distcp' was refused: it holds (two|a) rec"):
        limited(weights_only_value, io.BytesIO(entry.read_bytes()), Path("s.distcp"), "w", True)


def test_meta_nested_deeper_than_a_load_allows_is_refused_when_saved() -> None:
    # A checkpoint is refused at load past MAX_DEPTH: so is its meta when saved, not after.
    from ddpctx.checkpoint.meta import plain_meta
    from ddpctx.checkpoint.shape import MAX_DEPTH, check_loaded

    nested: Any = 1
    for _ in range(MAX_DEPTH - 2):
        nested = [nested]
    state = {"meta": plain_meta({"deep": nested})}  # meta sits 2 deep in a checkpoint
    check_loaded(state, 100, Path("a.pt"))  # loads
    with pytest.raises(ValueError, match=r"nests more than 98 levels deep"):
        plain_meta({"deep": [nested]})


@pytest.mark.parametrize("kind", ["ddp", "dcp"])
def test_a_manifest_that_is_a_pipe_is_damage_not_a_wait(
    saved: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    # Found by the outside attack: a FIFO as the manifest (a tar of an untrusted archive can
    # make one) hung every reader forever, opening it.
    import os
    import subprocess
    import sys

    from tests.helpers import child_env, patience

    folder = tmp_path / "run"
    shutil.copytree(saved[kind], folder)
    checkpoint = newest(folder)
    manifest = checkpoint / SHARDED_MANIFEST if kind == "dcp" else sidecar(checkpoint)
    manifest.unlink()
    os.mkfifo(manifest)
    code = f"import ddpctx; print(ddpctx.checkpoint_meta({str(folder)!r}))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=patience(120),
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "not a regular file" in done.stderr, done.stderr[-2000:]
    assert str(manifest) in done.stderr, done.stderr[-2000:]


def test_a_storage_without_its_record_is_said_so_not_as_a_record_of_none_bytes() -> None:
    # Found by the outside attack: "a storage of 32 bytes in a record of None bytes".
    from ddpctx.checkpoint.claims import check_torch_file
    from ddpctx.checkpoint.files import RefusedCheckpoint

    blob = io.BytesIO()
    torch.save({"w": torch.ones(8)}, blob)
    found = records(blob.getvalue())
    assert "data/0" in found, sorted(found)
    moved = io.BytesIO()
    with zipfile.ZipFile(moved, "w", zipfile.ZIP_STORED) as archive:
        for name, data in found.items():
            archive.writestr(f"archive/{'data/7' if name == 'data/0' else name}", data)
    with pytest.raises(RefusedCheckpoint) as said:
        check_torch_file(io.BytesIO(moved.getvalue()), len(moved.getvalue()), Path("a.pt"))
    message = str(said.value)
    assert "None" not in message, message
    assert "a storage of 32 bytes whose record 'data/0' is not in the file" in message, message
    assert "restore it from a copy you trust" in message, message  # the fix
