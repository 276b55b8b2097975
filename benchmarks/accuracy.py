"""How close reductions come to the exact answer: ddpctx and the anchors, element by element.

Run:  python benchmarks/accuracy.py [--elements 4096] [--world-sizes 2 3]

Every rank draws seeded random tensors (float16, bfloat16, float32, float64,
and int64 values past 2**53); each contender reduces them ("sum" and
"mean"); the reference is computed from every rank's values, gathered with
``all_gather_object``, exactly (``math.fsum`` / Python ints) and then rounded
once to the dtype. The table gives, per contender and dtype, the share of
elements that differ from that correctly rounded reference, and the largest
difference in units of the result's last place (ulp; large where the ranks'
values nearly cancel). ddpctx is also run on the first 64 values as separate
0-d tensors (a metrics dict), which travel as float64. Lightning Fabric,
Accelerate and Ignite (the ``bench`` extra) are reported as missing when not
installed.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

import torch

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int64 > 2**53": torch.int64,
}
#: Also reduced as 64 separate 0-d tensors (a metrics dict): small leaves travel as float64.
SCALARS = 64
OPS = ("sum", "mean")
Reducer = Callable[[torch.Tensor, str], torch.Tensor]


def contenders() -> dict[str, Reducer | str]:
    """Each contender's reduction of one tensor, or why it is missing."""
    import torch.distributed as dist

    from ddpctx import current

    ctx = current()
    assert ctx is not None
    found: dict[str, Reducer | str] = {
        "ddpctx ctx.all_reduce": lambda t, op: ctx.all_reduce(t, op=op),
    }

    def raw(t: torch.Tensor, op: str) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out)
        return out / dist.get_world_size() if op == "mean" else out

    found["raw all_reduce (own dtype)"] = raw
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29400")
    try:
        from lightning_fabric import Fabric

        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=dist.get_world_size())
        fabric.launch()
        found["Fabric all_reduce"] = lambda t, op: fabric.all_reduce(t.clone(), reduce_op=op)
    except ImportError:
        found["Fabric all_reduce"] = "missing (pip install lightning-fabric)"
    try:
        from accelerate import PartialState
        from accelerate.utils import reduce

        PartialState(cpu=True)
        found["Accelerate reduce"] = lambda t, op: reduce(t.clone(), reduction=op)
    except ImportError:
        found["Accelerate reduce"] = "missing (pip install accelerate)"
    try:
        import ignite.distributed as idist

        def ignite(t: torch.Tensor, op: str) -> torch.Tensor:
            out = idist.all_reduce(t.clone())
            return out / idist.get_world_size() if op == "mean" else out

        found["Ignite all_reduce"] = ignite
    except ImportError:
        found["Ignite all_reduce"] = "missing (pip install pytorch-ignite)"
    return found


def draw(dtype: torch.dtype, elements: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + rank)
    if dtype == torch.int64:
        return torch.randint(2**53, 2**60, (elements,), generator=generator)
    return (torch.randn(elements, generator=generator, dtype=torch.float64) * 100).to(dtype)


def exact(columns: list[list[Any]], op: str, dtype: torch.dtype, world: int) -> torch.Tensor:
    """The exact reduction per element, rounded once to ``dtype``."""
    if dtype == torch.int64:
        sums = [sum(column) for column in columns]
        if op == "sum":
            return torch.tensor(sums, dtype=torch.int64)
        return torch.tensor([s / world for s in sums], dtype=torch.float64)
    totals = [math.fsum(column) for column in columns]
    if op == "mean":  # fsum is exact to float64; one more correctly rounded division
        totals = [t / world for t in totals]
    return torch.tensor(totals, dtype=torch.float64).to(dtype)


MANTISSA_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


def ulps(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(share of elements that differ, largest difference in ulps of ``want``'s dtype)."""
    bits = MANTISSA_BITS.get(want.dtype)
    got, want = got.to(torch.float64), want.to(torch.float64)
    differ = got != want
    if not differ.any():
        return 0.0, 0.0
    if bits is None:  # integers: one unit
        spacing = torch.ones_like(want)
    else:
        _, exponent = torch.frexp(want)
        spacing = torch.ldexp(torch.ones_like(want), exponent - bits)
    return differ.double().mean().item(), ((got - want).abs() / spacing).max().item()


def rank_main(elements: int) -> list[tuple[str, str, str, str]]:
    """Runs on every rank; returns rows (contender, dtype, op, cell) from rank 0's view."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    found = contenders()
    rows = []
    for dtype_name, dtype in DTYPES.items():
        mine = draw(dtype, elements, rank)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine.tolist())
        columns = [list(column) for column in zip(*everyone, strict=True)]
        for op in OPS:
            want = exact(columns, op, dtype if op == "sum" else _mean_dtype(dtype), world)
            for name, reducer in found.items():
                if isinstance(reducer, str):
                    rows.append((name, dtype_name, op, reducer))
                    continue
                try:
                    got = reducer(mine, op)
                    if name.startswith("ddpctx") and dtype.is_floating_point:
                        scalars = {f"m{i}": x for i, x in enumerate(mine[:SCALARS].unbind(0))}
                        reduced = torch.stack(list(reducer(scalars, op).values()))  # type: ignore[arg-type]
                        share, worst = ulps(reduced, want[:SCALARS])
                        rows.append(
                            (
                                f"{name}, {SCALARS} 0-d tensors",
                                dtype_name,
                                op,
                                f"{share:.1%} ({worst:.1f} ulp)",
                            )
                        )
                    share, worst = ulps(torch.as_tensor(got).reshape(-1), want)
                    cell = f"{share:.1%} ({worst:.1f} ulp)"
                except Exception as error:  # an anchor that refuses this dtype
                    cell = f"refused: {type(error).__name__}"
                rows.append((name, dtype_name, op, cell))
    return rows


def _mean_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.get_default_dtype() if not dtype.is_floating_point else dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=4096)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()

    from ddpctx import launch

    tables = {
        w: launch(rank_main, args.elements, world_size=w, timeout=900)[0] for w in args.world_sizes
    }
    print(
        f"## Accuracy: share of elements not equal to the correctly rounded exact result "
        f"(largest error in ulps), {args.elements} elements per rank\n"
    )
    header = " | ".join(f"{w} ranks" for w in args.world_sizes)
    print(f"| contender | dtype | op | {header} |")
    print("|---|---|---|" + "---:|" * len(args.world_sizes))
    first = tables[args.world_sizes[0]]
    for index, (name, dtype_name, op, _) in enumerate(first):
        cells = " | ".join(tables[w][index][3] for w in args.world_sizes)
        print(f"| {name} | {dtype_name} | {op} | {cells} |")


if __name__ == "__main__":
    main()
