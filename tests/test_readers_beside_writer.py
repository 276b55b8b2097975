"""The readers beside a running job that saves with ``keep=1`` (and so prunes at every save).

A real writer -- a plain ``python`` process under ``distributed()`` (world size 1, gloo)
-- saves a small model in a loop with ``keep=1``, each tensor filled with the step
number, as a DDP ``.pt`` (``ctx.wrap``) or a sharded ``.dcp`` (``ctx.shard``). Meanwhile
this process reads the directory over and over with ``load_weights``,
``checkpoint_meta`` and ``python -m ddpctx export`` (its entry point, in process).
Every read must return one whole checkpoint the writer saved (every tensor holds
the same step), never an older one than a previous read returned, with no
exception and no warning: a checkpoint the writer removed under a read was pruned,
not damaged, and the read starts over on the newest one.
"""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ddpctx import checkpoint_meta, load_weights
from ddpctx.cli import main as cli
from tests.helpers import REPO, child_env, patience

pytestmark = pytest.mark.timeout(120)  # each test: a writer of at most 60 s, reads of 25 s

WRITER = """
import sys, time
from collections.abc import Callable
from pathlib import Path
import torch
from torch import nn
from ddpctx import distributed

folder, mode, seconds = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
stop = folder.parent / "stop"
with distributed(seed=0) as ctx:
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    model = ctx.wrap(model) if mode == "wrap" else ctx.shard(model)
    deadline = time.monotonic() + seconds
    step = 0
    while time.monotonic() < deadline and not stop.exists():
        step += 1
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(float(step))
        ctx.save_checkpoint(folder, model=model, step=step, keep=1, name="beside")
print("saved", step, flush=True)
"""


def one_step(weights: dict[str, torch.Tensor]) -> int:
    """The step every tensor of one read holds (the read is one whole checkpoint)."""
    values = {float(v) for tensor in weights.values() for v in (tensor.min(), tensor.max())}
    assert len(values) == 1, f"one read mixes checkpoints: {sorted(values)}"
    assert sorted(weights) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    return int(values.pop())


@pytest.mark.slow  # a writer process and ~25 s of reads beside it, per mode
@pytest.mark.parametrize("mode", ["wrap", "shard"])
def test_reads_beside_a_writer_that_prunes_return_whole_newest_checkpoints(
    mode: str, tmp_path: Path
) -> None:
    folder = tmp_path / "checkpoints"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(folder), mode, "60"],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    outcomes: list[str] = []
    steps: list[int] = []
    try:
        started = time.monotonic() + patience(40)
        while not any(folder.glob("checkpoint-*")):
            assert writer.poll() is None, writer.communicate()[1][-3000:]
            assert time.monotonic() < started, "the writer saved nothing"
            time.sleep(0.05)
        first = int(next(folder.glob("checkpoint-*")).name.split("-")[1].split(".")[0])
        deadline = time.monotonic() + 25
        count = 0
        while time.monotonic() < deadline and count < 240 and writer.poll() is None:
            count += 1
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    if count % 3 == 0:
                        steps.append(one_step(load_weights(folder)))
                    elif count % 3 == 1:
                        meta = checkpoint_meta(folder)
                        assert meta is not None
                        assert meta["name"] == "beside"
                        steps.append(int(meta["step"]))
                    else:
                        out = tmp_path / "model.pt"
                        assert cli(["export", str(folder), str(out)]) == 0
                        exported = torch.load(out, weights_only=True)
                        steps.append(one_step(exported["model"]))
                        assert exported["meta"]["step"] == steps[-1]
                    outcomes.append("ok")
                except BaseException as error:  # torch's CheckpointException is no Exception
                    outcomes.append(f"{type(error).__name__}: {str(error)[:200]}")
            outcomes.extend(f"warned: {str(w.message)[:200]}" for w in caught)
    finally:
        (tmp_path / "stop").touch()
        try:
            out_text, err_text = writer.communicate(timeout=patience(30))
        except subprocess.TimeoutExpired:
            writer.kill()
            out_text, err_text = writer.communicate()
    assert writer.returncode == 0, err_text[-3000:]
    last = int(out_text.split()[-1])
    problems = [outcome for outcome in outcomes if outcome != "ok"]
    assert not problems, f"{len(problems)} of {len(outcomes)}: {problems[:5]}"
    assert steps == sorted(steps), "a read went back to an older checkpoint"
    # the reads overlapped many saves (and so many prunes), or this proved nothing
    assert len(steps) >= 20, steps
    assert last - first >= 10, (first, last)
    assert steps[-1] > steps[0], steps


