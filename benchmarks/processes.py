"""Starting the benchmarks' other processes: torchrun jobs, benchmark scripts, fresh interpreters.

Contract: every command runs with this interpreter (``sys.executable``); a job
or script that fails raises ``subprocess.CalledProcessError`` (or
``TimeoutExpired``), never a silent empty result. Children that must import
this checkout get :func:`repo_env` (``PYTHONPATH`` set to the repository).
A whole-job benchmark's rank 0 prints its median step with
:func:`print_median_step` and the parent reads it back with :func:`median_step`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

#: This folder (the ``benchmarks`` package) and the repository that holds it.
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
#: The line a whole-job benchmark's rank 0 prints its median step seconds on.
MEDIAN_STEP = "MEDIAN-STEP "


def repo_env(**extra: str) -> dict[str, str]:
    """This process's environment, with this checkout first on ``PYTHONPATH`` and ``extra`` set."""
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def torchrun(nproc: int, *args: object) -> list[str]:
    """The command of a standalone torchrun job of ``nproc`` local ranks running ``args``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*command, f"--nproc_per_node={nproc}", *map(str, args)]


def script(name: str, *args: object, timeout: float = 600) -> str:
    """What ``benchmarks/<name> <args>`` prints, run with this interpreter."""
    command = [sys.executable, str(HERE / name), *map(str, args)]
    return subprocess.run(
        command, capture_output=True, text=True, env=repo_env(), check=True, timeout=timeout
    ).stdout.strip()


def fresh_interpreter_seconds(code: str, rounds: int) -> list[float]:
    """Wall seconds of ``python -c code`` in a new interpreter, ``rounds`` times."""
    runs = []
    for _ in range(rounds):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=repo_env())
        runs.append(time.perf_counter() - started)
    return runs


def print_median_step(median: float) -> None:
    """Rank 0's report of a whole job: the median step's seconds, read by :func:`median_step`."""
    print(f"{MEDIAN_STEP}{median!r}", flush=True)


def median_step(command: list[str], env: dict[str, str] | None = None) -> float:
    """Run a whole-job benchmark (``command``, at most 600 s); its rank 0's median step."""
    output = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600, check=True
    ).stdout
    found = [line for line in output.splitlines() if line.startswith(MEDIAN_STEP)]
    return float(found[0].split()[1])
