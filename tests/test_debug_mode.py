"""Debug mode (``debug=True``, ``DDPCTX_DEBUG=collectives``): no false alarm, and a real
mismatch named with the right ranks and lines.

Random programs mix collectives on the default group and on random subgroups,
object collectives and point-to-point pairs (blocking, ``isend``/``irecv`` and
``batch_isend_irecv``). A correct program must run to its end without a report;
the same program with one rank skipping or swapping one collective must fail
with :class:`~ddpctx.HangError` on every member of that group, naming the
rank and the line of each side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import ddpctx
from ddpctx import HangError, RankError, distributed
from ddpctx.hang.peers import ranks_text

HERE = Path(__file__)
COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather_object", "broadcast_object_list")
POINT_TO_POINT = ("send_recv", "isend_irecv", "batch")


@dataclass(frozen=True)
class Op:
    """One step of a program: a collective on ``members`` (None: the default group), or a
    point-to-point transfer from ``members[0]`` to ``members[1]``."""

    kind: str
    members: tuple[int, ...] | None = None


def run_op(op: Op, rank: int, groups: dict[tuple[int, ...], Any]) -> None:
    """Issue ``op`` on this rank; each kind is issued from its own line (``# OP-<kind>``)."""
    if op.kind in POINT_TO_POINT:
        assert op.members is not None
        source, target = op.members
        if rank not in (source, target):
            return
        peer = target if rank == source else source
        data = torch.full((3,), float(source))
        if op.kind == "send_recv":
            if rank == source:
                dist.send(data, dst=peer)  # OP-send
            else:
                dist.recv(data, src=peer)  # OP-recv
        elif op.kind == "isend_irecv":
            start = dist.isend if rank == source else dist.irecv
            work = start(data, peer)
            assert work is not None
            work.wait()
        else:
            direction = dist.isend if rank == source else dist.irecv
            for work in dist.batch_isend_irecv([dist.P2POp(direction, data, peer)]):
                work.wait()
        assert data.tolist() == [float(source)] * 3
        return
    if op.members is not None and rank not in op.members:
        return
    group = None if op.members is None else groups[op.members]
    first = 0 if op.members is None else op.members[0]
    if op.kind == "all_reduce":
        dist.all_reduce(torch.ones(2), dist.ReduceOp.SUM, group)  # OP-all_reduce
    elif op.kind == "broadcast":
        dist.broadcast(torch.zeros(2), src=first, group=group)  # OP-broadcast
    elif op.kind == "barrier":
        dist.barrier(group=group)  # OP-barrier
    elif op.kind == "all_gather_object":
        size = dist.get_world_size(group)
        dist.all_gather_object([None] * size, {"rank": rank}, group=group)  # OP-all_gather_object
    else:
        dist.broadcast_object_list([rank], src=first, group=group)  # OP-broadcast_object_list


def run_program(program: list[Op], mutated_rank: int = -1, step: int = -1, how: str = "") -> int:
    """Run ``program`` on this rank; ``mutated_rank`` skips or swaps step ``step``."""
    ctx = ddpctx.current()
    assert ctx is not None
    subgroups = sorted({op.members for op in program if op.members and op.kind in COLLECTIVES})
    groups = {members: dist.new_group(list(members)) for members in subgroups}
    ops = list(program)
    if ctx.rank == mutated_rank:
        if how == "skip":
            del ops[step]
        else:
            ops[step], ops[step + 1] = ops[step + 1], ops[step]
    for op in ops:
        run_op(op, ctx.rank, groups)
    ctx.barrier()
    return len(ops)


def line_of(kind: str) -> str:
    lines = HERE.read_text().splitlines()
    found = [n for n, text in enumerate(lines, 1) if text.rstrip().endswith(f"# OP-{kind}")]
    assert len(found) == 1
    return f"tests/{HERE.name}:{found[0]} in run_op"


@st.composite
def programs(draw: st.DrawFn, world_size: int) -> list[Op]:
    ranks = list(range(world_size))
    subsets = st.lists(st.sampled_from(ranks), min_size=1, unique=True).map(
        lambda chosen: tuple(sorted(chosen))
    )
    collective = st.builds(
        Op, st.sampled_from(COLLECTIVES), st.one_of(st.none(), st.none(), subsets)
    )
    pair = st.lists(st.sampled_from(ranks), min_size=2, max_size=2, unique=True).map(tuple)
    transfer = st.builds(Op, st.sampled_from(POINT_TO_POINT), pair)
    return draw(st.lists(st.one_of(collective, collective, transfer), min_size=1, max_size=8))


@pytest.fixture
def debug_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPCTX_DEBUG", "collectives")
    monkeypatch.setenv("DDPCTX_HANG_TIMEOUT", "0")


SETTINGS = settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@SETTINGS
@given(data=st.data())
def test_a_correct_program_runs_to_its_end_under_debug_mode(
    run_distributed: Any, debug_mode: None, world_size: int, data: st.DataObject
) -> None:
    program = data.draw(programs(world_size))
    assert (
        run_distributed(run_program, program, world_size=world_size, timeout=60)
        == [len(program)] * world_size
    )


@pytest.mark.parametrize("world_size", [2, 3, 4])
@settings(SETTINGS, max_examples=3)
@given(data=st.data())
def test_one_rank_skipping_or_swapping_a_collective_is_named_with_both_lines(
    run_distributed: Any, debug_mode: None, world_size: int, data: st.DataObject
) -> None:
    program = data.draw(programs(world_size))
    # Debug mode sees at once a rank entering another operation on the same group: step and
    # step + 1 are collectives of one group, of different kinds.
    candidates = [
        step
        for step in range(len(program) - 1)
        if program[step].kind in COLLECTIVES
        and program[step + 1].kind in COLLECTIVES
        and program[step].members == program[step + 1].members
        and program[step].kind != program[step + 1].kind
        and len(program[step].members or range(world_size)) > 1
    ]
    assume(candidates)
    step = data.draw(st.sampled_from(candidates))
    members = program[step].members or tuple(range(world_size))
    rank = data.draw(st.sampled_from(members))
    how = data.draw(st.sampled_from(["skip", "swap"]))
    with pytest.raises(RankError) as caught:
        run_distributed(run_program, program, rank, step, how, world_size=world_size, timeout=60)
    assert isinstance(caught.value.original, HangError), caught.value
    message = str(caught.value.original)
    others = [member for member in members if member != rank]
    expected, entered = program[step].kind, program[step + 1].kind
    assert f"{entered} at {line_of(entered)} ({ranks_text([rank])})" in message
    assert f"{expected} at {line_of(expected)} ({ranks_text(others)})" in message
    group = "the default group" if program[step].members is None else ranks_text(list(members))
    assert group in message


# --- the two programs of the report, and DDP ------------------------------------------------


def send_then_barrier() -> str:
    ctx = ddpctx.current()
    assert ctx is not None
    data = torch.arange(3.0) if ctx.rank == 0 else torch.zeros(3)
    if ctx.rank == 0:
        dist.send(data, dst=1)
    else:
        dist.recv(data, src=0)
    dist.barrier()
    return str(data.tolist())


def solo_group_then_barrier() -> float:
    ctx = ddpctx.current()
    assert ctx is not None
    solo = dist.new_group([0])
    total = torch.ones(1)
    if ctx.rank == 0:
        dist.all_reduce(total, group=solo)
    dist.barrier()
    return float(total)


def test_send_and_recv_then_a_barrier_run_under_debug_mode(
    run_distributed: Any, debug_mode: None
) -> None:
    # Before: HangError "send at ...:7 (rank 0) vs recv at ...:9 (rank 1)".
    assert run_distributed(send_then_barrier) == ["[0.0, 1.0, 2.0]"] * 2


def test_a_collective_of_a_one_rank_group_does_not_shift_the_others(
    run_distributed: Any, debug_mode: None
) -> None:
    # Before: "collective sequence numbers: rank 0: #2, rank 1: #1".
    assert run_distributed(solo_group_then_barrier) == [1.0, 1.0]


def train_ddp_steps() -> float:
    ctx = ddpctx.current()
    assert ctx is not None
    torch.manual_seed(0)
    model = ctx.wrap(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    return float(sum(p.detach().sum() for p in model.parameters()))


def test_ddp_trains_under_debug_mode_at_two_ranks(run_distributed: Any, debug_mode: None) -> None:
    results = run_distributed(train_ddp_steps)
    assert results[0] == results[1]


def test_ddp_trains_under_debug_mode_in_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: torch's DETAIL debug level was turned on, and gloo + DDP crashed with SIGSEGV.
    monkeypatch.delenv("DDPCTX_HANG_TIMEOUT", raising=False)
    with distributed(debug=True):
        assert str(dist.get_debug_level()) != str(dist.DebugLevel.DETAIL)  # type: ignore[attr-defined]
        train_ddp_steps()


def test_a_subgroup_mismatch_names_the_group(run_distributed: Any, debug_mode: None) -> None:
    with pytest.raises(RankError) as caught:
        run_distributed(_subgroup_mismatch, world_size=3)
    message = str(caught.value.original)
    assert re.search(r"different collectives on the group of ranks 1, 2: ", message), message
    assert "(rank 1)" in message
    assert "(rank 2)" in message


def _subgroup_mismatch() -> None:
    ctx = ddpctx.current()
    assert ctx is not None
    pair = dist.new_group([1, 2])
    if ctx.rank == 1:
        dist.barrier(group=pair)
    elif ctx.rank == 2:
        dist.all_reduce(torch.ones(1), group=pair)


def everyone_calls_the_one_rank_group() -> float:
    ctx = ddpctx.current()
    assert ctx is not None
    solo = dist.new_group([0])
    total = torch.ones(1)
    dist.all_reduce(total, group=solo)  # torch skips the call on rank 1, outside the group
    dist.barrier()
    return float(total)


def test_a_collective_on_a_group_a_rank_is_not_in_is_not_counted_there(
    run_distributed: Any, debug_mode: None
) -> None:
    assert run_distributed(everyone_calls_the_one_rank_group) == [1.0, 1.0]


@ddpctx.all_reduced
def train_loss(value: float) -> float:
    return value


@ddpctx.all_reduced
def val_acc(value: float) -> float:
    return value


def swapped_reductions() -> list[float]:
    """Rank 1 evaluates before it logs its loss at step 2: two sites in swapped order."""
    ctx = ddpctx.current()
    assert ctx is not None
    seen = []
    for step in range(3):
        if ctx.rank == 1 and step == 2:
            seen += [val_acc(90.0), train_loss(0.5)]
        else:
            seen += [train_loss(0.5), val_acc(90.0)]
    return seen


def test_two_all_reduced_functions_in_swapped_order_are_named_under_debug_mode(
    run_distributed: Any, debug_mode: None
) -> None:
    # Found by attacking the merged engine: both ranks got loss=45.25 and acc=45.25, also
    # under DDPCTX_DEBUG=collectives (to torch both are one all_reduce of one element).
    with pytest.raises(RankError) as caught:
        run_distributed(swapped_reductions, world_size=2)
    message = str(caught.value.original)
    assert isinstance(caught.value.original, HangError), message
    assert "all_reduce in all_reduced(tests.test_debug_mode.train_loss)" in message
    assert "all_reduce in all_reduced(tests.test_debug_mode.val_acc)" in message


def test_the_same_all_reduced_function_on_two_lines_is_one_collective_under_debug_mode(
    run_distributed: Any, debug_mode: None
) -> None:
    def branches() -> float:
        ctx = ddpctx.current()
        assert ctx is not None
        if ctx.rank == 0:
            return train_loss(1.0)
        return train_loss(3.0)

    assert run_distributed(branches, world_size=2) == [2.0, 2.0]
