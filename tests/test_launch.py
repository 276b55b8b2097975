"""ddpctx.launch: N local ranks from a script, a REPL or a test, fail-fast and hang reports."""

from __future__ import annotations

import os
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ddpctx
from ddpctx import RankError, RankTimeoutError, launch
from tests.helpers import (
    REPO,
    child_env,
    child_pids,
    listening_addresses,
    run_python,
    still_running,
    wait_for_files,
)


def children() -> list[int]:
    return child_pids(os.getpid())


@pytest.fixture(autouse=True)
def no_ranks_left_behind() -> Iterator[None]:
    before = set(children())  # e.g. the plugin's warm pools from earlier tests
    yield
    deadline = time.monotonic() + 5
    while set(children()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(set(children()) - before) == []


def rank_report(offset: int, *, scale: int = 1) -> tuple[int, int, int | None, float]:
    ctx = ddpctx.current()
    assert ctx is not None
    value = torch.tensor([float(ctx.rank)])
    dist.all_reduce(value)
    return ctx.rank * scale + offset, ctx.world_size, ctx.seed, value.item()


def test_results_come_back_in_rank_order() -> None:
    assert launch(rank_report, 10, world_size=3, seed=7, scale=2) == [
        (10, 3, 7, 3.0),
        (12, 3, 8, 3.0),
        (14, 3, 9, 3.0),
    ]


def test_lambdas_and_closures_need_no_pickling() -> None:
    base = 40
    assert launch(lambda: ddpctx.current().rank + base, world_size=2) == [40, 41]


def test_each_ranks_output_is_printed_with_its_rank(capsys: pytest.CaptureFixture[str]) -> None:
    launch(lambda: print("hello", ddpctx.current().rank), world_size=2)
    out = capsys.readouterr().out
    assert "[rank 0] hello 0" in out
    assert "[rank 1] hello 1" in out


def test_ranks_listen_on_loopback_only() -> None:
    for addresses in launch(lambda: listening_addresses(os.getpid()), world_size=2):
        assert addresses, "gloo is expected to listen for its peers"
        assert all(a.startswith(("127.", "::1")) for a in addresses), addresses


def fail_on_rank_one() -> None:
    if ddpctx.current().rank == 1:
        raise ValueError("bad shard on rank 1")
    dist.barrier()  # rank 0 waits for a peer that has failed


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_failing_rank_stops_every_rank_within_seconds(world_size: int) -> None:
    started = time.monotonic()
    with pytest.raises(RankError) as raised:
        launch(fail_on_rank_one, world_size=world_size)
    elapsed = time.monotonic() - started
    error = raised.value
    assert elapsed < 5, f"took {elapsed:.1f} s"
    assert error.rank == 1
    assert str(error).startswith("rank 1 failed: ValueError: bad shard on rank 1")
    assert isinstance(error.__cause__, ValueError)  # the original, chained
    assert isinstance(error.original, ValueError)
    assert "in fail_on_rank_one" in error.remote_traceback
    assert 'raise ValueError("bad shard on rank 1")' in error.remote_traceback


def hang_on_rank_zero() -> None:
    if ddpctx.current().rank == 0:
        time.sleep(60)
    dist.barrier()


def test_a_hang_is_reported_with_every_ranks_stack() -> None:
    started = time.monotonic()
    with pytest.raises(RankTimeoutError) as raised:
        launch(hang_on_rank_zero, world_size=2, timeout=2)
    assert time.monotonic() - started < 10
    message = str(raised.value)
    assert "ranks 0, 1 did not finish within 2 s" in message
    rank0, rank1 = message.split("--- rank 0 ---")[1].split("--- rank 1 ---")
    assert "in hang_on_rank_zero" in rank0
    assert "popen_fork" not in message  # frames a worker inherited from its parent are cut
    assert "in barrier" in rank1
    assert "in hang_on_rank_zero" in rank1


def test_a_rank_that_dies_is_reported() -> None:
    with pytest.raises(
        RankError, match=r"rank 1 failed: RuntimeError: rank 1 was killed by signal SIGKILL"
    ):
        launch(lambda: ddpctx.current().rank == 1 and os.kill(os.getpid(), 9), world_size=2)


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_bad_world_size(world_size: object) -> None:
    with pytest.raises(ValueError, match=r"world_size=.* must be a positive int"):
        launch(lambda: None, world_size=world_size)  # type: ignore[arg-type]


def test_from_a_script_with_functions_in_main(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            """
            import ddpctx

            def work(x):
                return ddpctx.current().rank * x

            if __name__ == "__main__":
                print("RESULT", ddpctx.launch(work, 5, world_size=2))
            """
        )
    )
    result = run_python(script, timeout=120, env=child_env())
    assert "RESULT [0, 5]" in result.stdout, result.stderr


def test_from_a_repl_session() -> None:
    import subprocess
    import sys

    session = "import ddpctx\ndef work():\n    return ddpctx.current().world_size\n\n"
    session += "print('RESULT', ddpctx.launch(work, world_size=2))\n"
    result = subprocess.run(
        [sys.executable, "-i", "-q"],
        input=session,
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        cwd=REPO,
    )
    assert "RESULT [2, 2]" in result.stdout, result.stderr


def test_ctrl_c_in_the_caller_stops_every_rank(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    script = tmp_path / "interrupted.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, time, ddpctx

            def wait_forever():
                open(os.path.join({str(tmp_path)!r}, f"pid{{os.getpid()}}"), "w").close()
                time.sleep(600)

            if __name__ == "__main__":
                ddpctx.launch(wait_forever, world_size=2)
            """
        )
    )
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ranks = [int(p.name[3:]) for p in wait_for_files(tmp_path, "pid*", 2)]
        assert len(ranks) == 2
        parent.send_signal(signal.SIGINT)
        _, stderr = parent.communicate(timeout=30)
    finally:
        parent.kill()
    assert "KeyboardInterrupt" in stderr
    assert still_running(ranks) == []


def big_backward() -> int:
    weights = torch.randn(512, 512, requires_grad=True)
    (weights @ weights).sum().backward()
    return torch.get_num_threads()


def test_ranks_run_torch_even_after_the_caller_used_its_thread_pool() -> None:
    matrix = torch.randn(512, 512)
    (matrix @ matrix).sum()  # the caller's OpenMP pool is now running
    assert launch(big_backward, world_size=2, timeout=60) == [1, 1]
