"""The hang doctor under ctx.shard: FSDP2's collectives are named, with the ranks and lines.

Real torchrun jobs (tests/scripts/hang_fsdp.py); the late rank comes back, so jobs succeed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import REPO, run_torchrun
from tests.test_hang import HANG_TIMEOUT, line_of, rank_line, report_of

SCRIPT = REPO / "tests" / "scripts" / "hang_fsdp.py"


def fsdp_case(case: str, nproc: int) -> tuple[int, str, str]:
    result = run_torchrun(SCRIPT, case, str(HANG_TIMEOUT), nproc=nproc, timeout=150)
    return result.returncode, result.stdout, result.stderr


def site(marker: str) -> str:
    return line_of(marker, Path(SCRIPT))


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_rank_that_skips_backward_under_shard_is_named_the_others_wait_in_fsdp2(
    nproc: int,
) -> None:
    code, out, err = fsdp_case("backward", nproc)
    report = report_of(err)
    assert "not in a collective" in rank_line(report, 1)
    assert site("SKIP-BACKWARD") in rank_line(report, 1)
    for rank in {0, 2} & set(range(nproc)):
        line = rank_line(report, rank)
        assert "waiting in FSDP2 backward (all-gather / reduce-scatter)" in line
        assert site("BACKWARD") in line
    assert any(line.startswith("diagnosis: rank 1 is not in any collective") for line in report)
    assert code == 0
    assert "JOB-DONE" in out


def test_a_rank_that_skips_the_forward_pass_leaves_the_others_in_fsdp2_all_gather() -> None:
    code, _, err = fsdp_case("forward", 2)
    report = report_of(err)
    assert "not in a collective" in rank_line(report, 1)
    assert site("SKIP-FORWARD") in rank_line(report, 1)
    assert "waiting in FSDP2 all-gather" in rank_line(report, 0)
    assert site("FORWARD") in rank_line(report, 0)
    assert code == 0
