"""Stress the pytest plugin's group formation: many trivial 2-rank tests under CPU load.

Run:  python benchmarks/stress_plugin.py [--tests 5000] [--budget 600] [--burners 1]

Writes a test file holding ``--tests`` trivial tests marked
``@pytest.mark.distributed(world_size=2)`` whose bodies call no collective --
the case where one rank used to tear its group down while its peer was still
connecting -- and runs it in pytest sessions of ``--chunk`` tests each while
``--burners`` processes keep the CPUs busy. Stops starting new sessions once
``--budget`` seconds have passed, so the count actually run is reported, not
assumed. ``--launch N`` also times ``N`` calls of ``launch(lambda: None)``.

Prints: tests run, failed, how many of the failures were gloo's
``connectFullMesh failed ... Connection closed by peer``, and how many tests
needed a formation retry (ddpctx logs one line per retried formation).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

TEST_FILE = """
import pytest

@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("index", range({count}))
def test_trivial(index):
    pass
"""


def burn() -> None:
    """Keep one CPU busy until killed."""
    value = 0
    while True:
        value = (value * 31 + 7) % 1000003


def run_chunk(directory: Path, count: int) -> tuple[int, int, int, int, str]:
    """One pytest session of ``count`` tests: (passed, failed, mesh failures, retries, excerpt)."""
    path = directory / "test_stress.py"
    path.write_text(textwrap.dedent(TEST_FILE.format(count=count)))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", "-rfEP"],
        capture_output=True,
        text=True,
        cwd=directory,
        env={**os.environ, "COLUMNS": "1000"},  # summary lines long enough to hold the error
        timeout=max(600, count * 2),
    )
    out = result.stdout + result.stderr
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", out)) else 0
    failed = int(m.group(1)) if (m := re.search(r"(\d+) failed", out)) else 0
    errors = int(m.group(1)) if (m := re.search(r"(\d+) errors?\b", out)) else 0
    mesh = len(re.findall(r"FAILED .*connectFullMesh failed", out))
    retries = out.count("retrying the group formation")
    excerpt = "\n".join(line for line in out.splitlines() if line.startswith("FAILED"))[:2000]
    return passed, failed + errors, mesh, retries, excerpt


def time_launch(calls: int) -> tuple[int, int]:
    """``calls`` launches of a trivial function: (run, failed).

    torch is imported first, as in a training script: otherwise every rank
    imports it after the fork, and that import is what gets timed.
    """
    import torch  # noqa: F401

    from ddpctx import RankError, launch

    failed = 0
    for _ in range(calls):
        try:
            launch(lambda: None, world_size=2, timeout=60)
        except RankError as error:  # a formation retry shows as one line on stderr
            failed += 1
            print(f"launch failed: {str(error).splitlines()[0][:200]}", file=sys.stderr)
    return calls, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=5000, help="trivial tests to run at most")
    parser.add_argument("--chunk", type=int, default=250, help="tests per pytest session")
    parser.add_argument("--budget", type=float, default=600, help="seconds; no new chunk after")
    parser.add_argument("--burners", type=int, default=1, help="CPU-bound processes meanwhile")
    parser.add_argument("--launch", type=int, default=0, help="also run launch() this many times")
    options = parser.parse_args()

    context = multiprocessing.get_context("spawn")
    burners = [context.Process(target=burn, daemon=True) for _ in range(options.burners)]
    for process in burners:
        process.start()
    started = time.monotonic()
    totals = [0, 0, 0, 0]
    try:
        with tempfile.TemporaryDirectory(prefix="ddpctx-stress-") as folder:
            while totals[0] + totals[1] < options.tests:
                if time.monotonic() - started > options.budget:
                    break
                count = min(options.chunk, options.tests - totals[0] - totals[1])
                *numbers, excerpt = run_chunk(Path(folder), count)
                totals = [a + b for a, b in zip(totals, numbers, strict=True)]
                if excerpt:
                    print(excerpt, file=sys.stderr)
                print(
                    f"  {totals[0] + totals[1]} run, {totals[1]} failed, {totals[3]} retries "
                    f"({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
            launched = time_launch(options.launch) if options.launch else (0, 0)
    finally:
        for process in burners:
            process.kill()
    passed, failed, mesh, retries = totals
    print(
        f"plugin: {passed + failed} trivial 2-rank tests, {failed} failed "
        f"({mesh} with connectFullMesh), {retries} formation retries, "
        f"{options.burners} CPU burner(s), {time.monotonic() - started:.0f} s, "
        f"{os.cpu_count()} CPUs"
    )
    if options.launch:
        print(f"launch(): {launched[0]} calls, {launched[1]} failed")


if __name__ == "__main__":
    main()
