"""Section 2 of ``run.py``: what a DDP training step pays for ddpctx, row by row, part by part.

Contract: :func:`training_rank` runs on every rank of a ``launch()`` job started
with ``DDPCTX_HANG_TIMEOUT=0`` (it starts the one watchdog itself) and returns
per row of :data:`ROWS` the seconds per step of each block (``"step"``, wall;
``"cpu"``, the main thread's) and of each step's :data:`PARTS`, and under
:data:`WATCHDOG` the watchdog thread's CPU and wall seconds over the run.
:func:`format_training` turns those times into the section's tables (each
ratio with its 95% interval and, against :data:`TRAINING_ROWS`' targets, a
verdict); :func:`training_section` launches the job, says the tables and
adds the whole-job doctor measurement of ``benchmarks/bench_doctor.py``.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.processes import script
from benchmarks.report import Say
from benchmarks.stats import median_interval, ratios, round_order, verdict
from benchmarks.workload import BATCH, FEATURES, active, loss_site, small_model, train_step

PARTS = ("batch", "model", "metric")
#: The key of :func:`training_rank`'s result that holds the watchdog thread's times.
WATCHDOG = "watchdog thread"
#: The rows, in the order they are reported, and the kind of metric call each makes.
ROWS = {
    "hand-written loop": "hand",
    "hand-written loop, again": "hand",
    "hand-written loop, async_op": "hand async",
    "floor of @all_reduced": "floor",
    "floor of @all_reduced, async_op": "floor async",
    "ddpctx loop": "ddpctx",
    "ddpctx loop, async_op": "ddpctx async",
    "ddpctx loop, hang doctor on": "ddpctx",
    "ddpctx loop, debug=True": "ddpctx",
}
#: A row's metric call (given the step's detached loss) and what installs its wrappers
#: (it returns what removes them).
Row = tuple[Callable[[torch.Tensor], object], Callable[[], Callable[[], None]]]


def _metrics(world_size: int, pending: list[Any]) -> dict[str, Callable[[torch.Tensor], object]]:
    """Each kind of row's loss reduction; the async ones leave their handles in ``pending``."""
    import torch.distributed as dist

    def hand_metric(loss: torch.Tensor) -> None:
        reduced = loss.clone()
        dist.all_reduce(reduced)
        reduced /= dist.get_world_size()

    def hand_async_metric(loss: torch.Tensor) -> None:
        reduced = loss.clone()
        pending.append((dist.all_reduce(reduced, async_op=True), reduced))
        if len(pending) > 1:  # the previous step's loss, one step later
            work, previous = pending.pop(0)
            work.wait()
            previous /= dist.get_world_size()

    step_loss_async = loss_site(async_op=True)

    def async_metric(loss: torch.Tensor) -> None:
        pending.append(step_loss_async(loss))
        if len(pending) > 1:  # log the previous step's loss, one step later
            pending.pop(0).result()

    # What @all_reduced promises for a loss, in torch alone (no checks, no handle): the
    # sum in float64, so the mean is rounded once, and a new tensor of the loss's dtype.
    def floor_metric(loss: torch.Tensor) -> None:
        summed = torch.full((1,), loss.item(), dtype=torch.float64)
        dist.all_reduce(summed)
        torch.scalar_tensor(summed.tolist()[0] / world_size, dtype=loss.dtype)

    def floor_async_metric(loss: torch.Tensor) -> None:
        summed = torch.full((1,), loss.item(), dtype=torch.float64)
        pending.append((dist.all_reduce(summed, async_op=True), summed))
        if len(pending) > 1:
            work, previous = pending.pop(0)
            work.wait()
            torch.scalar_tensor(previous.tolist()[0] / world_size, dtype=loss.dtype)

    return {
        "hand": hand_metric,
        "hand async": hand_async_metric,
        "floor": floor_metric,
        "floor async": floor_async_metric,
        "ddpctx": loss_site(),
        "ddpctx async": async_metric,
    }


