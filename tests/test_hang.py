"""The hang doctor: real jobs that hang on purpose, under torchrun and launch().

Each job uses a ``hang_timeout`` of a few seconds; a rank that misbehaves
comes back once the report is published in the job's store (an event, not a
guessed sleep: quick when the machine is idle, patient when it is busy), so
``on_hang="report"`` jobs end by themselves and every test is bounded in time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed import distributed_c10d

import ddpctx
from ddpctx import HangError, RankError, RankTimeoutError, distributed, launch
from ddpctx.hang.inflight import Tracker
from ddpctx.hang.peers import describe
from ddpctx.hang.report import PREFIX, Exchange, RankState, format_report
from ddpctx.hang.settings import HangSettings, resolve_hang_settings
from ddpctx.hang.watchdog import Watchdog
from tests.helpers import REPO, patience, run_torchrun, start_torchrun

SCRIPT = REPO / "tests" / "scripts" / "hang_case.py"
HANG_TIMEOUT = 2
#: The report must come within hang_timeout + 5 s of the wait starting.
REPORT_WITHIN_S = HANG_TIMEOUT + 5


def line_of(marker: str, path: Path = SCRIPT) -> str:
    """``file:line`` of the one line that ends in ``# marker``."""
    found = [
        number
        for number, text in enumerate(path.read_text().splitlines(), 1)
        if text.rstrip().endswith(f"# {marker}")
    ]
    assert len(found) == 1, f"{len(found)} lines end in '# {marker}' in {path}"
    return f"{path.relative_to(REPO)}:{found[0]}"


def reports_in(output: str) -> list[list[str]]:
    """The lines of each hang report in ``output``, in order (rank prefixes removed)."""
    lines = [re.sub(r"^\[rank \d+\] ", "", line) for line in output.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("ddpctx hang report:")]
    if not starts:  # none: report_of says so, not zip()
        return []
    return [lines[start:end] for start, end in zip(starts, [*starts[1:], len(lines)], strict=True)]


def report_of(output: str) -> list[str]:
    """The lines of the one hang report in ``output``."""
    reports = reports_in(output)
    assert len(reports) == 1, f"expected one report, found {len(reports)}:\n{output}"
    return reports[0]


def rank_line(report: list[str], rank: int) -> str:
    return next(line for line in report if line.strip().startswith(f"rank {rank}:"))


def waited_seconds(line: str) -> int:
    found = re.search(r"\((\d+) s\)$", line)
    assert found, line
    return int(found.group(1))


def torchrun_case(
    case: str, nproc: int, on_hang: str = "report", timeout: float = 150
) -> tuple[int, str, str]:
    result = run_torchrun(SCRIPT, case, str(HANG_TIMEOUT), on_hang, nproc=nproc, timeout=timeout)
    return result.returncode, result.stdout, result.stderr


#: The on_hang="report" cases that one torchrun job per world size runs in turn.
SHARED_CASES = {2: ("sleep", "raw", "ddp", "slow_save"), 3: ("sleep", "p2p", "ddp")}


#: The first test that reads :func:`shared_jobs` (:func:`idle_jobs`) waits for their jobs.
SHARED_JOB_BOUND = pytest.mark.timeout(900)


@dataclass
class Job:
    """One torchrun job of several cases: its exit code, stdout and each case's report."""

    code: int
    out: str
    err: str
    reports: dict[str, list[str]]


@pytest.fixture(scope="module")
def shared_jobs() -> dict[int, Job]:
    """The cases of :data:`SHARED_CASES`, one job per world size (a job's start costs 5-10 s)."""
    jobs = {}
    for nproc, cases in SHARED_CASES.items():
        code, out, err = torchrun_case(",".join(cases), nproc, timeout=300)
        reports = reports_in(err)
        assert len(reports) == len(cases), f"{len(reports)} reports for {cases}:\n{err}"
        jobs[nproc] = Job(code, out, err, dict(zip(cases, reports, strict=True)))
    return jobs


def shared_case(jobs: dict[int, Job], case: str, nproc: int) -> tuple[int, str, list[str]]:
    """(exit code, stdout, ``case``'s report) of the shared job of ``nproc`` ranks."""
    job = jobs[nproc]
    return job.code, job.out, job.reports[case]


#: Cases whose rank 0 is silent, on no CPU (blocked in native code, SIGSTOP), until rank 1
#: has seen the report: their two jobs run side by side.
IDLE_CASES = ("gil", "stopped")


