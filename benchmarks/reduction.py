"""Sections 1 and 6 of ``run.py``: reducing a metrics dict, ddpctx vs the floor and the anchors.

Contract: :func:`reduction_rank` runs on every rank of a ``launch()`` job and
returns, per size and per contender, the seconds per call of each round
(contenders in :func:`~benchmarks.stats.round_order`, a barrier before each
one's calls); the anchors that are not installed come back by name under
``"_missing"``. :func:`format_reduction` makes section 1's table of those
samples, :func:`plot` ``benchmarks/reduction.png``; :func:`reduction_section`
and :func:`scaling_section` launch the jobs and say the sections' markdown.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.report import Say
from benchmarks.stats import cell, paired_ratio, per_call, round_order
from benchmarks.workload import active

#: Per size, per contender: the seconds per call of each round.
Samples = dict[str, dict[str, list[float]]]
MIXED = "float32 tensor + int counts"
FLOOR = "raw all_reduce, one buffer (floor)"
OURS = "ddpctx @all_reduced"
LOOP = "all_reduce per metric (loop)"
Anchor = Callable[[dict[str, torch.Tensor]], object]


def default_sizes(quick: bool) -> list[str]:
    """The sizes section 1 runs: scalar-metric counts, a 1M-element tensor and :data:`MIXED`."""
    sizes = ["1", "32", "128", "1M tensor", MIXED]
    if not quick:
        sizes.insert(1, "8")
    return sizes


def _anchors() -> dict[str, Anchor | str]:
    """Each anchor's reduction of a metrics dict, or why it is missing."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # read by their launch detection only
    os.environ.setdefault("MASTER_PORT", "29400")
    found: dict[str, Anchor | str] = {}
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


def _metrics(size: str, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """One size's metrics dict on this rank."""
    if size == "1M tensor":
        return {"big": torch.randn(1_000_000, device=device)}
    if size == MIXED:  # a float32 histogram and integer counts
        return {
            "hist": torch.randn(1024, device=device),
            "correct": torch.tensor(7 + rank, device=device),
            "count": torch.tensor(64, device=device),
        }
    return {f"m{i}": torch.tensor(float(i + rank), device=device) for i in range(int(size))}


def _contenders(metrics: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    """The floor, ddpctx and the per-metric loop, each reducing ``metrics``."""
    import torch.distributed as dist

    from ddpctx import all_reduced

    def floor() -> None:
        flat = torch.cat([v.reshape(-1).float() for v in metrics.values()])
        dist.all_reduce(flat)

    def loop() -> None:
        for value in metrics.values():
            dist.all_reduce(value.clone())

    return {FLOOR: floor, OURS: all_reduced(lambda: metrics), LOOP: loop}


def reduction_rank(sizes: list[str], rounds: int, calls: int, anchors: bool) -> Samples:
    """Runs on every rank (inside distributed()); per-call seconds per round, per contender."""
    ctx = active()
    contenders_by_size: dict[str, dict[str, Callable[[], object]]] = {}
    extra = _anchors() if anchors else {}
    for size in sizes:
        metrics = _metrics(size, ctx.rank, ctx.device)
        contenders = _contenders(metrics)
        for name, anchor in extra.items():
            # Anchors take float metrics; a mean over integer counts is not what they do.
            if callable(anchor) and size != MIXED:
                contenders[name] = lambda m=metrics, a=anchor: a(m)  # type: ignore[misc]
        contenders_by_size[size] = contenders
    samples: Samples = {size: {name: [] for name in c} for size, c in contenders_by_size.items()}
    for size, contenders in contenders_by_size.items():
        for fn in contenders.values():  # warm-up: buffers sized, connections hot
            for _ in range(3):
                fn()
        repeat = calls if size != "1M tensor" else max(2, calls // 10)
        for round_index in range(rounds):
            for name in round_order(list(contenders), round_index):
                ctx.barrier()
                samples[size][name].append(per_call(contenders[name], repeat))
    missing = {name: reason for name, reason in extra.items() if isinstance(reason, str)}
    samples["_missing"] = {name: [] for name in missing}
    return samples


def format_reduction(per_size: Samples) -> list[str]:
    """Section 1's table: per contender and size, the median per call and the paired ratio."""
    lines = []
    sizes = [s for s in per_size if not s.startswith("_")]
    names = list(per_size[sizes[0]])
    header = (
        "| contender | "
        + " | ".join(f"{s} metric{'s' if s != '1' else ''}" if s.isdigit() else s for s in sizes)
        + " |"
    )
    lines += [header, "|---|" + "---:|" * len(sizes)]
    for name in names:
        cells = [
            cell(per_size[size][name], per_size[size][FLOOR]) if name in per_size[size] else "n/a"
            for size in sizes
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name in per_size.get("_missing", {}):
        lines.append(f"| {name} | " + " | ".join("missing" for _ in sizes) + " |")
    return lines


def plot(per_size: Samples, path: Path) -> None:
    """The paired ratios to the floor against the number of scalar metrics, log-log, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [s for s in per_size if s.isdigit()]
    figure, axis = plt.subplots(figsize=(7, 4))
    for name in per_size[counts[0]]:
        paired = [paired_ratio(per_size[c][name], per_size[c][FLOOR]) for c in counts]
        axis.plot([int(c) for c in counts], paired, marker="o", label=name)
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


def reduction_section(say: Say, sizes: list[str], rounds: int, calls: int, world: int) -> Samples:
    """Section 1 at ``world`` ranks, with the anchors; its samples, for the plot."""
    from ddpctx import launch

    say(
        "## 1. Metric reduction\n\nMedian per call; in brackets the median of the per-round "
        "ratios to the floor. Targets for ddpctx: <= 1.3x at 1 metric, <= 1.1x at 32.\n"
    )
    per_size: Samples = launch(
        reduction_rank, sizes, rounds, calls, True, world_size=world, timeout=900
    )[0]
    for line in format_reduction(per_size):
        say(line)
    return per_size


def scaling_section(say: Say, quick: bool, rounds: int, calls: int) -> None:
    """Section 6: the 32-metric reduction at 2, 4 (and 8) ranks, without the anchors."""
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
        cells = [cell(scaled[k], scaled[FLOOR]) for k in (FLOOR, OURS, LOOP)]
        say(f"| {world} | " + " | ".join(cells) + " |")
