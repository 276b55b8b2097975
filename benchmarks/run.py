"""ddpctx next to what users would otherwise pick, in one run, as ratios.

Run:  python benchmarks/run.py [--quick] [--world-size 2] [--write]
      python benchmarks/run.py --only reduction --sizes 32 --rounds 500 --calls 10

1. Metric reduction: dicts of 1, 8, 32, 128 scalar metrics and one 1M-element
   tensor -- one raw all_reduce (the floor), @all_reduced, a per-metric loop,
   Lightning Fabric's all_reduce on the dict, Accelerate's reduce
   (PartialState(cpu=True)), Ignite's idist.all_reduce per metric.
   Also a float32 tensor with integer counts ("mixed").
2. Training step: one small DDP model (ctx.wrap, torch's own DDP) and the same
   data, a hand-written loop (DataLoader + DistributedSampler, a raw
   all_reduce) vs ctx.dataloader / @all_reduced per step, synchronous and with
   async_op=True (each step's loss read one step later; torch's own async
   all_reduce as its reference), and the floor of what @all_reduced promises
   (a float64 sum, a new tensor back) in torch alone; the ddpctx loop also
   with the hang doctor on (hang_timeout=60) and in debug mode (debug=True).
   Each step's parts (next batch, model, metric) are timed too, and each
   block's main-thread CPU: every ratio comes with a 95% bootstrap interval,
   and a target is read as met, not met or unresolved by this run against it.
   2b: per-call CPU cost in one process, @all_reduced vs torch.stack(...).tolist().
3. Start-up and teardown: `with distributed()` vs init_process_group +
   destroy_process_group, one process and 2 ranks (under torchrun).
4. Import cost: `import ddpctx` (with its torch-using modules) vs `import torch`.
5. Test harness: per-test cost through the plugin's warm pool vs fresh
   processes per test (benchmarks/bench_harness.py).
6. Scaling: the 32-metric reduction at 2, 4 and 8 ranks (oversubscribed on 2 cores).

Contenders are interleaved round by round, in a new order each round (the same
on every rank), so machine noise and what one contender leaves behind hit
each alike; the tables show medians and ratios. Anchors that are not installed (extra
`bench`) are reported as missing; the rest still runs. `--write` regenerates
BENCHMARKS.md and benchmarks/reduction.png from this run.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
Samples = dict[str, dict[str, list[float]]]
SECTIONS = ("reduction", "training", "cpu", "startup", "harness", "scaling")
MIXED = "float32 tensor + int counts"


def _anchors() -> dict[str, Callable[[dict[str, torch.Tensor]], object] | str]:
    """Each anchor's reduction of a metrics dict, or why it is missing."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # read by their launch detection only
    os.environ.setdefault("MASTER_PORT", "29400")
    found: dict[str, Callable[[dict[str, torch.Tensor]], object] | str] = {}
    try:
        from lightning_fabric import Fabric

        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
        fabric = Fabric(accelerator=accelerator, strategy="ddp", devices=dist.get_world_size())
        fabric.launch()  # adopts the existing process group
        found["Fabric all_reduce(dict)"] = lambda m: fabric.all_reduce(m, reduce_op="mean")
    except ImportError:
        found["Fabric all_reduce(dict)"] = "not installed (pip install lightning-fabric)"
    try:
        from accelerate import PartialState
        from accelerate.utils import reduce

        PartialState(cpu=not torch.cuda.is_available())
        found["Accelerate reduce(dict)"] = lambda m: reduce(m, reduction="mean")
    except ImportError:
        found["Accelerate reduce(dict)"] = "not installed (pip install accelerate)"
    try:
        import ignite.distributed as idist

        def ignite(m: dict[str, torch.Tensor]) -> object:
            return {k: idist.all_reduce(v.clone()) for k, v in m.items()}

        found["Ignite all_reduce per metric"] = ignite
    except ImportError:
        found["Ignite all_reduce per metric"] = "not installed (pip install pytorch-ignite)"
    return found


