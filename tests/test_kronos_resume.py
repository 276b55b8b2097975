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


def torchrun(out: Path, workers: int, *more: str, restarts: int = 0) -> list[dict[str, Any]]:
    """Run the script at 2 ranks with the fixed dataset; every rank's record."""
    out.mkdir()
    command = torchrun_command(
        SCRIPT,
        str(out),
        "--draw",
        "global",
        "--workers",
        str(workers),
        *more,
        launcher_args=("--standalone", f"--max-restarts={restarts}"),
    )
    result = subprocess.run(
        command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2], ids=["no-workers", "2-workers"])
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