@pytest.fixture(scope="module")
def idle_jobs() -> dict[str, tuple[int, str, str]]:
    """``case -> (exit code, stdout, stderr)`` of the :data:`IDLE_CASES` jobs, run at once."""
    jobs = {case: start_torchrun(SCRIPT, case, str(HANG_TIMEOUT), "report") for case in IDLE_CASES}
    results = {}
    try:
        for case, job in jobs.items():
            out, err = job.communicate(timeout=patience(150))
            results[case] = (job.returncode, out, err)
    finally:
        for job in jobs.values():
            if job.poll() is None:  # its own session: the ranks go with it
                os.killpg(job.pid, signal.SIGKILL)
                job.communicate()
    return results


# --- 1. a rank outside any collective -------------------------------------------------------


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.slow  # a torchrun job or a real hang timeout
@SHARED_JOB_BOUND
def test_a_rank_that_sleeps_is_named_with_its_line_while_the_others_wait(
    shared_jobs: dict[int, Job], nproc: int
) -> None:
    code, out, report = shared_case(shared_jobs, "sleep", nproc)
    assert "not in a collective" in rank_line(report, 1)
    assert line_of("SLEEP") in rank_line(report, 1)
    assert rank_line(report, 1).endswith("<- stuck here")
    for rank in {0, 2} & set(range(nproc)):
        line = rank_line(report, rank)
        assert "waiting in barrier()" in line
        assert line_of("BARRIER") in line
        assert waited_seconds(line) <= REPORT_WITHIN_S
    waiting = nproc - 1
    assert (
        f"diagnosis: rank 1 is not in any collective while {waiting} rank"
        f"{'s' if waiting > 1 else ''} wait"
    ) in "\n".join(report)
    assert code == 0
    assert "JOB-DONE" in out


@pytest.mark.slow
@SHARED_JOB_BOUND
def test_a_recv_names_its_peer_and_a_rank_outside_the_pair_is_not_stuck(
    shared_jobs: dict[int, Job],
) -> None:
    # Before: "rank 1: waiting in recv()", and rank 2 (asleep, in no pair) "<- stuck here".
    code, out, report = shared_case(shared_jobs, "p2p", 3)
    receiver = rank_line(report, 1)
    assert "waiting in recv from rank 0" in receiver
    assert line_of("RECV") in receiver
    assert line_of("P2P-SLEEP") in rank_line(report, 0)
    assert rank_line(report, 0).endswith("<- stuck here")
    bystander = rank_line(report, 2)
    assert "not in a collective" in bystander
    assert line_of("BYSTANDER") in bystander
    assert not bystander.endswith("<- stuck here")
    assert (
        "diagnosis: rank 0 is not in any collective while 1 rank waits for it "
        "(rank 1 in recv from rank 0)"
    ) in "\n".join(report)
    assert code == 0
    assert "JOB-DONE" in out


@pytest.mark.slow
@SHARED_JOB_BOUND
def test_another_rank_reports_when_rank_0_holds_the_gil(
    idle_jobs: dict[str, tuple[int, str, str]],
) -> None:
    # Before: no report at all while rank 0 held the GIL (only rank 0 printed).
    code, out, err = idle_jobs["gil"]
    report = report_of(err)
    silent = rank_line(report, 0)
    found = re.search(r"rank 0: not answering for (\d+) s \(it may hold the GIL", silent)
    assert found, silent
    assert HANG_TIMEOUT <= int(found.group(1)) <= patience(8 * HANG_TIMEOUT + 4)
    assert "waiting in barrier()" in rank_line(report, 1)
    assert line_of("GIL-BARRIER") in rank_line(report, 1)
    assert (
        "diagnosis: rank 0 is not answering while 1 rank waits for it (rank 1 in barrier()): "
        "it may hold the GIL in native code"
    ) in "\n".join(report)
    assert code == 0
    assert "JOB-DONE" in out


@pytest.mark.slow
@SHARED_JOB_BOUND
def test_another_rank_reports_when_rank_0_is_stopped(
    idle_jobs: dict[str, tuple[int, str, str]],
) -> None:
    code, out, err = idle_jobs["stopped"]
    report = report_of(err)
    assert re.search(r"rank 0: not answering for \d+ s", rank_line(report, 0))
    assert line_of("STOPPED-BARRIER") in rank_line(report, 1)
    assert "diagnosis: rank 0 is not answering while 1 rank waits for it" in "\n".join(report)
    assert code == 0
    assert "JOB-DONE" in out


