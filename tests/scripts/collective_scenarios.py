"""Every collective behaviour of issue "decorators and collectives", run on N real ranks.

Usage (one job runs them all): torchrun --nproc_per_node=N collective_scenarios.py OUT_DIR
Each rank writes OUT_DIR/rank<R>.json: {scenario: {"ok", "value" | "error", "type",
"message", "seconds"}}. Failing scenarios leave the group healthy, so the next runs.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddpctx import all_reduced, distributed, rank_zero_first, rank_zero_only
from ddpctx.rankzero import Outcome, Place, share

Pair = namedtuple("Pair", "first second")
SCENARIOS: dict[str, Callable[[int, int, Path], Any]] = {}
FOREIGN: dict[str, Callable[[int, int, Path], Any]] = {}


def scenario(table: dict[str, Callable[[int, int, Path], Any]]) -> Callable[..., Any]:
    def register(fn: Callable[[int, int, Path], Any]) -> Callable[[int, int, Path], Any]:
        table[fn.__name__] = fn
        return fn

    return register


def plain(value: Any) -> Any:
    """A JSON description of a reduced value: its type and its numbers."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return {"type": type(value).__name__, "items": [plain(v) for v in value]}
    if isinstance(value, torch.Tensor):
        return {"type": f"tensor:{value.dtype}:{value.device.type}", "value": value.tolist()}
    if isinstance(value, (np.ndarray, np.generic)):
        return {"type": f"{type(value).__name__}:{value.dtype}", "value": value.tolist()}
    if isinstance(value, float) and math.isnan(value):
        return {"type": "float", "value": "nan"}
    return {"type": type(value).__name__, "value": value}


