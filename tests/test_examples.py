"""The demo job and the GPU check script run end to end (CPU, gloo)."""

from __future__ import annotations

import re

import pytest

from tests.helpers import REPO, run_python, run_torchrun

# Starts its own processes (torchrun jobs, scripts, notebooks): the full tier only.
pytestmark = pytest.mark.slow


def _train_losses(stdout: str) -> list[float]:
    return [float(value) for value in re.findall(r"train mse ([0-9.]+)", stdout)]


def test_demo_trains_under_torchrun_with_two_ranks() -> None:
    result = run_torchrun(REPO / "examples" / "train.py", "--epochs", "4", nproc=2, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "on 2 rank(s), backend=gloo, device=cpu" in result.stdout
    assert result.stdout.count("done: final train mse") == 1  # rank 0 only
    losses = _train_losses(result.stdout)
    assert len(losses) == 5  # four epochs plus the summary line
    assert losses[-1] < 0.5 * losses[0]


def test_demo_trains_as_a_plain_python_process() -> None:
    result = run_python(REPO / "examples" / "train.py", "--epochs", "2", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "on 1 rank(s)" in result.stdout
    assert "done: final train mse" in result.stdout


def test_gpu_check_script_runs_on_cpu_with_allow_cpu() -> None:
    result = run_torchrun(REPO / "scripts" / "gpu_check.py", "--allow-cpu", nproc=2, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout
    assert "gpu_check passed on 2 rank(s)" in result.stdout


def test_gpu_check_shard_case_runs_on_cpu_with_allow_cpu() -> None:
    result = run_torchrun(
        REPO / "scripts" / "gpu_check.py", "--shard", "--allow-cpu", nproc=2, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout
    assert "sharded checkpoint reloads identical weights" in result.stdout
    assert "gpu_check --shard passed on 2 rank(s)" in result.stdout
