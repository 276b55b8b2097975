"""Property-based differential tests of the reduction engine, on 2 and 3 real ranks.

Hypothesis draws a result structure (every leaf kind and dtype, a per-key
op), and values for every rank; each rank reduces its own values and compares
the result with a reference computed from every rank's values, gathered with
``all_gather_object``: exact integers (wrapped in the leaf's own integer
dtype, as torch and NumPy wrap), float64 for floats, NaN wherever any rank
has one under max/min. Floating leaves travel in their own dtype, so the
tolerance is that dtype's rounding over the ranks (a few ulps); integers
must match exactly.

The examples are derandomized (the same on every rank and in every run) and
the pass/fail of each example is agreed across ranks, so ranks never fall
out of step.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ddpctx import DistContext

RANKS = pytest.mark.distributed(world_size=[2, 3], timeout=120)
MAX_RANKS = 3
SETTINGS = settings(
    max_examples=60,
    derandomize=True,
    database=None,
    deadline=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
)

# kind -> (how to make the leaf from a list of numbers, integer?, float dtype for tolerance)
KINDS: dict[str, tuple[Any, bool, Any]] = {
    "py_float": (lambda xs: float(xs[0]), False, np.float64),
    "py_int": (lambda xs: int(xs[0]), True, None),
    "py_bool": (lambda xs: bool(xs[0] > 0), True, None),
    "np_float64": (lambda xs: np.float64(xs[0]), False, np.float64),
    "np_float32": (lambda xs: np.float32(xs[0]), False, np.float32),
    "np_int32": (lambda xs: np.int32(xs[0]), True, None),
    "np_array_f64": (lambda xs: np.array(xs, dtype=np.float64), False, np.float64),
    "np_array_i32": (lambda xs: np.array(xs, dtype=np.int32), True, None),
    "t_f32_0d": (lambda xs: torch.tensor(xs[0], dtype=torch.float32), False, np.float32),
    "t_f32": (lambda xs: torch.tensor(xs, dtype=torch.float32), False, np.float32),
    "t_f64": (lambda xs: torch.tensor(xs, dtype=torch.float64), False, np.float64),
    "t_f16": (lambda xs: torch.tensor(xs, dtype=torch.float16), False, np.float16),
    "t_bf16": (lambda xs: torch.tensor(xs, dtype=torch.bfloat16), False, "bfloat16"),
    "t_i64": (lambda xs: torch.tensor(xs, dtype=torch.int64), True, None),
    "t_i32": (lambda xs: torch.tensor(xs, dtype=torch.int32), True, None),
    "t_bool": (lambda xs: torch.tensor([x > 0 for x in xs]), True, None),
}
EPS = {np.float64: 2.0**-52, np.float32: 2.0**-23, np.float16: 2.0**-10, "bfloat16": 2.0**-7}
TINY = {np.float64: 2.0**-1022, np.float32: 2.0**-126, np.float16: 2.0**-14, "bfloat16": 2.0**-126}
OPS = ("mean", "sum", "max", "min", "prod")


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    """A structure: leaf kinds, ops, lengths; and every rank's numbers (rounded to the kind)."""
    names = draw(st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=6))
    leaves = []
    for index, kind in enumerate(names):
        op = draw(st.sampled_from(OPS))
        integer = KINDS[kind][1]
        scalar = kind.startswith(("py_", "np_float", "np_int")) or kind.endswith("0d")
        length = 1 if scalar else draw(st.integers(1, 4))
        if integer:
            wide = kind in ("py_int", "t_i64") and op != "mean"  # past 2**53, within int64
            bound = 40 if op == "prod" else 2**61 if wide else 2**31 - 1
            number = st.integers(-bound, bound)
        else:
            bound = 8.0 if op == "prod" else 1e3
            number = st.floats(-bound, bound, allow_nan=False, width=16 if "16" in kind else 64)
            if op in ("max", "min"):
                number = st.one_of(number, st.just(math.nan))
        per_rank = [draw(st.lists(number, min_size=length, max_size=length)) for _ in range(3)]
        leaves.append({"name": f"k{index}_{kind}", "kind": kind, "op": op, "values": per_rank})
    weighted = draw(st.booleans())
    return {
        "leaves": leaves,
        "weighted": weighted,
        "counts": draw(st.lists(st.integers(0, 5), min_size=3, max_size=3)),
    }


def leaf_value(leaf: dict[str, Any], rank: int) -> Any:
    return KINDS[leaf["kind"]][0](leaf["values"][rank])