@pytest.mark.slow  # a torchrun job or a real hang timeout
@pytest.mark.parametrize(("when", "nproc"), [("reported", 2), ("opened", 3)])
def test_under_on_hang_raise_a_rank_that_comes_back_raises_the_one_real_report(
    when: str, nproc: int
) -> None:
    # Before: the ranks' waits ended once rank 1 let go of the GIL, rank 0 went on, and
    # rank 1 raised a made-up report ("no rank sent a report") from its exit, which
    # torchrun could show as the root cause. Then (3 ranks, the stall ending before the
    # report was out): a waiting rank other than rank 0 left the block with no error.
    script = REPO / "tests" / "scripts" / "hang_comes_back.py"
    result = run_torchrun(script, str(HANG_TIMEOUT), when, nproc=nproc, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    said = re.findall(r"(?:NOT-)?RAISED \d(?: \d+ (?:True|False))?", result.stdout)
    ranks = sorted(said, key=lambda line: line.split()[1])
    assert [line.split()[:2] for line in ranks] == [["RAISED", str(r)] for r in range(nproc)], (
        result.stdout + result.stderr[-3000:]
    )
    assert {line.split()[3] for line in ranks} == {"True"}, result.stdout + result.stderr[-3000:]
    assert len({line.split()[2] for line in ranks}) == 1, "ranks raised different reports"
    assert "no rank sent a report" not in result.stderr


def test_under_on_hang_raise_a_rank_that_leaves_before_the_report_still_raises_it() -> None:
    # Found by the outside attack (3 ranks, one holding the GIL 6 s): the stall ended while
    # rank 0 still collected answers, every wait completed, and rank 1, which had answered,
    # stopped waiting for the report when its block ended and left with no error.
    store = dist.HashStore()
    tracker = Tracker()
    watchdog = Watchdog(HangSettings(2.0, "raise", False), tracker, store, 1, 3).start()
    reporter = Exchange(store, 0, 3)
    assert reporter.open_next(0) == 1  # rank 0 opens an incident
    deadline = time.monotonic() + patience(10)
    while not store.check([f"{PREFIX}1/rank1"]):  # rank 1's watchdog answers it
        assert time.monotonic() < deadline, "the watchdog did not answer the incident"
        time.sleep(0.05)
    publish = threading.Timer(1.0, reporter.publish, (1, "ddpctx hang report: the one"))
    publish.start()
    watchdog.stop()  # rank 1's block ends before the report is published
    publish.join()
    assert isinstance(tracker.failure, HangError)
    assert str(tracker.failure) == "ddpctx hang report: the one"


@pytest.mark.parametrize(
    "back",
    [
        RankState(1, None, 0.0, "train.py:12 in g", "", None, 5.1),  # not yet in the next one
        RankState(1, "barrier()", 0.0, "train.py:12 in g", "", None, 5.1),  # a line further
    ],
    ids=["outside-collectives", "in-the-next-collective"],
)
def test_a_rank_that_could_not_run_is_the_diagnosis_wherever_it_is_now(back: RankState) -> None:
    # Found by the outside attack (6 of 9 runs, GIL stalls and SIGSTOP of 4-6 s): the rank,
    # just back, was not yet in a collective (so "not in any collective ... took a branch")
    # or already in the next one while the others' answers were older ("ranks are in
    # different collectives"); both blamed something that did not happen.
    states: list[RankState | None] = [RankState(0, "barrier()", 3.0, "train.py:11 in g", ""), back]
    report = format_report(states, 2).splitlines()
    assert rank_line(report, 1).endswith("after 5 s in which it could not run")
    assert "stuck here" not in rank_line(report, 1)
    assert report[3].startswith("diagnosis: rank 1 could not run for 5 s while 1 rank waits")


def test_the_silence_of_a_rank_that_does_not_answer_is_as_of_the_incidents_opening() -> None:
    # Found by the outside attack: "no collective has completed for 3 s" and rank 1's
    # "(3 s)" are as of the answers, and "rank 0: not answering for 10 s" was as of the
    # report, 7 s later. Now all three are as of the incident's opening.
    store = dist.HashStore()
    silent, reporter = Exchange(store, 0, 2), Exchange(store, 1, 2)
    silent.beat()
    time.sleep(0.3)
    assert reporter.newest() == 0  # as a watchdog does on starting
    assert reporter.open_next(0) == 1
    opened = reporter.opened(1)
    assert opened is not None
    assert opened <= time.time()
    time.sleep(0.5)  # the answers are being collected
    (age,) = reporter.silence([0], opened).values()
    assert 0.3 <= age < 0.3 + patience(0.5)
    assert reporter.silence([0])[0] >= age + 0.5  # as of now, it would be longer
    reporter.open_next(0)  # a rank that saw incident 1 late does not move its moment
    assert reporter.opened(1) == opened


@pytest.mark.slow  # over 2 s: out of the quick tier
def test_a_watchdog_that_could_not_run_says_for_how_long_in_its_answer() -> None:
    # Rank 1's main thread holds the GIL in native code for 4 s (so its watchdog cannot
    # run) while rank 0 opens an incident; once back, the watchdog answers with the stall.
    import ctypes

    store = dist.HashStore()
    watchdog = Watchdog(HangSettings(60.0, "report", False), Tracker(), store, 1, 2).start()
    try:
        beat = store.get(f"{PREFIX}alive/rank1")
        deadline = time.monotonic() + patience(10)
        while store.get(f"{PREFIX}alive/rank1") == beat:  # just after a tick: the next is 1 s off
            assert time.monotonic() < deadline, "the watchdog did not tick"
            time.sleep(0.01)
        Exchange(store, 0, 2).open_next(0)
        ctypes.PyDLL(None).sleep(4)  # native code, GIL held
        answer = rank1_answer(store)
    finally:
        watchdog.stop()
    # Never less than the stall (the attack saw a 6 s stall reported as "5 s").
    assert 3.9 <= answer.stalled <= 4.0 + patience(2)


def test_a_watchdog_that_ran_on_time_answers_with_no_stall() -> None:
    store = dist.HashStore()
    watchdog = Watchdog(HangSettings(60.0, "report", False), Tracker(), store, 1, 2).start()
    try:
        Exchange(store, 0, 2).open_next(0)
        answer = rank1_answer(store)
    finally:
        watchdog.stop()
    assert answer.stalled == 0.0


class EntersBarrierOnceAsked(Tracker):
    """A main thread that enters ``barrier()`` just after the watchdog, asked, first reads it."""

    def __init__(self, store: Any) -> None:
        super().__init__()  # the tracker's thread: the one that made it, this test's
        self.store = store

    def waited(self, now: float) -> tuple[str | None, float]:
        state = super().waited(now)
        if self.entered == 0 and Exchange(self.store, 1, 2).newest() > 0:
            self.op, self.since, self.entered = "barrier()", now, 1
        return state


def test_a_rank_entering_a_collective_while_it_answers_is_not_called_outside_collectives() -> None:
    # Found by the outside attack (2 of 6 runs: a rank back from a 7 s GIL stall, then
    # dist.barrier()): its line said "not in a collective" above a stack inside barrier().
    # The watchdog had read the tracker, then made store calls (the main thread ran and
    # entered barrier()), then took the stack.
    store = dist.HashStore()
    tracker = EntersBarrierOnceAsked(store)
    watchdog = Watchdog(HangSettings(60.0, "report", False), tracker, store, 1, 2).start()
    try:
        Exchange(store, 0, 2).open_next(0)
        answer = rank1_answer(store)
    finally:
        watchdog.stop()
    assert answer.op == "barrier()"


def rank1_answer(store: Any) -> RankState:
    """Rank 1's answer to incident 1, once its watchdog gave it."""
    deadline = time.monotonic() + patience(10)
    while not store.check([f"{PREFIX}1/rank1"]):
        assert time.monotonic() < deadline, "the watchdog did not answer the incident"
        time.sleep(0.05)
    return RankState.from_json(store.get(f"{PREFIX}1/rank1"))


@pytest.mark.slow  # a torchrun job or a real hang timeout
def test_under_launch_a_rank_that_sleeps_is_named(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DDPCTX_HANG_TIMEOUT", str(HANG_TIMEOUT))
    assert launch(_sleep_on_rank_1, world_size=3, timeout=60) == [None, None, None]
    report = report_of(capfd.readouterr().err)
    assert "not in a collective" in rank_line(report, 1)
    assert f"{Path(__file__).name}:" in rank_line(report, 1)
    assert "_sleep_on_rank_1" in rank_line(report, 1)
    assert "waiting in barrier()" in rank_line(report, 0)
    assert waited_seconds(rank_line(report, 2)) <= REPORT_WITHIN_S


def _sleep_on_rank_1() -> None:
    ctx = ddpctx.current()
    assert ctx is not None
    store, give_up = distributed_c10d._get_default_store(), time.monotonic() + 60
    while ctx.rank == 1 and not store.check([f"{PREFIX}1/report"]) and time.monotonic() < give_up:
        time.sleep(0.05)  # back once the report is published
    ctx.barrier()


# --- 2. different collectives; 5. on_hang="raise" -------------------------------------------


@pytest.mark.slow  # a torchrun job or a real hang timeout
def test_ranks_in_different_collectives_are_named_with_both_call_sites() -> None:
    code, _, err = torchrun_case("diverge", 2, on_hang="raise")
    report = "\n".join(report_of(err.split("Root Cause")[0]))
    assert (
        f"diagnosis: ranks are in different collectives: barrier at {line_of('DIVERGE-BARRIER')} "
        f"(rank 0) vs all_reduce at {line_of('EVALUATE')} (rank 1)."
    ) in report
    assert code != 0


@pytest.mark.slow  # a torchrun job or a real hang timeout
def test_on_hang_raise_ends_the_job_with_the_report_as_root_cause() -> None:
    started = time.monotonic()
    code, _, err = torchrun_case("sleep", 3, on_hang="raise")
    elapsed = time.monotonic() - started
    assert code != 0
    root_cause = err.split("Root Cause (first observed failure)", 1)[1]
    assert "HangError: ddpctx hang report:" in root_cause
    assert "<- stuck here" in root_cause
    # The late rank waits for a key never set; the hang doctor ended the job instead.
    assert "JOB-DONE" not in err
    assert elapsed < patience(120)


# --- 3. a raw torch.distributed call; 4. DDP ------------------------------------------------


@pytest.mark.slow  # a torchrun job or a real hang timeout
@SHARED_JOB_BOUND
def test_a_raw_torch_distributed_collective_counts_as_waiting(shared_jobs: dict[int, Job]) -> None:
    _, _, report = shared_case(shared_jobs, "raw", 2)
    assert "waiting in all_reduce()" in rank_line(report, 1)
    assert line_of("RAW") in rank_line(report, 1)
    assert "not in a collective" in rank_line(report, 0)
    assert line_of("RAW-SLEEP") in rank_line(report, 0)


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.slow  # a torchrun job or a real hang timeout
@SHARED_JOB_BOUND
def test_a_rank_that_skips_backward_is_named_the_others_wait_in_ddp_backward(
    shared_jobs: dict[int, Job], nproc: int
) -> None:
    code, out, report = shared_case(shared_jobs, "ddp", nproc)
    assert "not in a collective" in rank_line(report, 1)
    assert line_of("SKIP") in rank_line(report, 1)
    for rank in {0, 2} & set(range(nproc)):
        line = rank_line(report, rank)
        assert "waiting in DDP backward" in line
        assert line_of("BACKWARD") in line
    assert code == 0
    assert "JOB-DONE" in out


# --- 6. a slow rank-0 write -----------------------------------------------------------------


@pytest.mark.slow  # a torchrun job or a real hang timeout
@SHARED_JOB_BOUND
def test_a_slow_checkpoint_write_is_reported_once_and_the_job_succeeds(
    shared_jobs: dict[int, Job],
) -> None:
    # Once: the shared job's reports are exactly one per case (checked by shared_jobs).
    code, out, report = shared_case(shared_jobs, "slow_save", 2)
    assert line_of("SLOW-WRITE") in rank_line(report, 0)
    assert "waiting in" in rank_line(report, 1)
    assert code == 0
    assert "JOB-DONE" in out


# --- 7. no growth over enter/exit cycles ----------------------------------------------------


@pytest.mark.slow  # a torchrun job or a real hang timeout
def test_two_hundred_cycles_leave_no_thread_or_file_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDPCTX_HANG_TIMEOUT", raising=False)
    with distributed(hang_timeout=30):
        pass  # warm-up: torch opens what it keeps open once
    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    for _ in range(200):
        with distributed(hang_timeout=30) as ctx:
            assert any(t.name == "ddpctx-watchdog" for t in threading.enumerate())
            ctx.barrier()
    assert (threading.active_count(), len(os.listdir("/proc/self/fd"))) == (threads, fds)
    assert dist.all_reduce is torch.distributed.distributed_c10d.all_reduce  # put back


@pytest.mark.slow
def test_sixty_cycles_under_torchrun_leave_no_thread_or_file_behind() -> None:
    # Counts must match exactly, so one leaked thread or fd per cycle shows at once; the
    # in-process test above runs the full 200 cycles.
    result = run_torchrun(REPO / "tests/scripts/hang_cycles.py", "60", nproc=2, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = re.findall(r"CYCLES threads=(\d+),(\d+) fds=(\d+),(\d+)", result.stdout)
    assert len(lines) == 2
    for before_threads, after_threads, before_fds, after_fds in lines:
        assert (after_threads, after_fds) == (before_threads, before_fds)


# --- 8. ctx.any / ctx.all, and the skip-a-batch example -------------------------------------


@pytest.mark.parametrize("world_size", [2, 3])
def test_any_and_all_agree_on_every_rank(world_size: int) -> None:
    results = launch(_votes, world_size=world_size, timeout=60)
    assert results == [(True, False, True, True)] * world_size


def _votes() -> tuple[bool, bool, bool, bool]:
    ctx = ddpctx.current()
    assert ctx is not None
    only_last = ctx.rank == ctx.world_size - 1
    return ctx.any(only_last), ctx.all(only_last), ctx.all(True), ctx.any(torch.tensor(1))


def skip_a_batch(decide_together: bool) -> float:
    """Train on 6 batches; rank 1 finds batch 2 bad. Returns the sum of the weights."""
    ctx = ddpctx.current()
    assert ctx is not None
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in range(6):
        loss = model(torch.ones(8, 4) * batch).pow(2).mean()
        bad = ctx.rank == 1 and batch == 2  # e.g. a NaN loss on one rank only
        skip = ctx.any(bad) if decide_together else bad
        if skip:
            continue
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ctx.barrier()
    return float(sum(p.sum() for p in model.parameters()))


def test_skipping_a_batch_with_ctx_any_keeps_the_ranks_in_lockstep() -> None:
    results = launch(skip_a_batch, True, world_size=2, timeout=60)
    assert results[0] == results[1]


@pytest.mark.slow  # a torchrun job or a real hang timeout
def test_skipping_a_batch_on_one_rank_alone_hangs_and_is_diagnosed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DDPCTX_HANG_TIMEOUT", str(HANG_TIMEOUT))
    with pytest.raises(RankTimeoutError) as caught:
        launch(skip_a_batch, False, world_size=2, timeout=HANG_TIMEOUT + 8)
    message = str(caught.value)
    assert "diagnosis: ranks are in different collectives: DDP backward" in message
    assert "barrier" in message
    assert "Python stack of every unfinished rank" in message  # launch()'s own dump stays


# --- debug mode -----------------------------------------------------------------------------


def test_debug_mode_fails_at_once_naming_both_call_sites(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPCTX_DEBUG", "collectives")
    monkeypatch.setenv("DDPCTX_HANG_TIMEOUT", "0")
    started = time.monotonic()
    with pytest.raises(RankError) as caught:
        launch(_diverge, world_size=2, timeout=60)
    assert time.monotonic() - started < patience(30)
    assert isinstance(caught.value.original, HangError)
    message = str(caught.value.original)
    here = "tests/test_hang.py"
    assert f"barrier at {here}:" in message
    assert f"all_reduce at {here}:" in message


def _diverge() -> None:
    ctx = ddpctx.current()
    assert ctx is not None
    if ctx.rank == 0:
        ctx.barrier()
    else:
        ctx.all_reduce(1.0)


# --- options and the report's shape ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "environ", "names"),
    [
        ({"hang_timeout": -1}, {}, "hang_timeout=-1"),
        ({"hang_timeout": "60"}, {}, "hang_timeout='60'"),
        ({"hang_timeout": True}, {}, "hang_timeout=True"),
        ({"hang_timeout": 900}, {}, "hang_timeout=900"),
        ({"on_hang": "kill"}, {}, "on_hang='kill'"),
        ({}, {"DDPCTX_HANG_TIMEOUT": "soon"}, "DDPCTX_HANG_TIMEOUT='soon'"),
        ({}, {"DDPCTX_DEBUG": "all"}, "DDPCTX_DEBUG='all'"),
        # Below the floor: a report per second of healthy work.
        ({"hang_timeout": 1e-6}, {}, "hang_timeout=1e-06 s is below the hang doctor's floor"),
        ({}, {"DDPCTX_HANG_TIMEOUT": "0.5"}, "DDPCTX_HANG_TIMEOUT=0.5 s is below"),
        # Errors about the variable's value name the variable, not hang_timeout.
        ({}, {"DDPCTX_HANG_TIMEOUT": "900"}, "DDPCTX_HANG_TIMEOUT=900 s is not below"),
        ({}, {"DDPCTX_HANG_TIMEOUT": "inf"}, "DDPCTX_HANG_TIMEOUT='inf'"),
    ],
)
def test_bad_hang_options_are_refused_naming_the_value(
    kwargs: dict[str, object], environ: dict[str, str], names: str
) -> None:
    options = {"hang_timeout": None, "on_hang": "report", "debug": False, **kwargs}
    with pytest.raises(ValueError, match=re.escape(names)):
        resolve_hang_settings(
            options["hang_timeout"], options["on_hang"], options["debug"], 600.0, environ
        )


@given(
    timeout=st.floats(min_value=0.01, max_value=5000.0),
    hang=st.one_of(
        st.floats(min_value=1e-3, max_value=1e4),
        st.sampled_from([-1, float("nan"), float("inf"), "60", True, None]),
    ),
    from_environment=st.booleans(),
)
def test_every_value_a_refused_hang_timeout_suggests_is_accepted(
    timeout: float, hang: object, from_environment: bool
) -> None:
    # Before: timeout=1 with hang_timeout=1 suggested "e.g. 0.2", and hang_timeout=0.5 with
    # timeout=0.5 suggested "hang_timeout=1 or more"; a negative, NaN or non-number value
    # suggested 60 whatever the timeout: each refused in turn.
    environ = {"DDPCTX_HANG_TIMEOUT": str(hang)} if from_environment and hang is not None else {}
    value = None if environ else hang
    name = "DDPCTX_HANG_TIMEOUT" if environ else "hang_timeout"
    try:
        resolve_hang_settings(value, "report", False, timeout, environ)
        return
    except ValueError as refused:
        message = str(refused)
    fix = message[message.index(". ", message.index(name)) :]  # after the first sentence
    suggested = [float(found) for found in re.findall(rf"{name}=([0-9.e+-]+)", fix)]
    assert suggested, message
    for found in suggested:
        again = {name: f"{found:g}"} if environ else {}
        settings = resolve_hang_settings(
            None if environ else found, "report", False, timeout, again
        )
        assert settings.hang_timeout == found


@pytest.mark.parametrize(
    ("timeout", "environ", "expected"),
    [(600.0, {}, 120.0), (3600.0, {}, 300.0), (600.0, {"DDPCTX_HANG_TIMEOUT": "0"}, 0.0)],
)
def test_the_default_hang_timeout_is_a_fifth_of_the_timeout_at_most_300(
    timeout: float, environ: dict[str, str], expected: float
) -> None:
    assert resolve_hang_settings(None, "report", False, timeout, environ).hang_timeout == expected


def test_bad_hang_options_leave_nothing_behind() -> None:
    with pytest.raises(ValueError, match="on_hang"), distributed(on_hang="never"):  # type: ignore[arg-type]
        pass
    assert not dist.is_initialized()
    assert dist.all_reduce is torch.distributed.distributed_c10d.all_reduce


states = st.builds(
    RankState,
    rank=st.just(0),
    op=st.one_of(st.none(), st.sampled_from(["barrier()", "all_reduce()", "DDP backward"])),
    waited=st.floats(0, 1000),
    site=st.sampled_from(["train.py:57 in main", "eval.py:30 in evaluate", "?"]),
    stack=st.just('  File "train.py", line 57, in main'),
    stalled=st.one_of(st.just(0.0), st.floats(2, 100)),
)


@given(st.lists(st.one_of(st.none(), states), min_size=1, max_size=6))
def test_a_report_has_a_headline_a_line_per_rank_a_diagnosis_and_the_stacks(
    answers: list[RankState | None],
) -> None:
    answers = [
        None if s is None else RankState(r, s.op, s.waited, s.site, s.stack, None, s.stalled)
        for r, s in enumerate(answers)
    ]
    lines = format_report(answers, 60).splitlines()
    assert lines[0].startswith("ddpctx hang report: no collective has completed for ")
    assert [line.split(":")[0].strip() for line in lines[1 : 1 + len(answers)]] == [
        f"rank {rank}" for rank in range(len(answers))
    ]
    diagnosis = lines[1 + len(answers)]
    assert diagnosis.startswith("diagnosis: ")
    assert lines.count("--- rank 0 ---") == (answers[0] is not None)
    # A rank that could not run just before it answered says so on its line, and only then;
    # the diagnosis blames a stall only when a waiting rank waited for a rank that had one.
    for rank, state in enumerate(answers):
        said = "in which it could not run" in lines[1 + rank]
        assert said == (state is not None and state.stalled > 0)
    if "could not run for" in diagnosis:
        came_back = [s for s in answers if s is not None and s.stalled]
        waiting = [s for s in answers if s is not None and s.op is not None]
        assert any(w.rank != s.rank for s in came_back for w in waiting)


def test_a_rank_that_could_not_run_and_then_answered_is_named_not_the_collective() -> None:
    # Found by the outside attack: rank 1 held the GIL for 6 s, answered once it came back,
    # as "waiting in barrier() (0 s)", and the diagnosis blamed the collective itself.
    states: list[RankState | None] = [
        RankState(0, "barrier()", 6.0, "train.py:9 in f", ""),
        RankState(1, "barrier()", 0.0, "train.py:9 in f", "", None, 6.8),  # a 6 s stall
    ]
    report = format_report(states, 3).splitlines()
    assert rank_line(report, 1).endswith("(0 s) after 6 s in which it could not run")
    assert report[3] == (
        "diagnosis: rank 1 could not run for 6 s while 1 rank waits for it (rank 0 in "
        "barrier()): it held the GIL in native code, was stopped (SIGSTOP, a debugger) or got "
        "no CPU, and answered once it ran again."
    )


# --- the example that hangs on purpose, and the guide's copy of its report ----------------


@pytest.mark.slow  # a torchrun job or a real hang timeout
def test_the_hang_example_reports_what_the_guide_shows_and_ends_the_job() -> None:
    result = run_torchrun(REPO / "examples" / "hang.py", nproc=2, timeout=150)
    assert result.returncode != 0
    produced = report_of(result.stderr.split("[rank")[0])
    guide = (REPO / "docs" / "guides" / "hang-doctor.md").read_text()
    shown = guide.split("```text\nddpctx hang report:", 1)[1].split("```", 1)[0]
    shown_lines = ("ddpctx hang report:" + shown).splitlines()

    def without_seconds(lines: list[str]) -> list[str]:
        return [re.sub(r"\d+ s\b", "N s", line) for line in lines]

    # The whole report, as the guide says ("verbatim"), up to the seconds waited (the
    # merged-whole attack found its folded-frames line two stops out of date).
    # (rank 1's line on leaving, printed after the report, is not in the guide's copy)
    assert without_seconds(produced[: len(shown_lines)]) == without_seconds(shown_lines)
    assert "diagnosis: ranks are in different collectives" in produced[3]
    # torchrun's summary names the root cause (its whole output shown if it does not)
    assert "Root Cause (first observed failure)" in result.stderr, result.stderr[-4000:]
    root_cause = result.stderr.split("Root Cause (first observed failure)", 1)[1]
    assert "HangError: ddpctx hang report:" in root_cause


def test_a_report_printed_earlier_is_appended_to_the_error_torchrun_shows(tmp_path: Path) -> None:
    from ddpctx.utils.errors import record_for_torchrun

    error_file = tmp_path / "error.json"
    record_for_torchrun(
        ValueError("bad"),
        {"TORCHELASTIC_ERROR_FILE": str(error_file)},
        note="ddpctx hang report: x",
    )
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message == "ValueError: bad\n\nddpctx hang report: x"


# --- per group and point to point ------------------------------------------------------------


def _labels_of_a_subgroup() -> tuple[str, tuple[int, ...] | None]:
    pair = dist.new_group([0, 2])  # every rank creates every group
    return describe("all_reduce()", pair)


def test_a_subgroup_collective_is_labelled_with_its_members(run_distributed: Any) -> None:
    assert (
        run_distributed(_labels_of_a_subgroup, world_size=3)
        == [("all_reduce() on ranks 0, 2", (0, 2))] * 3
    )


def test_a_rank_outside_the_hung_subgroup_is_not_called_stuck() -> None:
    states: list[RankState | None] = [
        RankState(0, "all_reduce() on ranks 0, 1", 5.0, "train.py:9 in f", "", [0, 1]),
        RankState(1, None, 0.0, "train.py:7 in f", ""),
        RankState(2, None, 0.0, "train.py:8 in f", ""),
    ]
    report = format_report(states, 2).splitlines()
    assert rank_line(report, 1).endswith("<- stuck here")
    assert rank_line(report, 2).endswith("train.py:8 in f")
    assert report[4] == (
        "diagnosis: rank 1 is not in any collective while 1 rank waits for it "
        "(rank 0 in all_reduce() on ranks 0, 1): it is stuck, or it took a branch the "
        "others did not."
    )


def test_a_rank_that_does_not_answer_is_named_with_how_long() -> None:
    states: list[RankState | None] = [None, RankState(1, "barrier()", 9.0, "t.py:3 in f", "")]
    report = format_report(states, 2, silent_for={0: 8.6}).splitlines()
    assert rank_line(report, 0).strip().startswith("rank 0: not answering for 9 s (it may hold")
    assert report[3].startswith("diagnosis: rank 0 is not answering while 1 rank waits for it")


@pytest.mark.parametrize(("collective_timeout", "expected"), [(2.0, 1.0), (1.0, 0.0), (0.5, 0.0)])
def test_a_short_collective_timeout_never_gets_a_default_hang_timeout_below_the_floor(
    collective_timeout: float, expected: float
) -> None:
    # Before: launch(timeout=2) derived hang_timeout=0.4 s and then refused its own default.
    settings = resolve_hang_settings(None, "report", False, collective_timeout, {})
    assert settings.hang_timeout == expected
