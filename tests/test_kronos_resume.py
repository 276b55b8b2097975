"""A Kronos-style dataset (its own ``random.Random``, reseeded per epoch, index ignored) killed
mid-epoch under ``torchrun --max-restarts=1`` resumes to bit-identical weights.

The design choice (ddpctx.data.generators): ddpctx *names* a private generator at
``ctx.dataloader`` (a warning on rank 0 with the attribute path and the fix) rather than
handling it, because it cannot tell a generator meant to advance from one meant to stay
fixed, and re-seeding it would override the user's own ``set_epoch_seed``. So the dataset
here carries the documented one-line fix (``random.randint`` for ``self.py_rng.randint``);
the unchanged dataset is what the warning is about (tests/test_loader_book.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, child_env, torchrun_command

SCRIPT = REPO / "tests" / "scripts" / "kronos_resume.py"
KILL_AFTER = 9  # 6 steps per epoch at 2 ranks: the third batch of epoch 1, just saved


def torchrun(
    out: Path, workers: int, *more: str, restarts: int = 0, draw: str = "global", nproc: int = 2
) -> list[dict[str, Any]]:
    """Run the script at 2 ranks (the fixed dataset by default); every rank's record."""
    return torchrun_run(out, workers, *more, restarts=restarts, draw=draw, nproc=nproc)[0]


def torchrun_run(
    out: Path,
    workers: int,
    *more: str,
    restarts: int = 0,
    draw: str = "global",
    nproc: int = 2,
) -> tuple[list[dict[str, Any]], str]:
    """Every rank's record and the job's stderr."""
    out.mkdir()
    command = torchrun_command(
        SCRIPT,
        str(out),
        "--draw",
        draw,
        "--workers",
        str(workers),
        *more,
        nproc=nproc,
        launcher_args=("--standalone", f"--max-restarts={restarts}"),
    )
    result = subprocess.run(
        command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]
    return records, result.stderr


@pytest.mark.slow
# With loader workers only: without them a SIGKILLed run resumes bit-identically in the
# 3-rank test below, the equivalence matrix and the demo's tests.
@pytest.mark.parametrize("workers", [2], ids=["2-workers"])
def test_a_kronos_style_dataset_resumes_bit_identically_after_sigkill(
    tmp_path: Path, workers: int
) -> None:
    whole = torchrun(tmp_path / "whole", workers)
    killed = torchrun(tmp_path / "killed", workers, "--kill-after", str(KILL_AFTER), restarts=1)
    for rank in range(2):
        assert killed[rank]["restart_count"] == 1  # it really was killed and restarted
        assert killed[rank]["resumed_at"] == KILL_AFTER
        assert killed[rank]["trace"] == whole[rank]["trace"][KILL_AFTER:]
        assert killed[rank]["sha256"] == whole[rank]["sha256"]
    # Not duplicated across workers (nor ranks): every window of an epoch is drawn anew.
    for epoch in range(3):
        windows = [
            start
            for record in whole
            for step_epoch, _, starts in record["trace"]
            if step_epoch == epoch
            for start in starts
        ]
        assert len(windows) == 48
        assert len(set(windows)) > 40, f"epoch {epoch} drew {len(set(windows))} distinct windows"


@pytest.mark.slow
def test_a_private_generator_saved_through_rank_state_resumes_exactly_when_not_reseeded_mid_epoch(
    tmp_path: Path,
) -> None:
    # The documented fix for a dataset that keeps self.py_rng: rank_state={'rng': ...} and the
    # per-epoch reseed only in an epoch that starts from its first batch (loader.start == 0).
    whole = torchrun(tmp_path / "whole", 0, draw="rank-state")
    killed, stderr = torchrun_run(
        tmp_path / "killed", 0, "--kill-after", str(KILL_AFTER), restarts=1, draw="rank-state"
    )
    assert "ReseededGeneratorWarning" not in stderr
    for rank in range(2):
        assert killed[rank]["restart_count"] == 1
        assert killed[rank]["trace"] == whole[rank]["trace"][KILL_AFTER:]
        assert killed[rank]["sha256"] == whole[rank]["sha256"]


@pytest.mark.slow
def test_a_generator_restored_through_rank_state_then_reseeded_is_named_in_a_warning(
    tmp_path: Path,
) -> None:
    # Kronos' set_epoch_seed in the resumed epoch undoes load_checkpoint's restore: the resume
    # is not exact, and the warning names the generator and the fix.
    whole = torchrun(tmp_path / "whole", 0, draw="rank-state-reseeded")
    killed, stderr = torchrun_run(
        tmp_path / "killed",
        0,
        "--kill-after",
        str(KILL_AFTER),
        restarts=1,
        draw="rank-state-reseeded",
    )
    assert killed[0]["sha256"] != whole[0]["sha256"]  # what the warning is about
    assert "ReseededGeneratorWarning" in stderr
    assert "rank_state['rng'] (a random.Random)" in stderr
    assert "if loader.start == 0: dataset.set_epoch_seed(epoch)" in " ".join(stderr.split())


@pytest.mark.slow
def test_a_3_rank_kronos_style_run_resumes_bit_identically_after_sigkill_with_default_ddp(
    tmp_path: Path,
) -> None:
    # From 3 ranks DDP's bucket layout sets the last bits of the reduced gradients, and DDP
    # rebuilds its buckets after the first iteration; the checkpoint carries the rebuilt layout
    # to the restarted ranks (find_unused_parameters is not needed). 4 steps per epoch: step 9
    # is the first batch of epoch 2, just saved.
    whole = torchrun(tmp_path / "whole", 0, nproc=3)
    killed = torchrun(tmp_path / "killed", 0, "--kill-after", "9", restarts=1, nproc=3)
    for rank in range(3):
        assert killed[rank]["restart_count"] == 1
        assert killed[rank]["resumed_at"] == 9
        assert killed[rank]["trace"] == whole[rank]["trace"][9:]
        assert killed[rank]["sha256"] == whole[rank]["sha256"]