def as_numbers(value: Any) -> list[Any]:
    """A leaf (or a reduced leaf) as a flat list of Python numbers."""
    if isinstance(value, torch.Tensor):
        return [x for x in value.reshape(-1).tolist()]
    if isinstance(value, np.ndarray):
        return value.reshape(-1).tolist()
    return [value.item() if isinstance(value, np.generic) else value]


def wrap(number: int, kind: str) -> int:
    bits = {"np_int32": 32, "np_array_i32": 32, "t_i32": 32}.get(kind, 64)
    return (number + 2 ** (bits - 1)) % 2**bits - 2 ** (bits - 1)


def reference(
    leaf: dict[str, Any], gathered: list[list[Any]], weights: list[int] | None
) -> list[Any]:
    """Per element: the exact (integers) or float64 reduction over ranks."""
    op, kind = leaf["op"], leaf["kind"]
    integer = KINDS[kind][1]
    out = []
    for column in zip(*gathered, strict=True):
        if op in ("max", "min"):
            if any(isinstance(x, float) and math.isnan(x) for x in column):
                out.append(math.nan)
            else:
                out.append(max(column) if op == "max" else min(column))
        elif op == "prod":
            out.append(math.prod(Fraction(x) for x in column))
        elif op == "sum":
            out.append(sum(Fraction(x) for x in column))
        elif weights is not None:
            total = sum(weights)
            weighted = sum(Fraction(x) * w for x, w in zip(column, weights, strict=True))
            out.append(weighted / total if total else math.nan)
        else:
            out.append(sum(Fraction(x) for x in column) / len(column))
    if integer and op != "mean" and not kind.endswith("bool"):
        return [wrap(int(x), kind) for x in out]
    return out


def close(got: Any, want: Any, leaf: dict[str, Any], gathered: list[list[Any]], n: int) -> bool:
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    kind, op = leaf["kind"], leaf["op"]
    integer = KINDS[kind][1]
    if integer and op != "mean":
        return bool(got == want)
    # a mean of integers: the default float dtype for tensors, else float64
    integer_mean = np.float32 if kind.startswith("t_") else np.float64
    dtype = integer_mean if integer else KINDS[kind][2]
    eps = EPS[dtype]
    scale = max(
        abs(float(want)),
        max((abs(float(x)) for column in gathered for x in column), default=0.0),
    )
    if op == "prod":
        scale = abs(float(want))
    smallest_normal = TINY[dtype]  # products may underflow into subnormals
    return abs(float(got) - float(want)) <= (n + 2) * (eps * scale + smallest_normal)


def expected_type(kind: str, op: str, original: Any) -> type:
    """The documented leaf kinds: an int under "mean" becomes a float, a bool sum a count."""
    if isinstance(original, (torch.Tensor, np.ndarray)):
        return type(original)
    if kind == "py_bool":
        return float if op == "mean" else int if op == "sum" else bool
    if kind == "py_int":
        return float if op == "mean" else int
    if kind == "np_int32" and op == "mean":
        return np.float64
    return type(original)


@RANKS
@pytest.mark.slow  # over 2 s: out of the quick tier
def test_reductions_match_the_exact_reference(dist_ctx: DistContext) -> None:
    n, rank = dist_ctx.world_size, dist_ctx.rank

    @SETTINGS
    @given(case=cases())
    def check(case: dict[str, Any]) -> None:
        leaves = case["leaves"]
        weighted = case["weighted"] and any(leaf["op"] == "mean" for leaf in leaves)
        mine = {leaf["name"]: leaf_value(leaf, rank) for leaf in leaves}
        counts = case["counts"][:n]
        if weighted:
            mine["count"] = counts[rank]
        ops = {leaf["name"]: leaf["op"] for leaf in leaves}
        result = dist_ctx.all_reduce(mine, op=ops, weight="count" if weighted else None)
        everyone = dist_ctx.all_gather({k: as_numbers(v) for k, v in mine.items()})
        problems = []
        for leaf in leaves:
            gathered = [entry[leaf["name"]] for entry in everyone]
            want = reference(leaf, gathered, counts if weighted else None)
            got = as_numbers(result[leaf["name"]])
            if len(got) != len(want) or not all(
                close(g, w, leaf, gathered, n) for g, w in zip(got, want, strict=True)
            ):
                problems.append(
                    f"{leaf['name']} {leaf['op']}: got {got}, want {[float(w) for w in want]}"
                )
            wanted = expected_type(leaf["kind"], leaf["op"], mine[leaf["name"]])
            if type(result[leaf["name"]]) is not wanted:
                problems.append(f"{leaf['name']}: came back as {type(result[leaf['name']])}")
        agreed = dist_ctx.all_gather(problems)
        assert not any(agreed), agreed

    check()


# Large leaves next to torch's own all_reduce, at 3 ranks -------------------------------------

