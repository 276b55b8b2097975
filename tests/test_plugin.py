"""The pytest plugin, exercised through pytest's own pytester in a separate session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

pytestmark = pytest.mark.timeout(180)


def run(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_inner=source)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs", *args, timeout=150)


def test_importing_the_plugin_does_not_import_torch() -> None:
    code = "import sys, ddpctx.testing.plugin; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=child_env()
    )
    assert result.stdout.strip() == "False", result.stderr


def test_a_passing_test_runs_on_every_rank_with_fixtures_from_the_main_process(
    pytester: pytest.Pytester,
) -> None:
    result = run(
        pytester,
        """
        import pytest, torch, torch.distributed as dist

        @pytest.fixture
        def answer():
            return 41

        @pytest.mark.distributed(world_size=2)
        def test_sum(dist_ctx, answer):
            value = torch.tensor([float(dist_ctx.rank + answer)])
            dist.all_reduce(value)
            assert value.item() == 83.0
            assert dist_ctx.world_size == 2
        """,
    )
    result.assert_outcomes(passed=1)


def test_a_list_of_world_sizes_expands_into_one_test_per_size(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
        import pytest

        @pytest.mark.distributed(world_size=[1, 2, 3])
        def test_size(dist_ctx):
            assert 0 <= dist_ctx.rank < dist_ctx.world_size
        """,
        "-v",
    )
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        ["*test_size?ws1? PASSED*", "*test_size?ws2? PASSED*", "*test_size?ws3? PASSED*"]
    )


def test_a_failing_rank_is_one_failure_with_the_rewritten_assert_and_each_ranks_output(
    pytester: pytest.Pytester,
) -> None:
    result = run(
        pytester,
        """
        import pytest, torch.distributed as dist

        @pytest.mark.distributed(world_size=2)
        def test_fails(dist_ctx):
            print("hello from rank", dist_ctx.rank)
            if dist_ctx.rank == 1:
                expected = 0
                assert 1 == expected
            dist.barrier()
        """,
    )
    result.assert_outcomes(failed=1)
    result.stdout.no_fnmatch_line("*launcher.py*")  # no library frames in the report
    result.stdout.fnmatch_lines(
        [
            "*raised on rank 1 of 2*",
            "*test_inner.py*, in test_fails",  # the rank's traceback starts at the test
            "AssertionError: assert 1 == 0",
            "E *assert 1 == 0",  # pytest's own rewritten message, original type
            "*Captured rank 0 stdout call*",
            "hello from rank 0",
            "*Captured rank 1 stdout call*",
            "hello from rank 1",
        ]
    )


def test_a_hang_fails_that_test_with_every_ranks_stack_and_the_session_goes_on(
    pytester: pytest.Pytester,
) -> None:
    result = run(
        pytester,
        """
        import time, pytest, torch.distributed as dist

        @pytest.mark.distributed(world_size=2, timeout=2)
        def test_hangs(dist_ctx):
            if dist_ctx.rank == 0:
                time.sleep(60)
            dist.barrier()

        @pytest.mark.distributed(world_size=2)
        def test_after(dist_ctx):
            dist_ctx.barrier()
        """,
    )
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*ranks 0, 1 did not finish within 2 s*",
            "--- rank 0 ---",
            "*test_inner.py*in test_hangs",
            "--- rank 1 ---",
            "*in barrier",
            "*test_inner.py*in test_hangs",
        ]
    )


def test_a_skip_inside_a_rank_skips_the_test(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
        import pytest

        @pytest.mark.distributed(world_size=2)
        def test_skips(dist_ctx):
            pytest.skip("needs two GPUs")
        """,
    )
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs two GPUs*"])


def test_run_distributed_takes_closures_and_module_functions(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
        import ddpctx

        def scaled(x):
            return ddpctx.current().rank * x

        def test_module_function(run_distributed):
            assert run_distributed(scaled, 3, world_size=3) == [0, 3, 6]

        def test_closure(run_distributed):
            offset = 100
            assert run_distributed(lambda: ddpctx.current().rank + offset) == [100, 101]
        """,
    )
    result.assert_outcomes(passed=2)


def test_no_rank_process_outlives_the_session(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    result = run(
        pytester,
        f"""
        import os, pytest

        @pytest.mark.distributed(world_size=[2, 3])
        def test_records_pid(dist_ctx):
            open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()

        @pytest.mark.distributed(world_size=2)
        def test_fails_and_spoils_the_pool(dist_ctx):
            open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
            assert dist_ctx.rank == 0
        """,
    )
    result.assert_outcomes(passed=2, failed=1)
    recorded = [int(name) for name in os.listdir(pids)]
    assert len(recorded) >= 5
    alive = [pid for pid in recorded if Path(f"/proc/{pid}").exists()]
    assert alive == [], f"rank processes still running: {alive}"


def test_works_under_xdist(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    result = run(
        pytester,
        """
        import pytest, torch, torch.distributed as dist

        @pytest.mark.distributed(world_size=[2, 3])
        @pytest.mark.parametrize("value", [1.0, 2.0])
        def test_sum(dist_ctx, value):
            tensor = torch.tensor([value])
            dist.all_reduce(tensor)
            assert tensor.item() == value * dist_ctx.world_size
        """,
        "-n",
        "2",
    )
    result.assert_outcomes(passed=4)


def test_bad_marker_options_are_usage_errors(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
        import pytest

        @pytest.mark.distributed(world_size=0)
        def test_bad(dist_ctx):
            pass
        """,
    )
    assert result.ret != 0
    result.stdout.fnmatch_lines(
        ["*UsageError: @pytest.mark.distributed(world_size=0)*must be a positive int*"]
    )