def reduction_rank(sizes: list[str], rounds: int, calls: int, anchors: bool) -> Samples:
    """Runs on every rank (inside distributed()); per-call seconds per round, per contender."""
    import torch.distributed as dist

    from ddpctx import all_reduced, current

    ctx = current()
    assert ctx is not None
    contenders_by_size: dict[str, dict[str, Callable[[], object]]] = {}
    extra = _anchors() if anchors else {}
    for size in sizes:
        if size == "1M tensor":
            metrics = {"big": torch.randn(1_000_000, device=ctx.device)}
        elif size == MIXED:  # a float32 histogram and integer counts
            metrics = {
                "hist": torch.randn(1024, device=ctx.device),
                "correct": torch.tensor(7 + ctx.rank, device=ctx.device),
                "count": torch.tensor(64, device=ctx.device),
            }
        else:
            metrics = {
                f"m{i}": torch.tensor(float(i + ctx.rank), device=ctx.device)
                for i in range(int(size))
            }

        def floor(m: dict[str, torch.Tensor] = metrics) -> None:
            flat = torch.cat([v.reshape(-1).float() for v in m.values()])
            dist.all_reduce(flat)

        def loop(m: dict[str, torch.Tensor] = metrics) -> None:
            for value in m.values():
                dist.all_reduce(value.clone())

        contenders: dict[str, Callable[[], object]] = {
            "raw all_reduce, one buffer (floor)": floor,
            "ddpctx @all_reduced": all_reduced(lambda m=metrics: m),
            "all_reduce per metric (loop)": loop,
        }
        for name, anchor in extra.items():
            # Anchors take float metrics; a mean over integer counts is not what they do.
            if callable(anchor) and size != MIXED:
                contenders[name] = lambda m=metrics, a=anchor: a(m)
        contenders_by_size[size] = contenders
    samples: Samples = {size: {name: [] for name in c} for size, c in contenders_by_size.items()}
    for size, contenders in contenders_by_size.items():
        for fn in contenders.values():  # warm-up: buffers sized, connections hot
            for _ in range(3):
                fn()
        repeat = calls if size != "1M tensor" else max(2, calls // 10)
        for round_index in range(rounds):
            for name in round_order(list(contenders), round_index):
                fn = contenders[name]
                ctx.barrier()
                started = time.perf_counter()
                for _ in range(repeat):
                    fn()
                samples[size][name].append((time.perf_counter() - started) / repeat)
    missing = {name: reason for name, reason in extra.items() if isinstance(reason, str)}
    samples["_missing"] = {name: [] for name in missing}
    return samples


def round_order(names: list[str], round_index: int) -> list[str]:
    """The contenders' order in one round: shuffled anew each round, the same on every rank.

    A fixed order gives each contender the same predecessor every round (the floor always
    first after the barrier, the loop always after ddpctx): whatever one leaves behind --
    a rank still catching up, a warm cache -- lands on the same neighbour each time and
    the paired ratio inherits it.
    """
    order = list(names)
    random.Random(round_index).shuffle(order)  # seeded: the same order on every rank
    return order


PARTS = ("batch", "model", "metric")
#: The key of :func:`training_rank`'s result that holds the watchdog thread's times.
WATCHDOG = "watchdog thread"


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

    import torch.distributed as dist
    from torch import nn
    from torch.distributed import distributed_c10d
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from ddpctx import all_reduced, current
    from ddpctx.hang.inflight import Tracker, install
    from ddpctx.hang.lockstep import Lockstep
    from ddpctx.hang.settings import HangSettings
    from ddpctx.hang.watchdog import Watchdog

    ctx = current()
    assert ctx is not None
    clock, cpu_clock = time.perf_counter, time.thread_time
    data = TensorDataset(torch.randn(8192, 32), torch.randn(8192, 1))

    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1))

    # One model for every row, so that rows differ only in their loader and metric call
    # (ctx.wrap gives torch's own DDP: it adds nothing at precision "32").
    model = ctx.wrap(net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def model_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = x.to(ctx.device), y.to(ctx.device)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    def hand_metric(loss: torch.Tensor) -> None:
        reduced = loss.clone()
        dist.all_reduce(reduced)
        reduced /= dist.get_world_size()

    @all_reduced
    def step_loss(loss: torch.Tensor) -> torch.Tensor:
        return loss

    @all_reduced(async_op=True)
    def step_loss_async(loss: torch.Tensor) -> torch.Tensor:
        return loss

    pending: list[Any] = []

    def hand_async_metric(loss: torch.Tensor) -> None:
        reduced = loss.clone()
        pending.append((dist.all_reduce(reduced, async_op=True), reduced))
        if len(pending) > 1:  # the previous step's loss, one step later
            work, previous = pending.pop(0)
            work.wait()
            previous /= dist.get_world_size()

    def async_metric(loss: torch.Tensor) -> None:
        pending.append(step_loss_async(loss))
        if len(pending) > 1:  # log the previous step's loss, one step later
            pending.pop(0).result()

    # What @all_reduced promises for a loss, in torch alone (no checks, no handle): the
    # sum in float64, so the mean is rounded once, and a new tensor of the loss's dtype.
    def floor_metric(loss: torch.Tensor) -> None:
        summed = torch.full((1,), loss.item(), dtype=torch.float64)
        dist.all_reduce(summed)
        torch.scalar_tensor(summed.tolist()[0] / ctx.world_size, dtype=loss.dtype)

    def floor_async_metric(loss: torch.Tensor) -> None:
        summed = torch.full((1,), loss.item(), dtype=torch.float64)
        pending.append((dist.all_reduce(summed, async_op=True), summed))
        if len(pending) > 1:
            work, previous = pending.pop(0)
            work.wait()
            torch.scalar_tensor(previous.tolist()[0] / ctx.world_size, dtype=loss.dtype)

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
    rows: dict[str, tuple[Callable[[torch.Tensor], object], Callable[[], Callable[[], None]]]] = {
        "hand-written loop": (hand_metric, lambda: lambda: None),
        "hand-written loop, again": (hand_metric, lambda: lambda: None),
        "hand-written loop, async_op": (hand_async_metric, lambda: lambda: None),
        "floor of @all_reduced": (floor_metric, lambda: lambda: None),
        "floor of @all_reduced, async_op": (floor_async_metric, lambda: lambda: None),
        "ddpctx loop": (step_loss, lambda: lambda: None),
        "ddpctx loop, async_op": (async_metric, lambda: lambda: None),
        "ddpctx loop, hang doctor on": (
            step_loss,
            lambda: install(tracker, check=None, cuda=cuda),
        ),
        "ddpctx loop, debug=True": (
            step_loss,
            lambda: install(Tracker(), check=Lockstep(), cuda=cuda),
        ),
    }
    loaders: dict[str, Any] = {name: ctx.dataloader(data, 64, shuffle=True) for name in rows}
    hand_samplers: dict[str, DistributedSampler[Any]] = {
        name: DistributedSampler(data, seed=0) for name in rows if "hand" in name
    }
    for name, sampler in hand_samplers.items():
        loaders[name] = DataLoader(data, batch_size=64, sampler=sampler)
    epoch = -1
    batches: dict[str, Any] = {}
    left = 0  # blocks left in this epoch (every loader has the same number of batches)
    times: dict[str, dict[str, list[float]]] = {
        name: {part: [] for part in ("step", "cpu", *PARTS)} for name in rows
    }
    names = list(rows)
    for round_index in range(rounds + 2):  # two rounds of warm-up
        if left == 0:
            epoch += 1
            for sampler in hand_samplers.values():
                sampler.set_epoch(epoch)
            next(ctx.epochs(epoch + 1, start=epoch))  # set_epoch on ddpctx's loaders
            batches = {name: iter(loader) for name, loader in loaders.items()}
            left = len(loaders["hand-written loop"]) // block
        left -= 1
        order = names[:]
        random.Random(round_index).shuffle(order)  # seeded: the same order on every rank
        for name in order:
            metric, wrap = rows[name]
            unwrap = wrap()
            parts: list[tuple[float, float, float]] = []
            ctx.barrier()
            started, cpu_started = clock(), cpu_clock()
            for _ in range(block):
                t0 = clock()
                x, y = next(batches[name])
                t1 = clock()
                loss = model_step(x, y)
                t2 = clock()
                metric(loss)
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


def per_call_cpu(rounds: int, calls: int) -> dict[str, list[float]]:
    """Single process: @all_reduced on 32 0-d tensors vs torch.stack(...).tolist() of them.

    With one rank there is no collective: this is the CPU cost of packing,
    checking and unpacking, the floor a GPU user feels next to a 10-20 us
    NCCL all_reduce.
    """
    from ddpctx import all_reduced, distributed

    results: dict[str, list[float]] = {
        "torch.stack(...).tolist()": [],
        "torch.stack(...).unbind() (tensors back)": [],
        "ddpctx @all_reduced": [],
    }
    with distributed():
        metrics = {f"m{i}": torch.tensor(float(i)) for i in range(32)}
        contenders = {
            "torch.stack(...).tolist()": lambda: torch.stack(list(metrics.values())).tolist(),
            "torch.stack(...).unbind() (tensors back)": lambda: dict(
                zip(metrics, torch.stack(list(metrics.values())).unbind(0), strict=True)
            ),
            "ddpctx @all_reduced": all_reduced(lambda: metrics),
        }
        for fn in contenders.values():
            for _ in range(50):
                fn()
        for _ in range(rounds):
            for name, fn in contenders.items():
                started = time.perf_counter()
                for _ in range(calls):
                    fn()
                results[name].append((time.perf_counter() - started) / calls)
    return results


def _fresh_interpreter_seconds(code: str, rounds: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    runs = []
    for _ in range(rounds):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=env)
        runs.append(time.perf_counter() - started)
    return runs


def import_cost(rounds: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {"import torch": [], "import ddpctx (+ distributed)": []}
    for _ in range(rounds):  # interleaved
        results["import torch"] += _fresh_interpreter_seconds("import torch", 1)
        results["import ddpctx (+ distributed)"] += _fresh_interpreter_seconds(
            "import ddpctx; ddpctx.distributed", 1
        )
    return results


def startup_single(rounds: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    from ddpctx import distributed
    from ddpctx.session.group import loopback_gloo

    results: dict[str, list[float]] = {"raw init + destroy": [], "with distributed()": []}
    for _ in range(rounds):
        started = time.perf_counter()
        with loopback_gloo():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
        dist.destroy_process_group()
        results["raw init + destroy"].append(time.perf_counter() - started)
        started = time.perf_counter()
        with distributed():
            pass
        results["with distributed()"].append(time.perf_counter() - started)
    return results


def startup_torchrun(world_size: int, rounds: int) -> dict[str, float]:
    """Runs benchmarks/startup.py under torchrun; returns rank 0's medians."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world_size}",
        str(HERE / "startup.py"),
        str(rounds),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    output = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=300, check=True
    )
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^MEDIAN (.+?)=([0-9.e-]+)$", output.stdout, re.M)
    }


def script(name: str, *args: object, timeout: float = 600) -> str:
    """What ``benchmarks/<name> <args>`` prints, run with this interpreter."""
    command = [sys.executable, str(HERE / name), *map(str, args)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        command, capture_output=True, text=True, env=env, check=True, timeout=timeout
    ).stdout.strip()


def harness(tests: int, spawned: int) -> str:
    return script("bench_harness.py", "--tests", tests, "--spawned", spawned)


def cell(values: list[float], floor: list[float]) -> str:
    """``median ms (median of paired ratios)`` for one contender against the floor."""
    ratio = statistics.median(v / f for v, f in zip(values, floor, strict=True))
    return f"{statistics.median(values) * 1e3:.3f} ms ({ratio:.2f}x)"


def format_reduction(per_size: Samples) -> list[str]:
    lines = []
    sizes = [s for s in per_size if not s.startswith("_")]
    names = list(per_size[sizes[0]])
    header = (
        "| contender | "
        + " | ".join(f"{s} metric{'s' if s != '1' else ''}" if s.isdigit() else s for s in sizes)
        + " |"
    )
    lines += [header, "|---|" + "---:|" * len(sizes)]
    floor = "raw all_reduce, one buffer (floor)"
    for name in names:
        cells = [
            cell(per_size[size][name], per_size[size][floor]) if name in per_size[size] else "n/a"
            for size in sizes
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name in per_size.get("_missing", {}):
        lines.append(f"| {name} | " + " | ".join("missing" for _ in sizes) + " |")
    return lines


def plot(per_size: Samples, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [s for s in per_size if s.isdigit()]
    floor = "raw all_reduce, one buffer (floor)"
    figure, axis = plt.subplots(figsize=(7, 4))
    for name in per_size[counts[0]]:
        ratios = [
            statistics.median(
                v / f for v, f in zip(per_size[c][name], per_size[c][floor], strict=True)
            )
            for c in counts
        ]
        axis.plot([int(c) for c in counts], ratios, marker="o", label=name)
    axis.set(
        xscale="log",
        yscale="log",
        xlabel="scalar metrics per reduction",
        ylabel="time / one raw all_reduce",
        title="Reducing a metrics dict, 2 ranks, gloo (CPU)",
    )
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, sizes (3-4 min)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="regenerate BENCHMARKS.md")
    parser.add_argument(
        "--sizes",
        default="",
        help="comma-separated reduction sizes to run, e.g. 32 (default: all; not with --write)",
    )
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default: 25, quick 8)")
    parser.add_argument("--calls", type=int, default=0, help="calls per round (default: 40)")
    parser.add_argument(
        "--only",
        default="",
        help=f"comma-separated sections to run, of {','.join(SECTIONS)} (not with --write)",
    )
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    if only - set(SECTIONS):
        parser.error(f"--only {args.only}: unknown {sorted(only - set(SECTIONS))}; use {SECTIONS}")
    if (only or args.sizes or args.rounds or args.calls) and args.write:
        parser.error(
            "--only, --sizes, --rounds or --calls with --write would write a page unlike the "
            "others; drop one of them"
        )

    def want(section: str) -> bool:
        return not only or section in only

    from ddpctx import launch

    quick = args.quick
    sizes = ["1", "32", "128", "1M tensor", MIXED]
    if not quick:
        sizes.insert(1, "8")
    rounds, calls = (8, 20) if quick else (25, 40)
    rounds, calls = args.rounds or rounds, args.calls or calls
    if args.sizes:
        sizes = [size.strip() for size in args.sizes.split(",")]
    started = time.perf_counter()
    report: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        report.append(line)

    say(
        f"## Machine\n\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, torch {torch.__version__}, gloo on CPU; "
        f"{'quick' if quick else 'full'} run, {rounds} rounds.\n"
    )

    per_size: Samples = {}
    if want("reduction"):
        say(
            "## 1. Metric reduction\n\nMedian per call; in brackets the median of the per-round "
            "ratios to the floor. Targets for ddpctx: <= 1.3x at 1 metric, <= 1.1x at 32.\n"
        )
        per_size = launch(
            reduction_rank, sizes, rounds, calls, True, world_size=args.world_size, timeout=900
        )[0]
        for line in format_reduction(per_size):
            say(line)
    if want("training"):
        training_section(say, quick, args.world_size)
    if want("cpu"):
        cpu_section(say, quick)
    if want("startup"):
        startup_section(say, quick, args.world_size)
    if want("harness"):
        say("\n## 5. Test harness\n")
        say("```\n" + harness(30 if quick else 100, 3 if quick else 8) + "\n```")
        say(
            "torch's MultiProcessTestCase needs `expecttest` and torch's internal test "
            "package, which the CPU wheel here does not ship: not measured."
        )
    if want("scaling"):
        scaling_section(say, quick, rounds, calls)
    say(f"\nTotal benchmark time: {time.perf_counter() - started:.0f} s.")
    if args.write:
        plot(per_size, HERE / "reduction.png")
        accuracy = subprocess.run(
            [sys.executable, str(HERE / "accuracy.py")],
            capture_output=True,
            text=True,
            check=True,
            timeout=1800,
        ).stdout.strip()
        template = (HERE / "BENCHMARKS.template.md").read_text()
        page = template.replace("{{RESULTS}}", "\n".join(report))
        (REPO / "BENCHMARKS.md").write_text(page.replace("{{ACCURACY}}", accuracy))
        print("wrote BENCHMARKS.md and benchmarks/reduction.png")


def training_section(say: Callable[[str], None], quick: bool, world: int) -> None:
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


#: Resamples of the rounds behind a ratio's 95% interval.
RESAMPLES = 1000
#: The fewest that give a 95% interval: 2.5% of them is one resample.
MIN_RESAMPLES = 40


def median_interval(values: list[float], resamples: int = RESAMPLES) -> tuple[float, float, float]:
    """The median of ``values`` and a 95% bootstrap interval of it: ``(median, low, high)``.

    The rounds are resampled with replacement ``resamples`` times (seeded: the
    same page from the same times); the interval holds the middle 95% of the
    resampled medians, and always the median itself. It says how far this run's
    median could move had the machine's noise fallen otherwise, which is what a
    1% target is read against.
    """
    if not values:
        raise ValueError("median_interval() got no values; time at least one round")
    if resamples < MIN_RESAMPLES:
        raise ValueError(
            f"resamples={resamples} cannot give a 95% interval: 2.5% of the resampled "
            f"medians must be at least one; pass resamples >= {MIN_RESAMPLES}"
        )
    middle = float(statistics.median(values))
    draw = random.Random(0).choices
    medians = sorted(statistics.median(draw(values, k=len(values))) for _ in range(resamples))
    low, high = medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]
    return middle, min(low, middle), max(high, middle)


def verdict(low: float, high: float, target: float) -> str:
    """A target read against an interval: met, not met, or not resolved by this run."""
    if high <= target:
        return "met"
    if low > target:
        return "not met"
    return "unresolved"


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
        pairs = zip(rows[name][measure], rows[base][measure], strict=True)
        middle, low, high = median_interval([value / base_value for value, base_value in pairs])
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
        medians = {part: statistics.median(parts[part]) for part in PARTS}
        cells = " | ".join(f"{medians[part] * 1e6:.1f}" for part in PARTS)
        reference = references.get(name)
        if reference is None:
            lines.append(f"| {name} | {cells} | | |")
            continue
        base = rows[reference]
        added = sum(medians[part] - statistics.median(base[part]) for part in ("batch", "metric"))
        share = added / statistics.median(base["step"])
        lines.append(f"| {name} | {cells} | {added * 1e6:+.1f} µs ({share:+.2%}) | {reference} |")
    return lines


def cpu_section(say: Callable[[str], None], quick: bool) -> None:
    say("\n## 2b. Per-call CPU cost, one process, 32 scalar tensors (median)\n")
    cpu = per_call_cpu(10 if quick else 30, 200)
    bare = cpu["torch.stack(...).tolist()"]
    say("| | median per call | / stack + tolist (paired per round) |\n|---|---:|---:|")
    for name, times in cpu.items():
        paired_cpu = statistics.median(o / b for o, b in zip(times, bare, strict=True))
        target = "; target <= 2x" if name == "ddpctx @all_reduced" else ""
        say(f"| {name} | {statistics.median(times) * 1e6:.1f} us | {paired_cpu:.2f}x{target} |")


def startup_section(say: Callable[[str], None], quick: bool, world: int) -> None:
    say("\n## 3. Start-up and teardown (median)\n")
    single = startup_single(10 if quick else 30)
    ranks = startup_torchrun(world, 5 if quick else 15)
    say("| | raw init + destroy | with distributed() | ratio |\n|---|---:|---:|---:|")
    single_raw, single_ours = (
        statistics.median(single[k]) for k in ("raw init + destroy", "with distributed()")
    )
    say(
        f"| 1 process | {single_raw * 1e3:.1f} ms | {single_ours * 1e3:.1f} ms "
        f"| {single_ours / single_raw:.2f}x |"
    )
    say(
        f"| {world} ranks (torchrun) | {ranks['raw'] * 1e3:.1f} ms "
        f"| {ranks['ddpctx'] * 1e3:.1f} ms | "
        f"{ranks['ddpctx'] / ranks['raw']:.2f}x |"
    )

    say("\n## 4. Import cost (fresh interpreters, median)\n")
    imports = import_cost(3 if quick else 7)
    torch_import, ours_import = (statistics.median(imports[k]) for k in imports)
    say(
        f"`import torch` {torch_import:.2f} s; `import ddpctx; ddpctx.distributed` "
        f"{ours_import:.2f} s: {ours_import / torch_import:.2f}x (target <= 1.15x). "
        "`import ddpctx` alone does not import torch."
    )


def scaling_section(say: Callable[[str], None], quick: bool, rounds: int, calls: int) -> None:
    from ddpctx import launch

    say(f"\n## 6. Scaling: 32 metrics at more ranks (oversubscribed: {os.cpu_count()} cores)\n")
    say("| ranks | floor | ddpctx @all_reduced | per-metric loop |\n|---:|---:|---:|---:|")
    for world in [2, 4] if quick else [2, 4, 8]:
        scaled = launch(
            reduction_rank,
            ["32"],
            max(4, rounds // 2),
            calls // 2,
            False,
            world_size=world,
            timeout=900,
        )[0]["32"]
        floor = scaled["raw all_reduce, one buffer (floor)"]
        cells = [
            cell(scaled[k], floor)
            for k in (
                "raw all_reduce, one buffer (floor)",
                "ddpctx @all_reduced",
                "all_reduce per metric (loop)",
            )
        ]
        say(f"| {world} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