WIDE_EPS = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}


def nearest(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 values rounded once to ``dtype`` (to nearest, ties to even), element by element.

    torch's own conversion rounds through float32 and may be one ulp off; the right
    answer is that guess or a neighbour, whichever is nearest (the even one on a tie).
    """
    guess = exact.to(dtype)
    up = torch.nextafter(guess, torch.full_like(guess, math.inf))
    down = torch.nextafter(guess, torch.full_like(guess, -math.inf))
    candidates = torch.stack([down, guess, up])
    distance = (candidates.to(torch.float64) - exact).abs()
    odd = candidates.view(torch.int16) & 1
    farther = distance > distance.min(dim=0).values
    best = (farther.to(torch.int16) * 2 + odd).argmin(dim=0)  # a tie goes to the even one
    return candidates.gather(0, best.unsqueeze(0)).squeeze(0)


@st.composite
def large_leaves(draw: st.DrawFn) -> dict[str, Any]:
    """A large leaf (its dtype, length, place in the buffer, value spread) and a seed."""
    dtype = draw(st.sampled_from(["bfloat16", "float16", "float32", "float64"]))
    return {
        "dtype": dtype,
        "length": draw(st.integers(1024, 5000)),  # across gloo's chunk boundaries
        "before": draw(st.integers(0, 3)),  # small leaves before it shift where it lies
        "spread": draw(st.integers(0, 10 if dtype == "float16" else 20)),
        "op": draw(st.sampled_from(["sum", "mean"])),
        "seed": draw(st.integers(0, 2**30)),
    }


@pytest.mark.distributed(world_size=3, timeout=240)
@pytest.mark.slow  # over 2 s: out of the quick tier
def test_large_leaves_are_summed_as_the_readme_promises_next_to_torchs_all_reduce(
    dist_ctx: DistContext,
) -> None:
    """float16/bfloat16: the exact sum rounded once (torch's own all_reduce rounds every
    partial sum: at 3 ranks, a bfloat16 200.0 where the exact sum is 200.75). float32 and
    float64: within ``(ranks - 1) * u * sum(|x|)`` of the exact sum, as torch's own."""
    n, rank = dist_ctx.world_size, dist_ctx.rank

    @settings(SETTINGS, max_examples=40)
    @given(case=large_leaves())
    def check(case: dict[str, Any]) -> None:
        dtype = getattr(torch, case["dtype"])
        generator = torch.Generator().manual_seed(case["seed"] * 8 + rank)
        scale = 2.0 ** torch.randint(-case["spread"], case["spread"] + 1, (case["length"],))
        mine = (torch.randn(case["length"], generator=generator, dtype=torch.float64) * scale).to(
            dtype
        )
        result = {f"s{i}": float(i) for i in range(case["before"])} | {"x": mine}
        ours = dist_ctx.all_reduce(result, op=case["op"])["x"]
        torchs = mine.clone()
        dist.all_reduce(torchs)
        everyone = torch.stack(dist_ctx.all_gather(mine)).to(torch.float64)
        exact = torch.tensor(  # the float64 nearest the exact sum (exact itself for halves)
            [math.fsum(column) for column in everyone.T.tolist()], dtype=torch.float64
        )
        problems = []
        if ours.dtype != dtype:
            problems.append(f"came back as {ours.dtype}")
        elif dtype in (torch.float16, torch.bfloat16):
            want = nearest(exact if case["op"] == "sum" else exact / n, dtype)
            if not torch.equal(ours, want):
                index = int((ours != want).nonzero()[0])
                problems.append(f"[{index}]: {ours[index]} for the rounded {want[index]}")
            if case["op"] == "sum":  # never further from the exact sum than torch's
                ours_off = (ours.to(torch.float64) - exact).abs()
                if bool((ours_off > (torchs.to(torch.float64) - exact).abs()).any()):
                    problems.append("further from the exact sum than torch's all_reduce")
        else:
            bound = (n - 1) * WIDE_EPS[dtype] * everyone.abs().sum(dim=0) * (1 + 2.0**-20)
            divisor = 1 if case["op"] == "sum" else n
            if case["op"] == "mean":  # one more rounding, of the quotient
                bound = bound / n + WIDE_EPS[dtype] * (exact / n).abs()
            for name, got in (("ours", ours), ("torch's", torchs / divisor)):
                off = (got.to(torch.float64) - exact / divisor).abs()
                if bool((off > bound).any()):
                    index = int((off > bound).nonzero()[0])
                    problems.append(f"{name} [{index}] is {off[index]} off (bound {bound[index]})")
        agreed = dist_ctx.all_gather(problems)
        assert not any(agreed), (case, agreed)

    check()
