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


@pytest.mark.slow
def test_importing_the_plugin_does_not_import_torch() -> None:
    code = "import sys, ddpctx.testing.plugin; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=child_env()
    )
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
            "*test_inner.py*, in test_fails",  # the rank's traceback starts at the test
            "AssertionError: assert 1 == 0",
            "*raised on rank 1 of 2*",
            "E *assert 1 == 0",  # pytest's own rewritten message, original type
            "*Captured rank 0 stdout call*",
            "hello from rank 0",
            "*Captured rank 1 stdout call*",
            "hello from rank 1",
        ]
    )


@pytest.mark.slow
def test_a_failure_report_shows_the_output_of_every_rank_also_those_still_running(
    pytester: pytest.Pytester,
) -> None:
    result = run(
        pytester,
        """
        import time, pytest

        @pytest.mark.distributed(world_size=2)
        def test_1_warms_the_pool(dist_ctx):
            print("from an earlier test on rank", dist_ctx.rank)

        @pytest.mark.distributed(world_size=2)
        def test_2_fails(dist_ctx):
            if dist_ctx.rank == 0:
                print("rank 0 was here")
                time.sleep(30)  # still busy when rank 1 fails: it never reports
            print("rank 1 was here")
            assert dist_ctx.rank == 0
        """,
    )
    result.assert_outcomes(passed=1, failed=1)
    report = result.stdout.str()
    failure = report[report.index("test_2_fails ___") :]
    assert "Captured rank 0 stdout call" in failure, failure
    assert failure.index("Captured rank 0 stdout call") < failure.index("rank 0 was here")
    assert "Captured rank 1 stdout call" in failure
    assert "from an earlier test" not in failure  # the warm pool's earlier test is not this one


@pytest.mark.slow
def test_a_failure_report_opens_with_the_users_error_not_the_peers_transport_error(
    pytester: pytest.Pytester,
) -> None:
    result = run(
        pytester,
        """
        import pytest, torch.distributed as dist

        @pytest.mark.distributed(world_size=2)
        def test_fails(dist_ctx):
            if dist_ctx.rank == 1:
                raise KeyError("shard 7")
            dist.barrier()  # rank 0's barrier breaks when rank 1 leaves: a follow-on error
        """,
    )
    result.assert_outcomes(failed=1)
    report = result.stdout.str()
    failure = report[report.index("test_fails ___") :]
    body = [line for line in failure.splitlines()[1:] if line.strip()]
    assert "Traceback (most recent call last)" in body[0], failure  # the rank's own traceback
    assert failure.index("KeyError: 'shard 7'") < failure.index("as a consequence: rank 0")
    assert ".cc:" not in failure  # gloo's C++ source path is not what the reader needs


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# --- issue: the plugin must behave like pytest --------------------------------------------------