def training_rank(rounds: int, block: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per training step: a hand-written DDP loop vs the same loop through ddpctx.

    The rows take turns in blocks of ``block`` steps (``rounds`` rounds, in a
    new random order each round, the same on every rank: a fixed rotation
    would give each row the same predecessor every round). Per row:
    ``"step"``, the wall time of each block over its steps (with an async
    row's last result read in it), ``"cpu"``, the main thread's CPU time of
    the block over its steps (where ddpctx's own work runs; a wait in a
    collective costs none, and neither does time the machine gives to other
    processes), and the time of each step's parts:
    ``"batch"`` (the loader's next batch), ``"model"`` (to device, forward,
    backward, optimizer step) and ``"metric"`` (the loss reduction; for
    async, issuing it and reading the previous step's result). The parts are
    short, so their medians hold still where the whole step's moves by +-5%
    from run to run on 2 cores. The hang doctor's watchdog thread is started
    once, for the whole run, as ``distributed()`` starts it once per job: every
    row runs beside it. Its wrappers of the collectives, of the backward and
    of DDP's forward are installed for the doctor row's blocks only, and
    debug mode's (with their lockstep check) for the debug row's. The thread's
    own CPU time over the run comes back under :data:`WATCHDOG` (``"cpu"`` and
    ``"wall"``, seconds): the doctor's cost is its wrappers' ratio plus that.
    ``"hand-written loop, again"`` is the first row once more: its ratio to
    the first is what this machine's noise alone gives a ratio in the same run.
    The two ``"floor of @all_reduced"`` rows do in torch alone what
    ``@all_reduced`` promises for a loss (a float64 sum, so the mean is
    rounded once, and a new tensor of the loss's dtype back), without its
    checks or handle: the ddpctx rows' distance from them is the engine's own.
    """
    from torch.distributed import distributed_c10d
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from ddpctx.hang.inflight import Tracker, install
    from ddpctx.hang.lockstep import Lockstep
    from ddpctx.hang.settings import HangSettings
    from ddpctx.hang.watchdog import Watchdog

    ctx = active()
    clock, cpu_clock = time.perf_counter, time.thread_time
    data = TensorDataset(torch.randn(8192, FEATURES), torch.randn(8192, 1))
    # One model for every row, so that rows differ only in their loader and metric call
    # (ctx.wrap gives torch's own DDP: it adds nothing at precision "32").
    model = ctx.wrap(small_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    pending: list[Any] = []
    metric = _metrics(ctx.world_size, pending)

    # The ranks run with DDPCTX_HANG_TIMEOUT=0: one watchdog for the run, started here,
    # and the doctor's wrappers (debug mode's: with the lockstep check) around their rows.
    tracker = Tracker()
    threads = set(threading.enumerate())
    watchdog = Watchdog(
        HangSettings(60.0, "report", False),
        tracker,
        distributed_c10d._get_default_store(),
        ctx.rank,
        ctx.world_size,
    ).start()
    (thread,) = set(threading.enumerate()) - threads
    assert thread.ident is not None
    thread_clock = time.pthread_getcpuclockid(thread.ident)
    watched_from, watched_cpu = clock(), time.clock_gettime(thread_clock)
    cuda = ctx.device.type == "cuda"

    def bare() -> Callable[[], None]:
        return lambda: None

    wrappers: dict[str, Callable[[], Callable[[], None]]] = {
        "ddpctx loop, hang doctor on": lambda: install(tracker, check=None, cuda=cuda),
        "ddpctx loop, debug=True": lambda: install(Tracker(), check=Lockstep(), cuda=cuda),
    }
    rows: dict[str, Row] = {
        name: (metric[kind], wrappers.get(name, bare)) for name, kind in ROWS.items()
    }
    loaders: dict[str, Any] = {name: ctx.dataloader(data, BATCH, shuffle=True) for name in rows}
    hand_samplers: dict[str, DistributedSampler[Any]] = {
        name: DistributedSampler(data, seed=0) for name in rows if "hand" in name
    }
    for name, sampler in hand_samplers.items():
        loaders[name] = DataLoader(data, batch_size=BATCH, sampler=sampler)
    epoch = -1
    batches: dict[str, Any] = {}
    left = 0  # blocks left in this epoch (every loader has the same number of batches)
    times: dict[str, dict[str, list[float]]] = {
        name: {part: [] for part in ("step", "cpu", *PARTS)} for name in rows
    }
    for round_index in range(rounds + 2):  # two rounds of warm-up
        if left == 0:
            epoch += 1
            for sampler in hand_samplers.values():
                sampler.set_epoch(epoch)
            next(ctx.epochs(epoch + 1, start=epoch))  # set_epoch on ddpctx's loaders
            batches = {name: iter(loader) for name, loader in loaders.items()}
            left = len(loaders["hand-written loop"]) // block
        left -= 1
        for name in round_order(list(rows), round_index):
            reduce_loss, wrap = rows[name]
            unwrap = wrap()
            parts: list[tuple[float, float, float]] = []
            ctx.barrier()
            started, cpu_started = clock(), cpu_clock()
            for _ in range(block):
                t0 = clock()
                x, y = next(batches[name])
                t1 = clock()
                loss = train_step(model, optimizer, x.to(ctx.device), y.to(ctx.device)).detach()
                t2 = clock()
                reduce_loss(loss)
                parts.append((t1 - t0, t2 - t1, clock() - t2))
            for handle in pending:
                handle[0].wait() if isinstance(handle, tuple) else handle.result()
            pending.clear()
            elapsed, cpu_elapsed = clock() - started, cpu_clock() - cpu_started
            unwrap()
            if round_index >= 2:
                times[name]["step"].append(elapsed / block)
                times[name]["cpu"].append(cpu_elapsed / block)
                for part, values in zip(PARTS, zip(*parts, strict=True), strict=True):
                    times[name][part] += values
    cpu = time.clock_gettime(thread_clock) - watched_cpu
    wall = clock() - watched_from
    watchdog.stop()
    times[WATCHDOG] = {"cpu": [cpu], "wall": [wall]}
    return times


#: Each row's reference and target (None: no target) in the training tables.
TRAINING_ROWS: tuple[tuple[str, str, float | None, str], ...] = (
    ("hand-written loop, again", "hand-written loop", None, "the noise of a ratio"),
    ("hand-written loop, async_op", "hand-written loop", None, "torch's own, read a step later"),
    ("floor of @all_reduced", "hand-written loop", None, "float64 sum, tensor back, in torch"),
    ("floor of @all_reduced, async_op", "hand-written loop, async_op", None, "the same, async"),
    ("ddpctx loop", "hand-written loop", 1.03, ""),
    ("ddpctx loop, async_op", "hand-written loop, async_op", 1.01, ""),
    # its wrappers around its blocks; its thread's share (run-long) is added to the ratios
    ("ddpctx loop, hang doctor on", "ddpctx loop", 1.01, "wrappers + thread (below)"),
    ("ddpctx loop, debug=True", "ddpctx loop", 1.10, ""),
)


def format_training(
    training: dict[str, dict[str, list[float]]], rounds: int, block: int
) -> list[str]:
    """The section's tables from :func:`training_rank`'s times."""
    lines: list[str] = []
    watched = training[WATCHDOG]
    # The thread's CPU as a share of the run's wall time: at most what it takes from a step
    # (all of it from the main thread, none from idle time: an upper bound), run-long.
    thread_share = watched["cpu"][0] / watched["wall"][0]
    rows = {name: times for name, times in training.items() if name != WATCHDOG}

    def ratio(name: str, base: str, measure: str) -> tuple[float, float, float]:
        # paired within a round: the two blocks ran next to each other, so the
        # machine's drift over the run cancels, as in section 1
        middle, low, high = median_interval(ratios(rows[name][measure], rows[base][measure]))
        if name == "ddpctx loop, hang doctor on":
            middle, low, high = middle + thread_share, low + thread_share, high + thread_share
        # as printed: a verdict read from unrounded ends could contradict the page
        return round(middle, 3), round(low, 3), round(high, 3)

    lines.append(
        f"{rounds} rounds of {block} steps per row, the rows taking turns block by block in "
        "a new random order each round. *Step*: wall time per step. *CPU*: the main "
        "thread's CPU time per step, where ddpctx's own work runs (a wait in a collective "
        "costs none, nor does time the machine gives to other processes). Ratios: the "
        "median over rounds of the row's block to its reference's block in the same round "
        "(paired, as in section 1), with its 95% bootstrap interval in brackets. A target "
        "is *met* when the interval lies at or under it, *not met* when the interval lies "
        "over it, *unresolved* when the interval holds it.\n"
    )
    lines.append(
        "| loop | step | CPU | reference | step ratio [95%] | CPU ratio [95%] | target: step; CPU |"
        "\n|---|---:|---:|---|---:|---:|---|"
    )
    medians = {
        name: (statistics.median(times["step"]) * 1e3, statistics.median(times["cpu"]) * 1e3)
        for name, times in rows.items()
    }
    step, cpu = medians["hand-written loop"]
    lines.append(f"| hand-written loop | {step:.3f} ms | {cpu:.3f} ms | | 1.000x | 1.000x | |")
    for name, reference, target, note in TRAINING_ROWS:
        cells = []
        verdicts = []
        for measure in ("step", "cpu"):
            middle, low, high = ratio(name, reference, measure)
            cells.append(f"{middle:.3f}x [{low:.3f}, {high:.3f}]")
            if target is not None:
                verdicts.append(verdict(low, high, target))
        goal = f"<= {target:.2f}x: {'; '.join(verdicts)}" if target is not None else ""
        goal = f"{goal}; {note}" if goal and note else goal or note
        step, cpu = medians[name]
        lines.append(
            f"| {name} | {step:.3f} ms | {cpu:.3f} ms | {reference} | {cells[0]} | {cells[1]} "
            f"| {goal} |"
        )
    lines.append(
        f"\nThe hang doctor's row: its wrappers' ratio over the blocks it ran plus its watchdog "
        f"thread's share, {thread_share:.4%} (the thread, started once as `distributed()` "
        f"starts it, ran beside every row: {watched['cpu'][0] * 1e3:.1f} ms of CPU in "
        f"{watched['wall'][0]:.1f} s of this rank's run). Debug mode adds a 2-number "
        "all-gather before each collective.\n"
    )
    lines.append(
        "Where a step's time goes: the median of each part over all steps, in µs. *Added* is "
        "what the row's batch and metric parts cost over those of the row it is compared "
        "with, as a share of that row's median step (the model part is the same code in "
        "every row, within noise).\n"
    )
    lines.append("| loop | batch | model | metric | added | to |\n|---|---:|---:|---:|---:|---|")
    # torch's async loop has no reference here: its model part holds the collective's wait
    references = {
        name: reference
        for name, reference, _, _ in TRAINING_ROWS
        if name != "hand-written loop, async_op"
    }
    for name, parts in rows.items():
        part_medians = {part: statistics.median(parts[part]) for part in PARTS}
        part_cells = " | ".join(f"{part_medians[part] * 1e6:.1f}" for part in PARTS)
        compared = references.get(name)
        if compared is None:
            lines.append(f"| {name} | {part_cells} | | |")
            continue
        base = rows[compared]
        added = sum(
            part_medians[part] - statistics.median(base[part]) for part in ("batch", "metric")
        )
        share = added / statistics.median(base["step"])
        lines.append(
            f"| {name} | {part_cells} | {added * 1e6:+.1f} µs ({share:+.2%}) | {compared} |"
        )
    return lines


def training_section(say: Say, quick: bool, world: int) -> None:
    """Section 2: :func:`training_rank`'s tables, then the doctor as users run it (whole jobs)."""
    from ddpctx import launch

    say("\n## 2. Training step overhead (median seconds per step)\n")
    rounds, block = (100, 4) if quick else (1000, 4)
    os.environ["DDPCTX_HANG_TIMEOUT"] = "0"  # the doctor is timed on its own rows
    try:
        training = launch(training_rank, rounds, block, world_size=world, timeout=900)[0]
    finally:
        del os.environ["DDPCTX_HANG_TIMEOUT"]
    for line in format_training(training, rounds, block):
        say(line)
    # Whole jobs too, the doctor off and on (noisier: jobs differ by more than rounds do).
    pairs, steps = (2, 300) if quick else (10, 1500)
    jobs = script("bench_doctor.py", "--jobs", pairs, "--steps", steps, timeout=1800)
    say(
        f"The hang doctor as users run it, started once per job "
        f"(`benchmarks/bench_doctor.py --jobs {pairs} --steps {steps}`: {pairs} pairs of "
        f"2-rank torchrun jobs, doctor off and on in turn, {steps} timed steps each; "
        "target <= 1.01x):\n\n```\n" + jobs + "\n```"
    )
