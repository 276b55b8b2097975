"""The demo job: it learns, it is deterministic, and it survives a killed rank exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, child_env, child_pids, run_torchrun, start_torchrun

SCRIPT = REPO / "examples" / "train_forecaster.py"
EPOCHS = "6"


def summary(out: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return loaded


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("uninterrupted")
    result = run_torchrun(SCRIPT, "--epochs", EPOCHS, "--seed", "3", "--out", str(out), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return summary(out)


def test_the_demo_learns_well_past_the_no_change_baseline(uninterrupted: dict[str, Any]) -> None:
    assert uninterrupted["best_val_loss"] < 0.9 * uninterrupted["baseline_val_loss"]
    assert uninterrupted["epochs_completed"] == 6
    assert uninterrupted["world_size"] == 2
    assert uninterrupted["wall_time_s"] < 60


def test_the_same_seed_gives_the_same_weights(
    uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    result = run_torchrun(
        SCRIPT, "--epochs", EPOCHS, "--seed", "3", "--out", str(tmp_path), timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(tmp_path)["model_sha256"] == uninterrupted["model_sha256"]


@pytest.mark.slow
def test_a_rank_killed_mid_run_resumes_to_the_same_weights(
    uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    job = start_torchrun(
        SCRIPT,
        "--epochs",
        EPOCHS,
        "--seed",
        "3",
        "--out",
        str(tmp_path),
        launcher_args=("--standalone", "--max-restarts=1"),
    )
    try:
        deadline = time.monotonic() + 90
        checkpoints = tmp_path / "checkpoints"
        while time.monotonic() < deadline:
            names = (
                [p.name for p in checkpoints.glob("checkpoint-*.pt")]
                if checkpoints.exists()
                else []
            )
            if any(name >= "checkpoint-000002.pt" for name in names):
                break
            time.sleep(0.02)
        victims = child_pids(job.pid)
        assert victims, "no worker processes found under torchrun"
        killed_after = sorted(names)[-1]
        os.kill(max(victims), signal.SIGKILL)
        stdout, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert killed_after < f"checkpoint-{int(EPOCHS):06d}.pt", "the job finished before the kill"
    assert "resuming from epoch" in stdout
    resumed = summary(tmp_path)
    assert resumed["resumed_from_epoch"] is not None
    assert resumed["model_sha256"] == uninterrupted["model_sha256"]


def test_the_demo_runs_as_one_plain_python_process(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--epochs", "1", "--out", str(tmp_path)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(tmp_path)["world_size"] == 1
    assert "1 rank(s)" in result.stdout