@pytest.mark.slow
def test_a_marked_async_test_runs_its_body(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
        import asyncio, pytest

        @pytest.mark.distributed(world_size=2)
        async def test_fails_in_its_body(dist_ctx):
            await asyncio.sleep(0)
            assert dist_ctx.rank == 99

        @pytest.mark.distributed(world_size=2)
        async def test_awaits_and_passes(dist_ctx):
            assert await asyncio.sleep(0, result=dist_ctx.world_size) == 2
        """,
    )
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*assert 0 == 99*"])


TRIVIAL_UNDER_LOAD = """
import multiprocessing, pytest

def burn():
    while True:
        pass

@pytest.fixture(scope="module", autouse=True)
def cpu_load():
    burners = [multiprocessing.get_context("spawn").Process(target=burn, daemon=True)
               for _ in range(2)]
    for process in burners:
        process.start()
    yield
    for process in burners:
        process.kill()

@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("index", range(100))
def test_trivial(index):
    pass
"""


@pytest.mark.slow
def test_trivial_two_rank_tests_never_fail_to_form_their_group_under_cpu_load(
    pytester: pytest.Pytester,
) -> None:
    # Bodies without a collective: the case where a rank tore its group down while its
    # peer was still connecting, and gloo's mesh set-up also fails by chance under load.
    result = run(pytester, TRIVIAL_UNDER_LOAD)
    result.stdout.no_fnmatch_line("*connectFullMesh*")
    result.assert_outcomes(passed=100)


@pytest.mark.slow
def test_no_state_leaks_from_one_test_to_the_next_through_the_warm_pool(
    pytester: pytest.Pytester,
) -> None:
    source = """
        import os, random, pytest, torch

        START = START_DIR

        @pytest.mark.distributed(world_size=2)
        def test_1_changes_everything(dist_ctx, tmp_path, monkeypatch):
            os.environ["LEAKED_FLAG"] = "1"
            monkeypatch.setenv("LEAKED_BY_MONKEYPATCH", "1")
            os.environ.pop("HOME", None)
            os.chdir(tmp_path)
            torch.set_default_dtype(torch.float64)
            torch.use_deterministic_algorithms(True)

        @pytest.mark.distributed(world_size=2)
        def test_2_sees_a_clean_rank(dist_ctx):
            assert "LEAKED_FLAG" not in os.environ
            assert "LEAKED_BY_MONKEYPATCH" not in os.environ
            assert "HOME" in os.environ
            assert os.getcwd() == START, "cwd leaked from the previous test"
            assert torch.get_default_dtype() == torch.float32
            assert not torch.are_deterministic_algorithms_enabled()

        def draw(rank):
            return repr([random.random(), torch.rand(1).item()])

        @pytest.mark.distributed(world_size=2)
        def test_3_draws(dist_ctx):
            with open(os.path.join(START, f"draw{dist_ctx.rank}"), "w") as handle:
                handle.write(draw(dist_ctx.rank))

        @pytest.mark.distributed(world_size=2)
        def test_4_draws_the_same_whatever_ran_before(dist_ctx):
            with open(os.path.join(START, f"draw{dist_ctx.rank}")) as handle:
                assert handle.read() == draw(dist_ctx.rank)
        """
    result = run(
        pytester, source.replace("START_DIR", repr(str(pytester.path))), "-p", "no:randomly"
    )
    result.assert_outcomes(passed=4)


@pytest.mark.slow
def test_isolated_tests_get_fresh_rank_processes(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
        import os, pytest

        pids = {}

        @pytest.mark.distributed(world_size=2)
        def test_warm(dist_ctx):
            os.environ["SEEN_PID"] = str(os.getpid())
            import builtins
            builtins.ddpctx_marker = os.getpid()  # a module global: not restorable

        @pytest.mark.distributed(world_size=2, isolated=True)
        def test_isolated(dist_ctx):
            import builtins
            assert not hasattr(builtins, "ddpctx_marker")
        """,
    )
    result.assert_outcomes(passed=2)


@pytest.mark.slow
def test_environment_and_cwd_from_fixtures_reach_the_ranks_in_every_test(
    pytester: pytest.Pytester,
) -> None:
    result = run(
        pytester,
        """
        import os, pytest

        @pytest.fixture
        def flag_on(monkeypatch, tmp_path):
            monkeypatch.setenv("MY_FLAG", "on")
            monkeypatch.chdir(tmp_path)
            return str(tmp_path)

        @pytest.mark.distributed(world_size=2)
        def test_a_first_test_warms_the_pool(dist_ctx):
            assert "MY_FLAG" not in os.environ

        @pytest.mark.distributed(world_size=2)
        def test_the_fixtures_environment_is_seen(dist_ctx, flag_on):
            assert os.environ.get("MY_FLAG") == "on"
            assert os.getcwd() == flag_on

        @pytest.mark.distributed(world_size=2)
        def test_and_is_gone_afterwards(dist_ctx):
            assert "MY_FLAG" not in os.environ
        """,
        "-p",
        "no:randomly",
    )
    result.assert_outcomes(passed=3)


OUTPUT_TESTS = """
import pytest

@pytest.mark.distributed(world_size=2)
def test_prints(dist_ctx):
    print(f"hello from rank {dist_ctx.rank}")

@pytest.mark.distributed(world_size=2)
def test_capsys_inside_a_rank(dist_ctx, capsys):
    print("captured", dist_ctx.rank)
    assert capsys.readouterr().out == f"captured {dist_ctx.rank}\\n"
    assert capsys.readouterr().out == ""
"""


@pytest.mark.slow
def test_dash_s_streams_each_ranks_output_with_its_rank(pytester: pytest.Pytester) -> None:
    result = run(pytester, OUTPUT_TESTS, "-s")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*[[]rank 0[]] hello from rank 0*"])
    result.stdout.fnmatch_lines(["*[[]rank 1[]] hello from rank 1*"])


@pytest.mark.slow
def test_dash_r_p_shows_the_output_of_passing_tests(pytester: pytest.Pytester) -> None:
    result = run(pytester, OUTPUT_TESTS, "-rP")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "*PASSES*",
            "*Captured rank 0 stdout call*",
            "hello from rank 0",
            "*Captured rank 1 stdout call*",
            "hello from rank 1",
        ]
    )