class CountingAllReduce:
    """Counts calls to dist.all_reduce (the real one still runs)."""

    def __enter__(self) -> CountingAllReduce:
        self.calls = 0
        self.original = dist.all_reduce

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self.original(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self.original


@scenario(SCENARIOS)
def mean_of_floats(rank: int, world: int, tmp: Path) -> Any:
    return all_reduced(lambda: float(rank + 1))()


@scenario(SCENARIOS)
def every_op(rank: int, world: int, tmp: Path) -> Any:
    ops = {"m": "mean", "s": "sum", "hi": "max", "lo": "min", "p": "prod"}

    @all_reduced(op=ops)
    def metrics() -> dict[str, int]:
        return dict.fromkeys(ops, rank + 1)

    return metrics()


@scenario(SCENARIOS)
def single_op_for_everything(rank: int, world: int, tmp: Path) -> Any:
    return {
        op: all_reduced(op=op)(lambda: [float(rank + 1), 10.0 * (rank + 1)])()
        for op in ("sum", "max", "min", "prod")
    }


@scenario(SCENARIOS)
def weighted_mean(rank: int, world: int, tmp: Path) -> Any:
    # rank 0: 1 sample with loss 1; rank 1: 3 samples with mean loss 4;
    # rank 2 (if any): no samples at all. Weighted: (1*1 + 4*3) / 4 = 3.25.
    losses, counts = [1.0, 4.0, 10.0], [1, 3, 0]

    @all_reduced(weight="count")
    def evaluate() -> dict[str, Any]:
        return {"loss": torch.tensor(losses[rank]), "acc": losses[rank] / 10, "count": counts[rank]}

    return evaluate()


@scenario(SCENARIOS)
def zero_total_weight(rank: int, world: int, tmp: Path) -> Any:
    return all_reduced(weight="count")(lambda: {"loss": 0.0, "count": 0})()


@scenario(SCENARIOS)
def leaf_kinds_under_mean(rank: int, world: int, tmp: Path) -> Any:
    return all_reduced(lambda: leaves_of_every_kind(rank))()


@scenario(SCENARIOS)
def leaf_kinds_under_sum(rank: int, world: int, tmp: Path) -> Any:
    return all_reduced(op="sum")(lambda: leaves_of_every_kind(rank))()


def leaves_of_every_kind(rank: int) -> dict[str, Any]:
    return {
        "int": rank + 1,
        "float": rank + 0.5,
        "bool": rank == 0,
        "np_float32": np.float32(rank + 1),
        "np_int64": np.int64(rank + 1),
        "np_array": np.array([rank, 2 * rank]),
        "tensor_0d": torch.tensor(float(rank + 1)),
        "tensor_int": torch.tensor([rank, rank + 1]),
        "tensor_2d": torch.full((2, 2), float(rank)),
        "tensor_bool": torch.tensor(rank == 0),
    }


@scenario(SCENARIOS)
def nested_structures(rank: int, world: int, tmp: Path) -> Any:
    @all_reduced(weight="count", op={"lr": "max"})
    def metrics() -> dict[str, Any]:
        return {
            "train": {"loss": float(rank + 1), "count": 1},
            "val": {"loss": 2.0 * rank, "count": rank, "parts": [float(rank), Pair(rank, 1.0)]},
            "lr": (0.1, 0.2 * (rank + 1)),
        }

    return metrics()


@scenario(SCENARIOS)
def mismatch_same_length(rank: int, world: int, tmp: Path) -> Any:
    return all_reduced(lambda: {"loss": 1.0, "acc" if rank == 0 else "f1": 0.5})()


@scenario(SCENARIOS)
def mismatch_different_length(rank: int, world: int, tmp: Path) -> Any:
    big = {"loss": 1.0, "hist": torch.ones(500)}
    return all_reduced(lambda: {"loss": 1.0} if rank == 0 else big)()


@scenario(SCENARIOS)
def mismatch_shape(rank: int, world: int, tmp: Path) -> Any:
    return all_reduced(lambda: {"x": torch.zeros(2 + (rank > 0))})()


@scenario(SCENARIOS)
def non_numeric_leaf_on_one_rank(rank: int, world: int, tmp: Path) -> Any:
    return all_reduced(lambda: {"loss": 1.0, "tag": "best" if rank == world - 1 else 0.0})()


@scenario(SCENARIOS)
def exception_inside_on_one_rank(rank: int, world: int, tmp: Path) -> Any:
    @all_reduced
    def evaluate() -> float:
        if rank == 1:
            raise KeyError("validation shard missing")
        return 1.0

    return evaluate()


@scenario(SCENARIOS)
def collectives_per_call(rank: int, world: int, tmp: Path) -> Any:
    thirty_two = all_reduced(op={f"s{i}": "sum" for i in range(16)})(
        lambda: {
            **{f"m{i}": torch.tensor(1.0) for i in range(16)},
            **{f"s{i}": torch.tensor(2.0) for i in range(16)},
        }
    )
    with_max = all_reduced(op={"peak": "max"})(lambda: {"loss": 1.0, "peak": float(rank)})
    grows = all_reduced(lambda: torch.ones(1000) * rank)
    counts = {}
    for name, fn in (
        ("32 mean+sum", thirty_two),
        ("with max", with_max),
        ("1000 first call", grows),
        ("1000 second call", grows),
    ):
        with CountingAllReduce() as counter:
            result = fn()
        counts[name] = counter.calls
    counts["1000 value"] = float(result[0])
    return counts


@scenario(SCENARIOS)
def functional_all_reduce(rank: int, world: int, tmp: Path) -> Any:
    from ddpctx import current

    context = current()
    assert context is not None
    return context.all_reduce({"loss": float(rank), "count": rank + 1}, weight="count")


@scenario(SCENARIOS)
def barrier_failure_on_rank_zero(rank: int, world: int, tmp: Path) -> Any:
    @rank_zero_only(barrier=True)
    def save_checkpoint() -> None:
        raise OSError("disk full while writing checkpoint")

    save_checkpoint()


@scenario(SCENARIOS)
def broadcast_failure_on_rank_zero(rank: int, world: int, tmp: Path) -> Any:
    @rank_zero_only(broadcast=True)
    def choose_run_name() -> str:
        raise ValueError("no run name")

    return choose_run_name()


@scenario(SCENARIOS)
def broadcast_success(rank: int, world: int, tmp: Path) -> Any:
    return rank_zero_only(broadcast=True)(lambda: {"name": f"chosen-by-{rank}"})()


@scenario(SCENARIOS)
def plain_rank_zero_only(rank: int, world: int, tmp: Path) -> Any:
    return [rank_zero_only(lambda: "ran")(), rank_zero_only(default="skipped")(lambda: "ran")()]


@scenario(SCENARIOS)
def barrier_waits_for_rank_zero(rank: int, world: int, tmp: Path) -> Any:
    marker = tmp / "barrier-marker"

    @rank_zero_only(barrier=True)
    def slow_write() -> None:
        time.sleep(0.5)
        marker.write_text("written")

    slow_write()
    return marker.exists()


@scenario(SCENARIOS)
def rank_zero_first_order(rank: int, world: int, tmp: Path) -> Any:
    cache = tmp / "cache.txt"
    with rank_zero_first():
        if not cache.exists():
            time.sleep(0.3)
            cache.write_text(f"filled by {rank}")
        seen = cache.read_text()
    return seen


@scenario(SCENARIOS)
def rank_zero_first_failure(rank: int, world: int, tmp: Path) -> Any:
    with rank_zero_first():
        if rank == 0:
            raise RuntimeError("download failed")
    return "ran after rank 0"


@scenario(SCENARIOS)
def local_rank_zero_on_two_fake_nodes(rank: int, world: int, tmp: Path) -> Any:
    # Pretend ranks sit on nodes of two: node = rank // 2, local rank = rank % 2.
    place = Place(rank, world, rank % 2, rank // 2)
    mine = Outcome(True, f"node {rank // 2} value from rank {rank}") if rank % 2 == 0 else None
    outcome, source = share(mine, place, local=True)
    return [outcome.result(source), source]


@scenario(SCENARIOS)
def objects(rank: int, world: int, tmp: Path) -> Any:
    from ddpctx import current

    context = current()
    assert context is not None
    gathered = context.all_gather("x" * (1000 * rank))  # uneven sizes
    sent = context.broadcast({"from": rank, "tensor": torch.arange(3)}, src=world - 1)
    return {"lengths": [len(g) for g in gathered], "broadcast": sent}


@scenario(FOREIGN)
def foreign_group_decorators(rank: int, world: int, tmp: Path) -> Any:
    value = all_reduced(lambda: float(rank))()
    chosen = rank_zero_only(broadcast=True)(lambda: rank + 100)()
    return [value, chosen, rank_zero_only(lambda: "ran")()]


def run(table: dict[str, Callable[[int, int, Path], Any]], out: dict[str, Any], tmp: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, fn in table.items():
        dist.barrier()
        started = time.monotonic()
        try:
            value = fn(rank, world, tmp)
            record: dict[str, Any] = {"ok": True, "value": plain(value)}
        except Exception as error:
            record = {"ok": False, "type": type(error).__name__, "message": str(error)}
        record["seconds"] = time.monotonic() - started
        out[name] = record


def main() -> None:
    out_dir = Path(sys.argv[1])
    results: dict[str, Any] = {}
    dist.init_process_group("gloo")  # someone else's group first
    run(FOREIGN, results, out_dir)
    dist.destroy_process_group()
    with distributed(seed=0, timeout=30) as ctx:
        run(SCENARIOS, results, out_dir)
        (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
