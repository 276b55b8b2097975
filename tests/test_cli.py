"""`python -m ddpctx env` and `python -m ddpctx check`, run as a user would."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from ddpctx.cli import _merge
from tests.helpers import REPO, child_env


def ddpctx(*args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpctx", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(**extra_env),
        cwd=REPO,
    )


def test_env_reports_a_single_process_here_as_json() -> None:
    result = ddpctx("env", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["launcher"], report["world_size"], report["backend"], report["device"]) == (
        "single",
        1,
        "gloo",
        "cpu",
    )
    assert report["torch"].startswith("2.")
    assert report["gloo_available"] is True
    assert report["problem"] is None


def test_env_reads_the_launchers_variables() -> None:
    result = ddpctx(
        "env",
        RANK="3",
        WORLD_SIZE="4",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="10.1.2.3",
        MASTER_PORT="29500",
        NCCL_DEBUG="INFO",
    )
    assert result.returncode == 0, result.stderr
    for line in (
        "launcher          torchrun",
        "rank              3",
        "node_rank         1",
        "master            10.1.2.3:29500",
        "  NCCL_DEBUG=INFO",
    ):
        assert line in result.stdout


def test_env_names_a_bad_variable_and_exits_non_zero() -> None:
    result = ddpctx("env", RANK="0")
    assert result.returncode == 1
    assert re.search(r"problem +ValueError: RANK='0' is set but WORLD_SIZE is not", result.stdout)


def test_the_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "ddpctx"
    result = subprocess.run(
        [str(script), "env"], capture_output=True, text=True, timeout=120, env=child_env()
    )
    assert result.returncode == 0, result.stderr
    assert "launcher" in result.stdout


def test_check_verifies_every_collective_on_local_ranks() -> None:
    result = ddpctx("check", "--world-size", "2", "--sizes", "64,4096")
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout
    assert "ddpctx check: 2 ranks, backend gloo" in table
    for name in (
        "all_reduce",
        "broadcast",
        "all_gather",
        "barrier",
        "object collectives",
        "@all_reduced (weighted)",
    ):
        assert any(line.startswith(name) and line.endswith("ok") for line in table.splitlines()), (
            name
        )
    assert "16384" in table  # 4096 float32 elements
    assert "FAILED" not in table


def test_check_inside_a_torchrun_job_uses_the_jobs_ranks() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "ddpctx",
            "check",
            "--sizes",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ddpctx check: 2 ranks, backend gloo") == 1  # rank 0 prints


def test_a_failure_on_any_rank_fails_that_collective_and_names_the_rank() -> None:
    ok = {"collective": "all_reduce", "bytes": 4, "ok": True, "latency_ms": 0.1}
    bad = {"collective": "all_reduce", "bytes": 4, "ok": False, "error": "RuntimeError: boom"}
    merged = _merge([[ok], [bad]])
    assert merged[0]["ok"] is False
    assert merged[0]["failures"] == ["rank 1: RuntimeError: boom"]


def test_bad_sizes_are_refused() -> None:
    result = ddpctx("check", "--sizes", "abc")
    assert result.returncode == 2
    assert "--sizes 'abc': give element counts separated by commas" in result.stderr
