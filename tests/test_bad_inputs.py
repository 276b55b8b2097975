"""Bad inputs, table-driven: each gets a clear error naming the value and the fix, within a second,
with no process group, context or process left behind (the conftest checks the first two).

The same rows are published in docs/bad-inputs.md; a test keeps the two in step.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset

from ddpctx import (
    all_reduced,
    distributed,
    launch,
    rank_zero_only,
    reduce_tensor,
    set_seed,
)
from ddpctx.checkpoint.files import atomic_save, training_state
from tests.helpers import REPO, patience

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_NODELIST": "node[01-02]",
    "SLURM_JOB_ID": "77",
}


@dataclass
class Row:
    area: str
    given: str
    error: type[BaseException]
    says: str  # a fragment of the message: the value, and the fix
    call: Callable[[Path], Any]
    environ: dict[str, str] = field(default_factory=dict)
    #: Run first, untimed: torch's one-time costs (a first DDP or FSDP2 model takes seconds).
    warm: Callable[[Path], Any] | None = None
    #: Seconds the refusal may take: one, unless it must first import what torch would import
    #: at that call anyway (torch's compiler, dynamo: 4-5 s cold on a busy 2-core machine).
    within: float = 1.0


def enter(**kwargs: Any) -> Callable[[Path], Any]:
    def run(_: Path) -> None:
        with distributed(**kwargs):
            pass

    return run


def reduce_in_group(result: Any, **options: Any) -> Callable[[Path], Any]:
    def run(_: Path) -> None:
        with distributed():
            all_reduced(**options)(lambda: result)()

    return run


def nested(_: Path) -> None:
    with distributed(), distributed():
        pass


class Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter([1])


def in_context(action: Callable[[Any, Path], Any]) -> Callable[[Path], Any]:
    def run(tmp: Path) -> None:
        with distributed() as ctx:
            action(ctx, tmp)

    return run


def other_world_size(ctx: Any, tmp: Path) -> None:
    model = torch.nn.Linear(2, 1)
    atomic_save(training_state(model, None, None, {}, 4, [{}] * 4), tmp / "checkpoint-000001.pt")
    ctx.load_checkpoint(tmp, model=model)


def pickled_code(ctx: Any, tmp: Path) -> None:
    torch.save({"hook": os.system}, tmp / "evil.pt")
    ctx.load(tmp / "evil.pt")


def not_a_torch_file(ctx: Any, tmp: Path) -> None:
    (tmp / "notes.pt").write_text("not a checkpoint")
    ctx.load(tmp / "notes.pt")


def refused_checkpoint(ctx: Any, tmp: Path) -> None:
    state = training_state(torch.nn.Linear(1, 1), None, None, {"b": np.float64(1)}, 1, [{}])
    atomic_save(state, tmp / "checkpoint-000001.pt")
    ctx.load_checkpoint(tmp, model=torch.nn.Linear(1, 1))


def only_torn_checkpoints(ctx: Any, tmp: Path) -> None:
    (tmp / "checkpoint-000001.pt").write_bytes(b"PK\x03\x04 torn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx.load_checkpoint(tmp, model=torch.nn.Linear(1, 1))


def missing_extra(ctx: Any, tmp: Path) -> None:
    ctx.save_checkpoint(tmp, model=torch.nn.Linear(1, 1))
    ctx.load_checkpoint(tmp, model=torch.nn.Linear(1, 1), extra={"ema": torch.nn.Linear(1, 1)})


def full_disk(ctx: Any, tmp: Path) -> None:
    real_write = os.write

    def write(descriptor: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    os.write = write
    try:
        ctx.save({"x": 1}, tmp / "x.pt")
    finally:
        os.write = real_write


def file_in_the_way(ctx: Any, tmp: Path) -> None:
    (tmp / "file.pt").write_text("not a directory")
    with ctx.atomic_dir(tmp / "file.pt"):
        pass


def file_as_checkpoint_directory(ctx: Any, tmp: Path) -> None:
    (tmp / "afile").write_text("not a directory")
    ctx.save_checkpoint(tmp / "afile", model=torch.nn.Linear(1, 1))


def clip_in_rank_zero_work(ctx: Any, tmp: Path) -> None:
    model = ctx.wrap(torch.nn.Linear(2, 1))
    model(torch.ones(1, 2)).sum().backward()
    with ctx.rank_zero() as main:
        if main:
            ctx.clip_grad_norm_(model, max_norm=1.0)


def first_parallel_model(ctx: Any, tmp: Path) -> None:
    ctx.wrap(torch.nn.Linear(2, 1))
    ctx.shard(torch.nn.Linear(2, 1))


def forward_in_rank_zero_work(how: str) -> Callable[[Any, Path], None]:
    def call(ctx: Any, tmp: Path) -> None:
        layer = torch.nn.Sequential(torch.nn.Linear(2, 1))
        model = ctx.wrap(layer) if how == "wrap" else ctx.shard(layer)

        @rank_zero_only(barrier=True)
        def sample() -> None:
            model(torch.ones(1, 2))

        sample()

    return call


def changed_data(tmp: Path) -> None:
    with distributed() as ctx:
        loader = ctx.dataloader(list(range(8)), batch_size=2)  # held: a dropped one is not saved
        next(iter(loader))
        ctx.save_checkpoint(tmp, model=torch.nn.Linear(1, 1))  # mid-epoch
    with distributed() as ctx:
        other = ctx.dataloader(list(range(9)), batch_size=2)  # other data in the first's place
        ctx.load_checkpoint(tmp, model=torch.nn.Linear(1, 1))
        next(iter(other))


ROWS = [
    Row(
        "torchrun env",
        "RANK=0 without WORLD_SIZE",
        ValueError,
        "RANK='0' is set but WORLD_SIZE is not",
        enter(),
        {"RANK": "0"},
    ),
    Row(
        "torchrun env",
        "WORLD_SIZE=2 without RANK",
        ValueError,
        "WORLD_SIZE='2' is set but RANK is not",
        enter(),
        {"WORLD_SIZE": "2"},
    ),
    Row(
        "torchrun env",
        "RANK=one",
        ValueError,
        "RANK='one' is not an integer",
        enter(),
        {**TORCHRUN, "RANK": "one"},
    ),
    Row(
        "torchrun env",
        "RANK=-1",
        ValueError,
        "RANK='-1' must be >= 0",
        enter(),
        {**TORCHRUN, "RANK": "-1"},
    ),
    Row(
        "torchrun env",
        "RANK=2, WORLD_SIZE=2",
        ValueError,
        "RANK=2 is not below WORLD_SIZE=2",
        enter(),
        {**TORCHRUN, "RANK": "2"},
    ),
    Row(
        "torchrun env",
        "LOCAL_RANK=2, LOCAL_WORLD_SIZE=2",
        ValueError,
        "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2",
        enter(),
        {**TORCHRUN, "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
    ),
    Row(
        "torchrun env",
        "LOCAL_WORLD_SIZE=4 > WORLD_SIZE=2",
        ValueError,
        "LOCAL_WORLD_SIZE=4 exceeds WORLD_SIZE=2",
        enter(),
        {**TORCHRUN, "LOCAL_WORLD_SIZE": "4"},
    ),
    Row(
        "torchrun env",
        "MASTER_ADDR missing with WORLD_SIZE=2",
        ValueError,
        "MASTER_ADDR is not set but WORLD_SIZE=2",
        enter(),
        {k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"},
    ),
    Row(
        "torchrun env",
        "MASTER_PORT=70000",
        ValueError,
        "MASTER_PORT='70000' is not a TCP port",
        enter(),
        {**TORCHRUN, "MASTER_PORT": "70000"},
    ),
    Row(
        "torchrun env",
        "MASTER_ADDR='127.0.0.1 ' (as $(hostname -I) gives)",
        ValueError,
        "MASTER_ADDR='127.0.0.1 ' contains whitespace",
        enter(),
        {**TORCHRUN, "MASTER_ADDR": "127.0.0.1 "},
    ),
    Row(
        "torchrun env",
        "MASTER_ADDR a host name that does not resolve",
        ValueError,
        "MASTER_ADDR='no-such-host.invalid' does not resolve on this host",
        enter(),
        {**TORCHRUN, "MASTER_ADDR": "no-such-host.invalid"},
    ),
    Row(
        "SLURM env",
        "MASTER_ADDR a host name that does not resolve (SLURM)",
        ValueError,
        "MASTER_ADDR='no-such-host.invalid' does not resolve on this host",
        enter(),
        {**SLURM, "MASTER_ADDR": "no-such-host.invalid"},
    ),
    Row(
        "environment",
        "DDPCTX_TIMEOUT=soon",
        ValueError,
        "DDPCTX_TIMEOUT='soon' is not a number of seconds",
        enter(),
        {"DDPCTX_TIMEOUT": "soon"},
    ),
    Row(
        "SLURM env",
        "SLURM_PROCID=2 of SLURM_NTASKS=2",
        ValueError,
        "SLURM_PROCID=2 is not below SLURM_NTASKS=2",
        enter(),
        {**SLURM, "SLURM_PROCID": "2"},
    ),
    Row(
        "SLURM env",
        "SLURM_STEP_TASKS_PER_NODE='2 x1'",
        ValueError,
        "SLURM_STEP_TASKS_PER_NODE='2 x1' is not a SLURM tasks-per-node list",
        enter(),
        {**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2 x1"},
    ),
    Row(
        "SLURM env",
        "SLURM_JOB_NODELIST='node[01-'",
        ValueError,
        "SLURM_JOB_NODELIST='node[01-' is not a SLURM host list",
        enter(),
        {**SLURM, "SLURM_JOB_NODELIST": "node[01-"},
    ),
    Row(
        "SLURM env",
        "no SLURM_JOB_NODELIST and no MASTER_ADDR",
        ValueError,
        "Neither MASTER_ADDR nor SLURM_JOB_NODELIST is set",
        enter(),
        {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"},
    ),
    Row(
        "SLURM env",
        "no SLURM_JOB_ID and no MASTER_PORT",
        ValueError,
        "Neither MASTER_PORT nor SLURM_JOB_ID is set",
        enter(),
        {k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"},
    ),
    Row(
        "Open MPI env",
        "OMPI_COMM_WORLD_RANK without OMPI_COMM_WORLD_SIZE",
        ValueError,
        "OMPI_COMM_WORLD_RANK='0' is set but OMPI_COMM_WORLD_SIZE is not",
        enter(),
        {"OMPI_COMM_WORLD_RANK": "0"},
    ),
    Row(
        "Open MPI env",
        "MASTER_ADDR missing with OMPI_COMM_WORLD_SIZE=2",
        ValueError,
        "MASTER_ADDR is not set but OMPI_COMM_WORLD_SIZE=2",
        enter(),
        {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},
    ),
    Row(
        "distributed()", "seed='42'", ValueError, "seed='42' (str) is not an int", enter(seed="42")
    ),
    Row(
        "distributed()", "seed=True", ValueError, "seed=True (bool) is not an int", enter(seed=True)
    ),
    Row("distributed()", "seed=-1", ValueError, "seed=-1 gives rank seeds -1..-1", enter(seed=-1)),
    Row(
        "distributed()",
        "backend='nccl' without CUDA",
        RuntimeError,
        "backend='nccl' needs CUDA",
        enter(backend="nccl"),
    ),
    Row(
        "distributed()",
        "backend='tcp'",
        ValueError,
        "backend='tcp' is not a known backend",
        enter(backend="tcp"),
    ),
    Row(
        "distributed()",
        "timeout=0",
        ValueError,
        "timeout=0 is outside the accepted range",
        enter(timeout=0),
    ),
    Row(
        "distributed()",
        "timeout=inf",
        ValueError,
        "timeout=inf is outside the accepted range of 0.001 s to 31536000 s",
        enter(timeout=float("inf")),
    ),
    Row(
        "distributed()",
        "timeout=nan",
        ValueError,
        "timeout=nan is outside the accepted range",
        enter(timeout=float("nan")),
    ),
    Row(
        "distributed()",
        "timeout=timedelta.max",
        ValueError,
        "is outside the accepted range of 0.001 s to 31536000 s",
        enter(timeout=timedelta.max),
    ),
    Row(
        "environment",
        "DDPCTX_TIMEOUT=1e20",
        ValueError,
        "DDPCTX_TIMEOUT='1e20' is outside the accepted range",
        enter(),
        {"DDPCTX_TIMEOUT": "1e20"},
    ),
    Row(
        "distributed()",
        "distributed() inside distributed()",
        RuntimeError,
        "distributed() is already active in this process",
        nested,
    ),
    Row(
        "@all_reduced",
        "a string leaf",
        TypeError,
        "['tag'] is str 'best'",
        reduce_in_group({"loss": 1.0, "tag": "best"}),
    ),
    Row(
        "@all_reduced",
        "a None leaf",
        TypeError,
        "['acc'] is NoneType None",
        reduce_in_group({"loss": 1.0, "acc": None}),
    ),
    Row(
        "@all_reduced",
        "a complex tensor",
        TypeError,
        "['z'] is a complex tensor (torch.complex64) tensor(0.+1.j): only real leaves",
        reduce_in_group({"z": torch.tensor(1j)}),
    ),
    Row(
        "@all_reduced",
        "op naming a missing key",
        ValueError,
        "names ['los'], which the result",
        reduce_in_group({"loss": 1.0}, op={"los": "max"}),
    ),
    Row(
        "@all_reduced",
        "op='avg'",
        ValueError,
        "'avg' is not a reduction",
        lambda _: all_reduced(op="avg"),
    ),
    Row(
        "@all_reduced",
        "weight='count' but no count",
        ValueError,
        "weight='count' but ['loss'] has no 'count' leaf",
        reduce_in_group({"loss": 1.0}, weight="count"),
    ),
    Row(
        "@all_reduced",
        "a count that is a list",
        ValueError,
        "the weight 'count' must be one number",
        reduce_in_group({"l": 1.0, "count": [1, 2]}, weight="count"),
    ),
    Row(
        "checkpoint",
        "save to a missing directory",
        FileNotFoundError,
        "does not exist. Create it first",
        in_context(lambda c, t: c.save({}, t / "none" / "x.pt")),
    ),
    Row(
        "checkpoint",
        "load a missing file",
        FileNotFoundError,
        "does not exist. Check the path",
        in_context(lambda c, t: c.load(t / "missing.pt")),
    ),
    Row(
        "checkpoint",
        "load a file that is not a torch file",
        RuntimeError,
        "could not be loaded as a torch file",
        in_context(not_a_torch_file),
    ),
    Row(
        "checkpoint",
        "load a file carrying pickled code",
        RuntimeError,
        "weights_only=True refuses to run",
        in_context(pickled_code),
    ),
    Row(
        "checkpoint",
        "a checkpoint from world size 4 in a run of 1",
        ValueError,
        "written by a run of world size 4, and this run has world size 1",
        in_context(other_world_size),
    ),
    Row(
        "checkpoint",
        "keep=0",
        ValueError,
        "keep=0 must be a positive int",
        in_context(lambda c, t: c.save_checkpoint(t, model=torch.nn.Linear(1, 1), keep=0)),
    ),
    Row(
        "data",
        "a stream with shuffle=True and no shuffle_buffer",
        ValueError,
        "shuffled through a buffer of samples. Pass shuffle_buffer=N",
        in_context(lambda c, t: c.dataloader(Stream(), batch_size=1, shuffle=True)),
    ),
    Row(
        "data",
        "sampler=... passed to ctx.dataloader",
        ValueError,
        "got sampler=...; it makes its own",
        in_context(lambda c, t: c.dataloader([1], 1, sampler=[0])),
    ),
    Row(
        "data",
        "ctx.dataloader(device='cuda') without CUDA",
        ValueError,
        "CUDA is not available here",
        in_context(lambda c, t: c.dataloader([1], 1, device="cuda")),
    ),
    Row(
        "data",
        "ctx.dataloader(device='gpu')",
        ValueError,
        "device='gpu'): not a torch device",
        in_context(lambda c, t: c.dataloader([1], 1, device="gpu")),
    ),
    Row(
        "data",
        "ctx.dataloader(shuffle='yes')",
        ValueError,
        "shuffle='yes'): must be True or False",
        in_context(lambda c, t: c.dataloader([1], 1, shuffle="yes")),
    ),
    Row(
        "data",
        "epochs(3, start=4)",
        ValueError,
        "start=4 is past n=3",
        in_context(lambda c, t: list(c.epochs(3, start=4))),
    ),
    Row(
        "launch()",
        "world_size=0",
        ValueError,
        "world_size=0 must be a positive int",
        lambda _: launch(print, world_size=0),
    ),
    Row(
        "launch()",
        "timeout=inf",
        ValueError,
        "timeout=inf is outside the accepted range of 0.001 s to 31536000 s",
        lambda _: launch(print, world_size=2, timeout=float("inf")),
    ),
    Row(
        "launch()",
        "called inside `with distributed()`",
        RuntimeError,
        "Call launch() outside the `with distributed()` block",
        in_context(lambda c, t: launch(print, world_size=2)),
    ),
    Row(
        "Kronos helpers",
        "reduce_tensor(op='average')",
        ValueError,
        "'average' is not a reduction",
        lambda _: reduce_tensor(torch.ones(1), op="average"),
    ),
    Row(
        "Kronos helpers",
        "reduce_tensor(world_size=4) in a world of 1",
        ValueError,
        "world_size=4 but the process group has 1 ranks",
        lambda _: reduce_tensor(torch.ones(1), 4),
    ),
    Row(
        "Kronos helpers",
        "set_seed(None)",
        ValueError,
        "set_seed() needs an int",
        lambda _: set_seed(None),
    ),  # type: ignore[arg-type]
    Row(
        "hang doctor",
        "hang_timeout=-1",
        ValueError,
        "hang_timeout=-1 must be a number of seconds >= 0",
        enter(hang_timeout=-1),
    ),
    Row(
        "hang doctor",
        "hang_timeout=900 with timeout=600",
        ValueError,
        "hang_timeout=900 s is not below the collective timeout of 600 s",
        enter(hang_timeout=900, timeout=600),
    ),
    Row(
        "hang doctor",
        "on_hang='kill'",
        ValueError,
        "on_hang='kill' is not an option",
        enter(on_hang="kill"),
    ),
    Row(
        "hang doctor",
        "DDPCTX_HANG_TIMEOUT=soon",
        ValueError,
        "DDPCTX_HANG_TIMEOUT='soon' is not a number of seconds",
        enter(),
        {"DDPCTX_HANG_TIMEOUT": "soon"},
    ),
    Row(
        "hang doctor",
        "DDPCTX_DEBUG=all",
        ValueError,
        "DDPCTX_DEBUG='all' is not a debug mode",
        enter(),
        {"DDPCTX_DEBUG": "all"},
    ),
    Row(
        "checkpoint",
        "meta holding a Fraction",
        TypeError,
        "which torch.load(weights_only=True) would refuse",
        in_context(
            lambda c, t: c.save_checkpoint(t, model=torch.nn.Linear(1, 1), f=Fraction(1, 3))
        ),
    ),
    Row(
        "checkpoint",
        "a checkpoint that reads but holds a NumPy scalar",
        RuntimeError,
        "reads as a torch file but torch.load(weights_only=True) refuses",
        in_context(refused_checkpoint),
    ),
    Row(
        "checkpoint",
        "checkpoints exist and none loads",
        RuntimeError,
        "none of them loads (each is torn or damaged: see the warnings)",
        in_context(only_torn_checkpoints),
    ),
    Row(
        "checkpoint",
        "step=-1",
        ValueError,
        "step=-1 must be a non-negative int",
        in_context(lambda c, t: c.save_checkpoint(t, model=torch.nn.Linear(1, 1), step=-1)),
    ),
    Row(
        "checkpoint",
        "extra= object without state_dict",
        TypeError,
        "without state_dict() and load_state_dict()",
        in_context(lambda c, t: c.save_checkpoint(t, model=torch.nn.Linear(1, 1), extra={"e": 1})),
    ),
    Row(
        "checkpoint",
        "extra= name the checkpoint lacks",
        ValueError,
        "holds no extra state 'ema'",
        in_context(missing_extra),
    ),
    Row(
        "checkpoint",
        "a full disk during save",
        OSError,
        "no space left on device while saving",
        in_context(full_disk),
    ),
    Row(
        "checkpoint",
        "a loader over other data than the checkpoint's",
        ValueError,
        "The data changed length, so that position cannot be resumed",
        changed_data,
    ),
    Row(
        "checkpoint",
        "save_checkpoint into a path that is a file",
        NotADirectoryError,
        "is a file, not a directory; checkpoints are saved into a directory",
        in_context(file_as_checkpoint_directory),
    ),
    Row(
        "rank-zero work",
        "ctx.clip_grad_norm_ of a ctx.wrap model inside ctx.rank_zero()",
        RuntimeError,
        "rank 0's gradients alone would be scaled",
        in_context(clip_in_rank_zero_work),
        warm=in_context(first_parallel_model),
    ),
    Row(
        "rank-zero work",
        "the forward of a ctx.wrap model inside @rank_zero_only",
        RuntimeError,
        "Call the bare module there, which runs no collective: ctx.unwrap(model)(x)",
        in_context(forward_in_rank_zero_work("wrap")),
        warm=in_context(first_parallel_model),
    ),
    Row(
        "rank-zero work",
        "the forward of a ctx.shard model inside @rank_zero_only",
        RuntimeError,
        "A sharded model has no forward one rank can run alone",
        in_context(forward_in_rank_zero_work("shard")),
        warm=in_context(first_parallel_model),
    ),
    Row(
        "atomic_dir",
        "a path that is a file",
        FileExistsError,
        "exists and is not a directory; atomic_dir replaces directories only",
        in_context(file_in_the_way),
    ),
    Row(
        "compile=",
        "ctx.wrap(model, compile={'fullgraph': 'yes'})",
        TypeError,
        "'fullgraph': 'yes' is of type str; torch.compile takes bool",
        in_context(lambda c, t: c.wrap(torch.nn.Linear(1, 1), compile={"fullgraph": "yes"})),
    ),
    Row(
        "compile=",
        "ctx.wrap(model, compile={'nonsense': 1})",
        ValueError,
        "'nonsense' (= 1) is not an argument of torch.compile",
        in_context(lambda c, t: c.wrap(torch.nn.Linear(1, 1), compile={"nonsense": 1})),
    ),
    Row(
        "compile=",
        "ctx.wrap(model, compile={'options': {'x': 1}})",
        ValueError,
        "'options' key 'x' (= 1) is not an inductor setting",
        in_context(lambda c, t: c.wrap(torch.nn.Linear(1, 1), compile={"options": {"x": 1}})),
        within=15.0,
    ),
    Row(
        "compile=",
        "compile={'backend': 'aot_eager', 'options': {...}}",
        ValueError,
        "which takes no options (torch would pass them and it would ignore them)",
        in_context(
            lambda c, t: c.wrap(
                torch.nn.Linear(1, 1), compile={"backend": "aot_eager", "options": {"x": 1}}
            )
        ),
        within=15.0,
    ),
    Row(
        "accumulation",
        "ctx.accumulate(model, every=0)",
        ValueError,
        "every=0 must be a positive int",
        in_context(lambda c, t: c.accumulate(torch.nn.Linear(1, 1), every=0)),
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.area}: {r.given}" for r in ROWS])
def test_bad_input_gets_a_clear_error_quickly(
    row: Row, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in row.environ.items():
        monkeypatch.setenv(name, value)
    if row.warm is not None:
        row.warm(tmp_path)
    started = time.monotonic()
    with pytest.raises(row.error, match=re.escape(row.says)):
        row.call(tmp_path)
    assert time.monotonic() - started < patience(row.within)


def test_a_master_port_in_use_on_rank_zero_is_named_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: torch's "The server socket has failed to listen ... EADDRINUSE", no variable named.
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        for name, value in {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("MASTER_PORT", str(port))
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"MASTER_PORT={port} is already in use") as raised:
            distributed(timeout=timedelta(seconds=20)).__enter__()
        assert time.monotonic() - started < patience(10)
        assert f"MASTER_PORT to a free port (e.g. {port + 1})" in str(raised.value)


def test_there_are_at_least_30_rows() -> None:
    assert len(ROWS) >= 30


def test_the_published_table_lists_every_row() -> None:
    published = (REPO / "docs" / "bad-inputs.md").read_text()
    for row in ROWS:
        assert row.given in published, row.given
        assert row.says in published, row.says


def test_nan_and_inf_pass_through_as_values_and_an_empty_result_is_fine() -> None:
    with distributed():
        result = all_reduced(lambda: {"a": float("nan"), "b": float("inf"), "c": {}})()
    assert result["b"] == float("inf")
    assert result["a"] != result["a"]  # NaN
    assert result["c"] == {}


def markdown_table() -> str:
    """The table published in docs/bad-inputs.md (regenerate by running this module)."""
    lines = ["| area | bad input | error | the message says |", "|---|---|---|---|"]
    for row in ROWS:
        lines.append(f"| {row.area} | {row.given} | `{row.error.__name__}` | {row.says} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())


def test_a_cuda_device_past_the_last_gpu_is_refused_when_the_loader_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Found by an outside attack: device="cuda" without CUDA was accepted and failed at the
    # first batch with torch's "Torch not compiled with CUDA enabled". CUDA faked here.
    from ddpctx.data.dataloader import loader_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert loader_device("cuda:1") == torch.device("cuda", 1)
    assert loader_device("cuda") == torch.device("cuda")
    with pytest.raises(ValueError, match=r"device='cuda:2'\): this machine has 2 CUDA device"):
        loader_device("cuda:2")


def test_shuffle_and_pad_take_bools_numpy_bools_and_0_or_1() -> None:
    import numpy as np

    from ddpctx import distributed

    with distributed(seed=0) as context:
        ctx: Any = context  # flags of other types, on purpose
        for flag in (True, False, np.True_, np.False_, 1, 0):
            loader = ctx.dataloader(list(range(6)), 2, shuffle=flag, pad=flag)
            assert loader.sampler.shuffle is bool(flag)
        for bad in ("no", None, 2, 0.5):
            with pytest.raises(ValueError, match="must be True or False"):
                ctx.dataloader(list(range(6)), 2, pad=bad)
