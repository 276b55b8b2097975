"""Per-test cost of a trivial 2-rank test: the plugin's warm pool vs fresh processes per test.

Run:  python benchmarks/bench_harness.py [--tests 100] [--spawned 8]

- warm pool: ddpctx's RankPool (what @pytest.mark.distributed uses), one fresh
  process group per test, `--tests` tests; median per test and the total.
- cold start: a new interpreter that imports ddpctx, starts the pool and runs
  one test (what the first distributed test of a session pays).
- spawn per test: two fresh `spawn` processes per test that import torch, form
  a group, all_reduce once and exit (what a hand-written harness pays);
  `--spawned` of them are run, and the total for `--tests` is their median x
  `--tests` (stated as an estimate).
- through pytest: one pytest session of 200 (or ``--tests``) plain tests, then
  as many trivial ``@pytest.mark.distributed`` tests; the median time from one
  test's start to the next one's, per kind (plugin, pool and pytest's own
  work for a test): what a distributed test costs, and what pytest alone
  costs a test in the same session.
Targets: <= 10 ms per trivial test through the warm pool, cold start <= 3 s,
warm >= 20x faster in total.

Also ``run.py``'s section 5 (:func:`harness_section`): this script's output,
run in a new process.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: the repository, not benchmarks/, heads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.processes import script
from benchmarks.report import Say


def trivial_test() -> float:
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == dist.get_world_size()
    return value.item()


def spawned_rank(rank: int, store: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    value = torch.ones(1)
    dist.all_reduce(value)
    dist.destroy_process_group()


def spawn_one_test(directory: Path, index: int) -> float:
    context = multiprocessing.get_context("spawn")
    store = str(directory / f"store{index}")
    started = time.perf_counter()
    processes = [context.Process(target=spawned_rank, args=(rank, store)) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0, process.exitcode
    return time.perf_counter() - started


COLD = """
import time; started = time.perf_counter()
from ddpctx.launching.pool import RankPool
import torch
def trivial():
    import torch, torch.distributed as dist
    v = torch.ones(1); dist.all_reduce(v); return v.item()
with RankPool(2) as pool:
    pool.run(trivial)
print(time.perf_counter() - started)
"""


PYTEST_FILE_HEAD = "import pytest\nimport torch\nimport torch.distributed as dist\n"
PYTEST_DISTRIBUTED = """
@pytest.mark.distributed(world_size=2)
def test_{index}():
    value = torch.ones(1)
    dist.all_reduce(value)
    assert value.item() == 2
"""
PYTEST_PLAIN = """
def test_{index}():
    value = torch.ones(1)
    assert value.item() == 1
"""
#: Notes when each test starts, so the session's per-test intervals can be read back.
PYTEST_CONFTEST = """
import time
STARTS = []

def pytest_runtest_logstart(nodeid, location):
    STARTS.append((nodeid.split("::")[0], time.perf_counter()))

def pytest_sessionfinish(session):
    with open("starts.txt", "w") as out:
        out.writelines(f"{name} {at!r}\\n" for name, at in STARTS)
"""
#: Tests of each kind whose intervals are not counted (the pool starts in the first one).
PYTEST_WARM_UP = 20


def through_pytest(tests: int) -> dict[str, list[float]]:
    """Seconds from one test's start to the next one's in one pytest session, per kind.

    One session runs ``tests`` plain tests, then ``tests`` trivial distributed
    ones; the first :data:`PYTEST_WARM_UP` of each are not counted. An interval
    holds everything pytest and the plugin do for one test (set-up, the body
    on every rank, the report), and its median holds still under load where
    the difference of two sessions' times did not (it came out negative).
    """
    kinds = {"test_a_plain.py": PYTEST_PLAIN, "test_b_distributed.py": PYTEST_DISTRIBUTED}
    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        (folder / "conftest.py").write_text(PYTEST_CONFTEST)
        for name, test in kinds.items():
            count = PYTEST_WARM_UP + tests
            body = "".join(test.format(index=index) for index in range(count))
            (folder / name).write_text(PYTEST_FILE_HEAD + body)
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *kinds],
            cwd=folder,
            capture_output=True,
            check=True,
        )
        starts: dict[str, list[float]] = {name: [] for name in kinds}
        for line in (folder / "starts.txt").read_text().splitlines():
            name, at = line.split()
            starts[name].append(float(at))
    intervals = {}
    for name, label in (("test_a_plain.py", "plain"), ("test_b_distributed.py", "distributed")):
        times = starts[name]
        gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
        intervals[label] = gaps[PYTEST_WARM_UP:]
    return intervals


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tests", type=int, default=100)
    parser.add_argument("--spawned", type=int, default=8)
    args = parser.parse_args()

    import torch  # noqa: F401 -- the pytest process has torch loaded before the pool forks

    from ddpctx.launching.pool import RankPool

    warm: list[float] = []
    with RankPool(2) as pool:
        pool.run(trivial_test)  # the pool's first test pays the fork
        for _ in range(args.tests):
            started = time.perf_counter()
            pool.run(trivial_test)
            warm.append(time.perf_counter() - started)

    cold = [
        float(
            subprocess.run(
                [sys.executable, "-c", COLD], capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(3)
    ]
    intervals = through_pytest(max(args.tests, 200))
    with tempfile.TemporaryDirectory() as directory:
        spawned = [spawn_one_test(Path(directory), i) for i in range(args.spawned)]

    warm_median, spawn_median = statistics.median(warm), statistics.median(spawned)
    warm_total, spawn_total = sum(warm), spawn_median * args.tests
    print(f"trivial 2-rank test (one all_reduce), gloo, {os.cpu_count()} CPUs")
    print(
        f"warm pool:      median {warm_median * 1e3:7.1f} ms/test  "
        f"(p90 {sorted(warm)[int(0.9 * len(warm))] * 1e3:.1f} ms), "
        f"{args.tests} tests measured: {warm_total:.2f} s"
    )
    plain, distributed = (statistics.median(intervals[k]) for k in ("plain", "distributed"))
    print(
        f"through pytest: median {distributed * 1e3:7.1f} ms/test  (start to start in one "
        f"session, {len(intervals['distributed'])} tests; a plain test there: "
        f"{plain * 1e3:.1f} ms, so the plugin adds {(distributed - plain) * 1e3:.1f} ms)"
    )
    print(
        f"cold start:     median {statistics.median(cold):7.2f} s (new interpreter, import, "
        f"fork, first test; {len(cold)} runs)"
    )
    print(
        f"spawn per test: median {spawn_median * 1e3:7.1f} ms/test  ({args.spawned} measured; "
        f"{args.tests} tests estimated: {spawn_total:.1f} s)"
    )
    print(f"warm pool is {spawn_total / warm_total:.0f}x faster over {args.tests} tests")


def harness_section(say: Say, quick: bool) -> None:
    """Section 5 of ``run.py``: what this script prints, with fewer tests when ``quick``."""
    say("\n## 5. Test harness\n")
    tests, spawned = (30, 3) if quick else (100, 8)
    say("```\n" + script("bench_harness.py", "--tests", tests, "--spawned", spawned) + "\n```")
    say(
        "torch's MultiProcessTestCase needs `expecttest` and torch's internal test "
        "package, which the CPU wheel here does not ship: not measured."
    )


if __name__ == "__main__":
    main()
