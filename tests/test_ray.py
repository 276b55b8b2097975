"""ddpctx inside Ray Train: one training function, run by a TorchTrainer and by torchrun.

The slow tests start one local Ray cluster for the module (``ray.init`` on
loopback, two CPU workers, no dashboard, no usage statistics) in a child
process (tests/scripts/ray_train_job.py) and compare what each worker saw
with what the same function saw under torchrun. Skipped, saying so, where
Ray is not installed (the ``integrations`` extra has it; ``ray`` alone too).
The quick tests check the detection with a fake ``ray.train``: no Ray needed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ddpctx.utils.raytrain import (
    RayPlace,
    ray_group_mismatch,
    ray_launch,
    ray_train_place,
    ray_without_group,
)
from tests.helpers import REPO, child_env, patience, run_torchrun

SCRIPT = REPO / "tests" / "scripts" / "ray_train_job.py"
#: The killed-worker run doubles the module's time (a second worker group starts):
#: DDPCTX_RAY_KILL=1 adds it. Measured: the run fails naming rank 1, no process left.
WITH_KILL = os.environ.get("DDPCTX_RAY_KILL") == "1"
needs_ray = pytest.mark.integration("ray")


# -- quick: the detection, with a fake ray.train -------------------------------------------


class FakeContext:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def get_world_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.size

    def get_local_rank(self) -> int:
        return self.rank

    def get_local_world_size(self) -> int:
        return self.size

    def get_node_rank(self) -> int:
        return 0


FakeContext.__module__ = "ray.train.v2.api.context"  # Ray Train v2's, the default since 2.5x


def fake_train(context: FakeContext | None) -> SimpleNamespace:
    def get_context() -> FakeContext:
        if context is None:  # what Ray raises in the driver
            raise RuntimeError("`get_context` cannot be used outside of a Ray Train function")
        return context

    return SimpleNamespace(get_context=get_context)


def test_a_ray_train_worker_is_told_by_rays_context() -> None:
    place = ray_train_place({"ray.train": fake_train(FakeContext(1, 2))})
    assert place == RayPlace(
        world_rank=1, world_size=2, local_rank=1, local_world_size=2, node_rank=0
    )
    info = ray_launch({}, place)  # Ray Train v1 sets RANK & co. only as training starts
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == ("ray", 1, 2, 1)


def test_the_driver_and_a_process_without_ray_are_not_workers() -> None:
    assert ray_train_place({"ray.train": fake_train(None)}) is None
    assert ray_train_place({}) is None


class V1Context(FakeContext):
    """Ray Train v1's context class: it answers outside a worker too, with made-up values."""


V1Context.__module__ = "ray.train"  # as Ray 2.60 names it (ray.train.TrainContext)


@pytest.mark.parametrize("session", [None, object()])
def test_a_ray_train_v1_context_counts_only_inside_its_session(session: object) -> None:
    modules = {
        "ray.train": fake_train(V1Context(0, 1)),
        "ray.train._internal.session": SimpleNamespace(get_session=lambda: session),
    }
    assert (ray_train_place(modules) is None) == (session is None)