@pytest.mark.slow
def test_dist_world_size_fixture_and_pytest_param_world_sizes(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
        import pytest

        @pytest.fixture
        def shards(dist_world_size):
            return list(range(dist_world_size))

        @pytest.mark.distributed(
            world_size=[1, pytest.param(2, id="pair"),
                        pytest.param(3, marks=pytest.mark.skip(reason="slow size"))]
        )
        def test_sizes(dist_ctx, dist_world_size, shards):
            assert dist_ctx.world_size == dist_world_size == len(shards)

        @pytest.mark.distributed(world_size=2)
        def test_single_size(dist_ctx, dist_world_size):
            assert dist_world_size == 2
        """,
        "-v",
    )
    result.assert_outcomes(passed=3, skipped=1)
    result.stdout.fnmatch_lines(["*test_sizes?ws1? PASSED*", "*test_sizes?pair? PASSED*"])


@pytest.mark.slow
def test_init_false_gives_the_rendezvous_variables_and_no_group(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
        import os, pytest, torch, torch.distributed as dist
        import ddpctx

        @pytest.mark.distributed(world_size=2, init=False)
        def test_forms_its_own_group():
            assert not dist.is_initialized()
            assert ddpctx.current() is None
            dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
            value = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(value)
            assert value.item() == 1.0
            dist.destroy_process_group()

        @pytest.mark.distributed(world_size=3, init=False)
        def test_uses_its_own_distributed_block():
            with ddpctx.distributed() as ctx:
                assert (ctx.world_size, ctx.launcher) == (3, "launch")
                assert ctx.all_reduce(1.0, op="sum") == 3.0
        """,
    )
    result.assert_outcomes(passed=2)


@pytest.mark.slow
def test_a_positional_world_size_is_accepted(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
        import pytest

        @pytest.mark.distributed(3)
        def test_three(dist_ctx):
            assert dist_ctx.world_size == 3
        """,
    )
    result.assert_outcomes(passed=1)


@pytest.mark.slow
def test_a_bad_marker_is_one_clear_line_on_that_test_only(pytester: pytest.Pytester) -> None:
    result = run(
        pytester,
        """
        import pytest

        @pytest.mark.distributed(world_size=0)
        def test_bad(dist_ctx):
            pass

        def test_unaffected():
            pass
        """,
    )
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.no_fnmatch_line("*pluggy?_*")
    result.stdout.fnmatch_lines(["*distributed(world_size=0)*must be a positive int*"])


@pytest.mark.slow
def test_a_skip_points_at_the_test_not_at_the_plugin(pytester: pytest.Pytester) -> None:
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
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] test_inner.py:*needs two GPUs*"])
    result.stdout.no_fnmatch_line("*pluggy?_*")


@pytest.mark.slow
def test_a_failure_with_an_unpicklable_fixture_does_not_chain_a_pickling_error(
    pytester: pytest.Pytester,
) -> None:
    result = run(
        pytester,
        """
        import pytest

        @pytest.mark.distributed(world_size=2)
        def test_uses_request(dist_ctx, request):
            assert dist_ctx.rank == 0
        """,
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*raised on rank 1 of 2*"])
    result.stdout.no_fnmatch_line("*pickle*")


@pytest.mark.slow
def test_a_pytest_timeout_hit_shows_the_ranks_stacks(pytester: pytest.Pytester) -> None:
    pytest.importorskip("pytest_timeout")
    result = run(
        pytester,
        """
        import time, pytest

        @pytest.mark.timeout(20)
        @pytest.mark.distributed(world_size=2)
        def test_sleeps(dist_ctx):
            time.sleep(60)
        """,
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["--- rank 0 ---", "*test_inner.py*in test_sleeps"])
    result.stdout.no_fnmatch_line("*from pytest-timeout*")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["--timeout=4", "marker"])
def test_a_short_pytest_timeout_still_shows_the_ranks_stacks(
    pytester: pytest.Pytester, where: str
) -> None:
    # Before: with --timeout of 6 s or less, pytest-timeout interrupted the plugin while
    # it collected the stacks, and the failure showed the plugin's frames, no rank's.
    pytest.importorskip("pytest_timeout")
    marker = "@pytest.mark.timeout(4)" if where == "marker" else ""
    result = run(
        pytester,
        f"""
        import time, pytest

        {marker}
        @pytest.mark.distributed(world_size=2, timeout=60)
        def test_sleeps(dist_ctx):
            time.sleep(60)

        {marker}
        def test_uses_the_fixture(run_distributed):
            run_distributed(time.sleep, 60)
        """,
        *(["--timeout=4"] if where != "marker" else []),
    )
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*did not finish within 4 s*", "*--- rank 0 ---*"] * 2)
    result.stdout.no_fnmatch_line("*from pytest-timeout*")


def test_the_readme_states_the_default_marker_timeout_and_what_travels() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("pytest plugin") :]
    for phrase in ("60 s", "isolated=True", "init=False", "dist_world_size", "module globals"):
        assert phrase in section, phrase