def small() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def filled(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(float(step))


@pytest.mark.parametrize("mode", ["wrap", "shard"])
def test_a_read_overtaken_by_a_save_that_prunes_starts_over_on_the_newest(
    mode: str, tmp_path: Path
) -> None:
    # The race made deterministic: during the first read, the writer publishes step 2
    # and prunes (keep=1) the checkpoint being read, which then fails to read.
    from ddpctx import distributed
    from ddpctx.checkpoint.weights import read_newest, weights_of

    folder = tmp_path / "checkpoints"
    with distributed(seed=0) as ctx:
        model = ctx.wrap(small()) if mode == "wrap" else ctx.shard(small())
        filled(model, 1)
        ctx.save_checkpoint(folder, model=model, step=1, keep=1)
        read: list[str] = []

        def overtaken(chosen: Path) -> dict[str, torch.Tensor]:
            read.append(chosen.name)
            if len(read) == 1:
                filled(model, 2)
                ctx.save_checkpoint(folder, model=model, step=2, keep=1)
                assert not chosen.exists()  # pruned under the read
            return weights_of(chosen)[0]

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = read_newest(folder, overtaken)
    assert found is not None
    chosen, weights = found
    assert [w.message for w in caught] == []  # removed, not damaged: nothing to warn
    assert len(read) == 2  # the pruned one, then the newest
    assert read[1] == chosen.name
    assert "step1" in read[0]
    assert "step2" in chosen.name
    assert one_step(weights) == 2


def test_a_named_checkpoint_removed_while_it_is_read_is_said_so(tmp_path: Path) -> None:
    from ddpctx import distributed
    from ddpctx.checkpoint.files import remove_checkpoint_file
    from ddpctx.checkpoint.weights import read_newest, weights_of

    with distributed(seed=0) as ctx:
        model = ctx.wrap(torch.nn.Linear(4, 4))
        ctx.save_checkpoint(tmp_path, model=model, step=1, keep=1)
    named = next(tmp_path.glob("checkpoint-*.pt"))

    def pruned(chosen: Path) -> dict[str, torch.Tensor]:
        remove_checkpoint_file(chosen)  # as a writer's keep= does
        return weights_of(chosen)[0]

    with pytest.raises(FileNotFoundError, match="was removed while it was read") as raised:
        read_newest(named, pruned)
    assert str(named) in str(raised.value)
    assert "Pass the directory" in str(raised.value)


def overtaking_reader(
    folder: Path, times: int
) -> tuple[Callable[[Path], dict[str, torch.Tensor]], list[str]]:
    """A read that a save with ``keep=1`` overtakes ``times`` times, then one that is left alone."""
    from ddpctx import distributed
    from ddpctx.checkpoint.weights import weights_of

    read: list[str] = []
    with distributed(seed=0) as ctx:
        model = ctx.wrap(small())
        filled(model, 1)
        ctx.save_checkpoint(folder, model=model, step=1, keep=1)

    def overtaken(chosen: Path) -> dict[str, torch.Tensor]:
        read.append(chosen.name)
        if len(read) <= times:
            with distributed(seed=0) as ctx:
                again = ctx.wrap(small())
                filled(again, len(read) + 1)
                ctx.save_checkpoint(folder, model=again, step=len(read) + 1, keep=1)
        return weights_of(chosen)[0]

    return overtaken, read


def test_a_read_overtaken_more_often_than_its_attempts_goes_on_within_its_patience(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A machine busy for a while slows every read past one save (CI: 3 of 240 reads failed
    # after 8 tries): within PATIENCE_S the read starts over however often it is overtaken.
    from ddpctx.checkpoint import choice  # where the reads' patience is set
    from ddpctx.checkpoint.weights import read_newest

    monkeypatch.setattr(choice, "NEXT_SAVE_S", 0.01)  # this writer saves only when read
    overtaken, read = overtaking_reader(tmp_path, choice.ATTEMPTS + 4)
    found = read_newest(tmp_path, overtaken)
    assert found is not None
    assert len(read) == choice.ATTEMPTS + 5
    assert one_step(found[1]) == choice.ATTEMPTS + 5


def test_a_read_overtaken_past_its_patience_says_why_and_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddpctx.checkpoint import choice  # where the reads' patience is set
    from ddpctx.checkpoint.weights import read_newest

    monkeypatch.setattr(choice, "NEXT_SAVE_S", 0.01)
    monkeypatch.setattr(choice, "PATIENCE_S", 0.0)  # no patience past the attempts
    overtaken, read = overtaking_reader(tmp_path, 100)
    with pytest.raises(RuntimeError, match="changed under each of 8 reads") as raised:
        read_newest(tmp_path, overtaken)
    assert len(read) == choice.ATTEMPTS
    assert "larger keep=" in str(raised.value)