@pytest.mark.slow
@needs_ray
def test_a_process_that_imports_ray_train_v1_is_no_ray_worker() -> None:
    """Regression: under RAY_TRAIN_V2_ENABLED=0 a plain process read as Ray worker 0 of 1
    (local world size 0), and with torchrun's LOCAL_WORLD_SIZE=1 it was refused."""
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import ray.train\nfrom ddpctx import distributed\n"
        "with distributed() as ctx: print(ctx.launcher, ctx.local_world_size)"
    )
    env = child_env(RAY_TRAIN_V2_ENABLED="0", RAY_USAGE_STATS_ENABLED="0", RANK="0", WORLD_SIZE="1")
    env["LOCAL_WORLD_SIZE"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=patience(90)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["torchrun", "1"]


def test_detection_never_imports_ray() -> None:
    code = (
        "import sys; from ddpctx import distributed\n"
        "with distributed() as ctx: assert ctx.launcher == 'single'\n"
        "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if 'ray' in m)"
    )
    done = subprocess.run([sys.executable, "-c", code], env=child_env(), timeout=patience(60))
    assert done.returncode == 0


@pytest.mark.parametrize(
    "name", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"]
)
def test_a_variable_that_disagrees_with_rays_context_is_named(name: str) -> None:
    place = RayPlace(world_rank=1, world_size=4, local_rank=1, local_world_size=2, node_rank=0)
    with pytest.raises(
        ValueError, match=rf"^{name}='3' but Ray Train's context says .*Unset {name}"
    ):
        ray_launch({name: "3"}, place)


def test_a_group_that_is_not_rays_and_a_worker_without_one_are_refused() -> None:
    place = RayPlace(world_rank=1, world_size=2, local_rank=1, local_world_size=2, node_rank=0)
    assert "rank 0 of 1" in (ray_group_mismatch(place, rank=0, world_size=1) or "")
    assert "TorchTrainer" in ray_without_group(place)


# -- slow: a real local Ray cluster ---------------------------------------------------------


def marked_processes(mark: str) -> list[str]:
    """Live processes that inherited the environment variable ``DDPCTX_RAY_TEST=mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            status = (entry / "status").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if f"DDPCTX_RAY_TEST={mark}".encode() in environ.split(b"\0") and "zombie" not in status:
            found.append(f"{entry.name} {(entry / 'cmdline').read_bytes()[:80]!r}")
    return found


@pytest.fixture(scope="module")
def ray_run() -> Iterator[tuple[Path, str, float]]:
    """One Ray session: (its folder, the driver's output, its seconds); nothing left behind."""
    mark = uuid.uuid4().hex
    # A short root: Ray's unix sockets live under it and must stay under 108 characters.
    root = Path(tempfile.mkdtemp(prefix="ddr", dir="/tmp"))
    # HOME too: ray.init() writes a cluster token to ~/.ray/auth_token, not the tests' to keep.
    env = child_env(DDPCTX_RAY_TEST=mark, RAY_TMPDIR=str(root / "t"), HOME=str(root / "home"))
    started = time.monotonic()
    mode = "ray+kill" if WITH_KILL else "ray"
    driver = subprocess.Popen(
        [sys.executable, str(SCRIPT), mode, str(root / "out")],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = driver.communicate(timeout=patience(240))
    except subprocess.TimeoutExpired:
        os.killpg(driver.pid, signal.SIGKILL)
        output, _ = driver.communicate()
        pytest.fail(f"the Ray job did not end within its bound:\n{output[-4000:]}")
    seconds = time.monotonic() - started
    try:
        assert driver.returncode == 0, output[-4000:]
        yield root / "out", output, seconds
    finally:
        deadline = time.monotonic() + patience(20)
        while marked_processes(mark) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = marked_processes(mark)
        for line in left:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"Ray left processes behind: {left}"


@pytest.fixture(scope="module")
def torchrun_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("torchrun")
    done = run_torchrun(SCRIPT, "torchrun", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    return out, done.stderr


def seen(folder: Path) -> list[dict[str, Any]]:
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
@needs_ray
def test_a_torchtrainer_worker_adopts_rays_group_and_leaves_it(
    ray_run: tuple[Path, str, float],
) -> None:
    folder = ray_run[0]
    ranks = seen(folder / "run")
    for rank, state in enumerate(ranks):
        assert (state["rank"], state["world_size"], state["launcher"]) == (rank, 2, "ray")
        assert (state["local_rank"], state["local_world_size"], state["node_rank"]) == (rank, 2, 0)
        assert state["seed"] == 7 + rank
        assert state["total"] == 3  # ctx.all_reduce over Ray's group: 1 + 2
        assert state["group_after_block"]  # left alive: a collective after the block works
        assert state["after_block_sum"] == 2.0
        assert (state["second_launcher"], state["second_seed"], state["second_total"]) == (
            "ray",
            None,
            2,
        )
    assert sorted(ranks[0]["shard"] + ranks[1]["shard"]) == list(range(10))  # disjoint, whole
    assert "FIT OK" in (folder / "run" / "outcome.txt").read_text()


@pytest.mark.slow
@needs_ray
def test_the_same_function_under_torchrun_sees_the_same_run(
    ray_run: tuple[Path, str, float], torchrun_run: tuple[Path, str]
) -> None:
    """Differential: seeds, shards, reductions, checkpoints and logs as under torchrun."""
    under_ray, under_torchrun = seen(ray_run[0] / "run"), seen(torchrun_run[0])
    same = ("draws", "shard", "total", "weights", "logged", "resumed_meta", "resumed_weights")
    for ray_state, torchrun_state in zip(under_ray, under_torchrun, strict=True):
        assert torchrun_state["launcher"] == "torchrun"
        assert {k: ray_state[k] for k in same} == {k: torchrun_state[k] for k in same}
        assert ray_state["resumed_weights"] == under_ray[0]["weights"]  # rank 0's, loaded
    lines = (ray_run[0] / "run" / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 0, "loss": 0.5}]  # rank 0, once


@pytest.mark.slow
@needs_ray
def test_the_launching_guides_training_function_runs_under_ray(
    ray_run: tuple[Path, str, float],
) -> None:
    guide = ray_run[0] / "run" / "guide"
    lines = (guide / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    names = sorted(path.name for path in (guide / "checkpoints").glob("*.pt"))
    assert names == ["checkpoint-000001-epoch0.pt", "checkpoint-000002-epoch1.pt"]


@pytest.mark.slow
@needs_ray
def test_the_hang_doctor_watches_rays_training_thread(
    ray_run: tuple[Path, str, float], torchrun_run: tuple[Path, str]
) -> None:
    """Ray runs the function off the main thread; the report still names rank 1's line."""
    line = next(
        number for number, text in enumerate(SCRIPT.read_text().splitlines(), 1) if "# LATE" in text
    )
    for output in (ray_run[1], torchrun_run[1]):
        assert "ddpctx hang report" in output, output[-4000:]
        assert re.search(rf"rank 1: not in a collective +at \S*ray_train_job.py:{line} ", output)


@pytest.mark.slow
@needs_ray
def test_a_checkpoint_reported_to_ray_loads_with_ddpctx(
    ray_run: tuple[Path, str, float],
) -> None:
    folder = ray_run[0] / "run"
    reported = json.loads((folder / "reported.json").read_text())
    assert reported["launcher"] == "single"  # the driver is no Ray Train worker
    assert reported["meta"] == {"epoch": 0}
    assert reported["weights"] == seen(folder)[0]["weights"]
    assert str(folder / "ray") in reported["path"]  # Ray's copy, not ddpctx's directory


@pytest.mark.slow
@needs_ray
@pytest.mark.skipif(not WITH_KILL, reason="a second Ray run (~25 s): DDPCTX_RAY_KILL=1 adds it")
def test_a_worker_killed_in_its_block_fails_the_run_without_a_hang(
    ray_run: tuple[Path, str, float],
) -> None:
    folder, _, seconds = ray_run
    outcome = (folder / "kill" / "outcome.txt").read_text()
    assert outcome.startswith("FIT FAILED"), outcome
    assert "Rank 1" in outcome, outcome
    assert not (folder / "kill" / "rank0.json").exists()  # Ray stopped the survivor too
    assert seconds < patience(120)  # with the first run: no wait for a collective timeout
