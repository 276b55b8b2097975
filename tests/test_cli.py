"""`python -m ddpctx env` and `python -m ddpctx check`, run as a user would."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpctx import __version__
from ddpctx.cli import describe_environment, interface_problems, main, merge
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


@dataclass
class Outcome:
    """What ``main(args)`` returned (or exited with) and printed, like a finished process."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., Outcome]:
    """``in_process(*args, **env)``: the CLI's ``main`` in this process, as :func:`ddpctx` runs it.

    Commands that need no process of their own run here, without a torch import of
    their own each (2-3 s); the console script and ``python -m ddpctx`` are run as
    processes by the tests that name them.
    """

    def run(*args: str, **extra_env: str) -> Outcome:
        for name, value in extra_env.items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        out, err = capsys.readouterr()
        return Outcome(code, out, err)

    return run


def ddpctx_under_torchrun(*args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node=2 -m ddpctx args``, bounded in time."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "--monitor-interval=0.2",
            "-m",
            "ddpctx",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=child_env(**extra_env),
        cwd=REPO,
    )


def table_row(table: str, name: str, elements: str) -> list[str]:
    """The cells of the ``check`` table's row for ``name`` at ``elements``."""
    for line in table.splitlines():
        cells = line.split()
        if line.startswith(name) and cells[len(name.split())] == elements:
            return cells[len(name.split()) :]
    raise AssertionError(f"no row {name} {elements} in:\n{table}")


def test_help_is_plain_text_with_the_commands_and_examples() -> None:
    result = ddpctx("--help")
    assert result.returncode == 0, result.stderr
    assert "``" not in result.stdout  # no reStructuredText markup leaking from docstrings
    for text in ("env ", "check ", "--version", "examples:", "torchrun --nproc_per_node=8"):
        assert text in result.stdout, text


