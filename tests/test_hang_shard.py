"""The hang doctor under ctx.shard: FSDP2's collectives are named, with the ranks and lines.

Real torchrun jobs (tests/scripts/hang_fsdp.py); the late rank comes back, so jobs succeed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import REPO, run_python, run_torchrun
from tests.test_hang import HANG_TIMEOUT, line_of, rank_line, report_of

SCRIPT = REPO / "tests" / "scripts" / "hang_fsdp.py"


def fsdp_case(case: str, nproc: int) -> tuple[int, str, str]:
    result = run_torchrun(SCRIPT, case, str(HANG_TIMEOUT), nproc=nproc, timeout=150)
    return result.returncode, result.stdout, result.stderr


def site(marker: str) -> str:
    return line_of(marker, Path(SCRIPT))


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.slow  # a torchrun job and a real hang timeout
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


@pytest.mark.slow  # a torchrun job and a real hang timeout
def test_a_rank_that_skips_the_forward_pass_leaves_the_others_in_fsdp2_all_gather() -> None:
    code, _, err = fsdp_case("forward", 2)
    report = report_of(err)
    assert "not in a collective" in rank_line(report, 1)
    assert site("SKIP-FORWARD") in rank_line(report, 1)
    assert "waiting in FSDP2 all-gather" in rank_line(report, 0)
    assert site("FORWARD") in rank_line(report, 0)
    assert code == 0


@pytest.mark.parametrize(
    ("case", "call"),
    [
        ("full_state_dict", "ctx.full_state_dict()"),
        ("clip", "ctx.clip_grad_norm_()"),
    ],
)
@pytest.mark.slow  # a torchrun job and a real hang timeout
def test_a_rank_waiting_in_a_sharded_models_gather_is_named_in_the_ddpctx_call(
    case: str, call: str
) -> None:
    # Found in use: torch gathers a sharded model's weights (and reduces its gradient norm)
    # through DTensor's functional collectives, which the trackers never saw, so the rank
    # waiting there was reported as "not in any collective".
    code, out, err = fsdp_case(case, 2)
    report = report_of(err)
    skipped = "SKIP-FULL-STATE-DICT" if case == "full_state_dict" else "SKIP-CLIP"
    assert "not in a collective" in rank_line(report, 1)
    assert site(skipped) in rank_line(report, 1)
    assert f"waiting in {call}" in rank_line(report, 0)
    assert site("FULL-STATE-DICT" if case == "full_state_dict" else "CLIP") in rank_line(report, 0)
    assert any(line.startswith("diagnosis: rank 1 is not in any collective") for line in report)
    assert code == 0
    assert "JOB-DONE" in out


LAZY_FSDP = """
import sys
from torch import nn
import ddpctx
from ddpctx import distributed

heavy = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint")
with distributed(hang_timeout=30) as ctx:
    # Before: the hang doctor imported FSDP2 (0.7 s) for every job, sharded or not.
    assert not [name for name in heavy if name in sys.modules], sys.modules.keys() & set(heavy)
    if sys.argv[1] == "shard":
        model = ctx.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)), blocks=[nn.Linear])
    else:  # FSDP2 by hand, imported inside the block
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)), mesh=ctx.mesh)
        model(torch.ones(2, 4)).sum().backward()  # its first all-gather hooks the root
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert hasattr(FSDPState._root_pre_forward, "__wrapped__"), "FSDP2's root is not hooked"
    model(torch.ones(2, 4)).sum().backward()
assert not hasattr(FSDPState._root_pre_forward, "__wrapped__"), "the hook outlived the block"
print("LAZY-OK")
"""


@pytest.mark.parametrize(
    "how",
    ["shard", pytest.param("by-hand", marks=pytest.mark.slow)],  # by hand: a torchrun job
)
def test_fsdp2_is_imported_only_by_sharding_and_its_backward_is_still_tracked(
    how: str, tmp_path: Path
) -> None:
    script = tmp_path / "lazy_fsdp.py"
    script.write_text("import torch\n" + LAZY_FSDP)
    if how == "shard":  # one process: ctx.shard hooks FSDP2 itself
        result = run_python(script, how, timeout=120)
    else:  # FSDP2 all-gathers only at 2+ ranks
        result = run_torchrun(script, how, nproc=2, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LAZY-OK" in result.stdout, result.stderr[-3000:]
