"""A smoke test of benchmarks/run.py: one tiny case of each multi-rank benchmark.

The benchmarks themselves are not part of the test run (they take minutes and
their numbers are noisy); this only keeps their code working.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from ddpctx import launch
from tests.helpers import REPO


def load_runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "benchmarks" / "run.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_run"] = module
    spec.loader.exec_module(module)
    return module


def test_one_round_of_the_reduction_and_training_benchmarks_runs() -> None:
    runner = load_runner()
    samples = launch(
        runner.reduction_rank, ["1", "8", runner.MIXED], 1, 2, True, world_size=2, timeout=120
    )[0]
    table = runner.format_reduction(samples)
    assert table[0].startswith("| contender | 1 metric | 8 metrics |")
    assert any(line.startswith("| ddpctx @all_reduced |") for line in table)
    training = launch(runner.training_rank, 2, 2, world_size=2, timeout=120)[0]
    assert set(training) == {
        "hand-written loop",
        "hand-written loop, again",
        "hand-written loop, async_op",
        "ddpctx loop",
        "ddpctx loop, async_op",
        "ddpctx loop, hang doctor on",
        "ddpctx loop, debug=True",
    }
    for times in training.values():  # 2 rounds of 2 steps: a time per round, parts per step
        assert len(times["step"]) == 2
        assert all(t > 0 for t in times["step"])
        assert all(len(times[part]) == 4 for part in runner.PARTS)
    lines = runner.format_training(training, 2, 2)
    assert any(line.startswith("| ddpctx loop, async_op | ") for line in lines)
    assert any("µs" in line and "| hand-written loop, async_op |" in line for line in lines)


def test_the_per_call_cpu_cost_row_runs() -> None:
    runner = load_runner()
    cpu = runner.per_call_cpu(1, 2)
    assert "ddpctx @all_reduced" in cpu
    assert all(len(times) == 1 and times[0] > 0 for times in cpu.values())