def test_check_help_shows_the_defaults_and_the_unit() -> None:
    result = ddpctx("check", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "(default: 2)" in text
    assert (
        "float32 elements (4 bytes each), separated by commas (default: 256,65536,1048576)" in text
    )


def test_version_prints_the_package_version(in_process: Callable[..., Outcome]) -> None:
    result = in_process("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"ddpctx {__version__}"


def test_env_reports_a_single_process_here_as_json(in_process: Callable[..., Outcome]) -> None:
    result = in_process("env", "--json")
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


def test_env_reads_the_launchers_variables(in_process: Callable[..., Outcome]) -> None:
    result = in_process(
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


def test_env_names_a_bad_variable_and_exits_non_zero(in_process: Callable[..., Outcome]) -> None:
    result = in_process("env", RANK="0")
    assert result.returncode == 1
    assert re.search(r"problem +ValueError: RANK='0' is set but WORLD_SIZE is not", result.stdout)


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("DDPCTX_TIMEOUT", "soon", "DDPCTX_TIMEOUT='soon'"),
        ("DDPCTX_HANG_TIMEOUT", "-4", "DDPCTX_HANG_TIMEOUT='-4'"),
        ("DDPCTX_DEBUG", "bogus", "DDPCTX_DEBUG='bogus' is not a debug mode"),
    ],
)
def test_env_reports_a_bad_ddpctx_option_and_exits_non_zero(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    variable: str,
    value: str,
    expected: str,
) -> None:
    # Before: "problem None" and exit 0 for values that distributed() refuses.
    monkeypatch.setenv(variable, value)
    assert main(["env"]) == 1
    assert re.search(
        r"^problem +ValueError: .*" + re.escape(expected), capsys.readouterr().out, re.M
    )


def test_env_names_every_bad_option_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable, value in {
        "DDPCTX_TIMEOUT": "soon",
        "DDPCTX_HANG_TIMEOUT": "-4",
        "DDPCTX_DEBUG": "bogus",
    }.items():
        monkeypatch.setenv(variable, value)
    problem = describe_environment()["problem"]
    for named in ("DDPCTX_TIMEOUT='soon'", "DDPCTX_HANG_TIMEOUT='-4'", "DDPCTX_DEBUG='bogus'"):
        assert named in problem


def test_check_refuses_a_message_too_large_in_one_line(in_process: Callable[..., Outcome]) -> None:
    # Before: a 35-line traceback from the ranks' allocation.
    result = in_process("check", "--sizes", "99999999999")
    assert result.returncode == 2
    errors = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert errors[-1] == (
        "ddpctx check: error: argument --sizes: --sizes '99999999999': 99999999999 elements is "
        "more than the largest message checked, 268435456 float32 elements (1 GiB); give sizes "
        "up to that, e.g. 1024,262144"
    )


@pytest.mark.slow
def test_the_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "ddpctx"
    result = subprocess.run(
        [str(script), "env"], capture_output=True, text=True, timeout=120, env=child_env()
    )
    assert result.returncode == 0, result.stderr
    assert "launcher" in result.stdout


@pytest.mark.slow
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
    assert table.splitlines()[1].split()[:3] == ["collective", "elements", "bytes"]
    assert table_row(table, "all_reduce", "4096")[:2] == ["4096", "16384"]  # elements, bytes
    assert table_row(table, "broadcast", "64")[:2] == ["64", "256"]
    assert "FAILED" not in table


@pytest.mark.slow
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
    merged = merge([[ok], [bad]])
    assert merged[0]["ok"] is False
    assert merged[0]["failures"] == ["rank 1: RuntimeError: boom"]


def test_bad_sizes_are_refused() -> None:
    result = ddpctx("check", "--sizes", "abc")
    assert result.returncode == 2
    assert "--sizes 'abc': give float32 element counts separated by commas" in result.stderr


def test_a_world_size_no_machine_can_hold_is_refused_in_one_line() -> None:
    # Before: `check --world-size 100000` forked until the machine swapped to a halt.
    result = ddpctx("check", "--world-size", "100000")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--world-size 100000: more ranks than this machine can hold" in result.stderr


@given(
    interfaces=st.lists(
        st.text("abcdefghij0123456789", min_size=1, max_size=6), min_size=1, unique=True
    ),
    data=st.data(),
)
def test_an_ifname_list_of_existing_interfaces_has_no_problem(
    interfaces: list[str], data: st.DataObject
) -> None:
    chosen = data.draw(st.lists(st.sampled_from(interfaces), min_size=1))
    assert interface_problems(",".join(chosen), interfaces) == []


@given(
    interfaces=st.lists(st.text("abcdefghij0123456789", min_size=1, max_size=6), unique=True),
    missing=st.text("klmnopq", min_size=1, max_size=6),
)
def test_an_ifname_naming_a_missing_interface_is_a_problem_naming_it(
    interfaces: list[str], missing: str
) -> None:
    value = ",".join([*interfaces[:1], missing])
    (problem,) = interface_problems(value, interfaces)
    assert problem.startswith(f"GLOO_SOCKET_IFNAME={value!r}: no network interface {missing!r}")
    assert "or unset it" in problem


@pytest.mark.slow
def test_a_bad_gloo_ifname_is_a_failed_check_naming_it() -> None:
    result = ddpctx("check", "--sizes", "8", GLOO_SOCKET_IFNAME="nosuch0")
    assert result.returncode == 1
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("GLOO_SOCKET_IFNAME")]
    assert "FAILED: GLOO_SOCKET_IFNAME='nosuch0': no network interface 'nosuch0'" in row
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_good_gloo_ifname_is_a_passing_check() -> None:
    result = ddpctx("check", "--sizes", "8", GLOO_SOCKET_IFNAME="lo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert table_row(result.stdout, "GLOO_SOCKET_IFNAME", "-")[-1] == "ok"


@pytest.mark.slow
def test_a_bad_gloo_ifname_under_torchrun_is_reported_once_without_a_raw_traceback() -> None:
    result = ddpctx_under_torchrun("check", "--sizes", "8", GLOO_SOCKET_IFNAME="nosuch0")
    assert result.returncode != 0
    assert result.stdout.count("FAILED: GLOO_SOCKET_IFNAME='nosuch0'") == 1  # local rank 0
    assert "enforce fail" not in result.stderr  # gloo's own error never reached
    # torchrun's summary names the problem as the root cause, not `error_file: <N/A>`
    assert "traceback : ValueError: GLOO_SOCKET_IFNAME='nosuch0'" in result.stderr


@pytest.mark.slow
def test_env_under_torchrun_heads_each_block_with_its_rank() -> None:
    result = ddpctx_under_torchrun("env")
    assert result.returncode == 0, result.stderr[-3000:]
    blocks = result.stdout.split("== rank ")[1:]
    assert sorted(block[:6] for block in blocks) == ["0 of 2", "1 of 2"]
    for block in blocks:
        rank = block.split()[0]
        assert re.search(rf"^rank +{rank}$", block, re.MULTILINE), block
        assert re.search(rf"^local_rank +{rank}$", block, re.MULTILINE), block


@pytest.mark.slow
def test_env_json_under_torchrun_is_one_document_per_rank_per_line() -> None:
    result = ddpctx_under_torchrun("env", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(report["rank"] for report in reports) == [0, 1]
