"""Which rank gets the blame: repeated runs of failures whose follow-on errors race the cause.

Three scenarios, each run N times, counting how often the report names the
rank that really failed:

- ``launch()``, rank 1's ``@all_reduced`` function raises (rank 0 then gets
  a follow-on ``ReductionError``);
- ``launch()``, rank 0 fails inside ``@rank_zero_only(barrier=True)`` (the
  others get ``RankZeroError``);
- torchrun, rank 1's ``@all_reduced`` function raises: torchrun's "Root
  Cause" must name rank 1.

Usage: ``python benchmarks/blame.py [--runs 50] [--torchrun-runs 20]``.
Prints one line per scenario: ``named the failing rank in K of N runs``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

if not __package__:  # run as a file: the repository, not benchmarks/, heads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.processes import REPO, torchrun
from ddpctx import RankError, all_reduced, current, launch, rank_zero_only


def reduce_fails_on_rank_one() -> None:
    @all_reduced
    def evaluate() -> float:
        if current().rank == 1:  # type: ignore[union-attr]
            raise ValueError("bad batch on rank 1")
        return 1.0

    evaluate()


def save_fails_on_rank_zero() -> None:
    @rank_zero_only(barrier=True)
    def save() -> None:
        raise OSError("disk full on rank 0")

    save()


def blamed(fn: object, world_size: int) -> int | None:
    try:
        launch(fn, world_size=world_size, timeout=60)  # type: ignore[arg-type]
    except RankError as error:
        return error.rank
    return None


TORCHRUN_SCRIPT = textwrap.dedent(
    """
    from ddpctx import all_reduced, distributed

    with distributed() as ctx:
        @all_reduced
        def evaluate():
            if ctx.rank == 1:
                raise ValueError("bad batch on rank 1")
            return 1.0

        evaluate()
    """
)


def torchrun_blamed(script: Path) -> int | None:
    result = subprocess.run(
        torchrun(2, "--monitor-interval=0.2", script),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    root = result.stderr.split("Root Cause", 1)[-1]
    found = re.search(r"rank\s*:\s*(\d+)", root)
    return int(found.group(1)) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--torchrun-runs", type=int, default=20)
    args = parser.parse_args()
    for name, fn, expected in (
        ("launch(): rank 1's @all_reduced raises", reduce_fails_on_rank_one, 1),
        ("launch(): rank 0's @rank_zero_only(barrier=True) raises", save_fails_on_rank_zero, 0),
    ):
        named = [blamed(fn, 2) for _ in range(args.runs)]
        hits = sum(rank == expected for rank in named)
        print(f"{name}: named rank {expected} in {hits} of {args.runs} runs", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "fail.py"
        script.write_text(TORCHRUN_SCRIPT)
        named = [torchrun_blamed(script) for _ in range(args.torchrun_runs)]
    hits = sum(rank == 1 for rank in named)
    print(
        f"torchrun: rank 1's @all_reduced raises: root cause names rank 1 in {hits} of "
        f"{args.torchrun_runs} runs (others: {[r for r in named if r != 1]})",
        flush=True,
    )


if __name__ == "__main__":
    main()
