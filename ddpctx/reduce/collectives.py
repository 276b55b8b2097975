"""Reducing nested metrics in as few collectives as the dtypes allow.

Why one module (over 400 lines): the protocol below -- agree, send,
detect a change, fail on every rank -- is one state machine whose steps
share the :class:`Site`; split, each half would be unreadable alone. Object
broadcast and gather live in :mod:`ddpctx.reduce.objects`, the steady
state's packing in :mod:`ddpctx.reduce.fastpath`, the async handle in
:mod:`ddpctx.reduce.handles`.

The reduction protocol
----------------------
Two facts shape it (measured on torch 2.13 / gloo):

- gloo, given buffers of different lengths (or dtypes) on different ranks,
  returns garbage on one rank and aborts another with SIGABRT. So no rank may
  send a buffer whose layout the others have not agreed to.
- gloo reduces 1-2 elements markedly faster than 4 or more, so the steady
  state must not carry a large header.

So each call site *agrees* on a structure once, then carries one flag element:

- A :class:`Site` remembers the plan (layout) every rank last agreed on in
  this process group. A rank whose result has that structure packs it and
  sends the first wire (see :mod:`ddpctx.reduce.packing`) with its flag 0: the
  steady state is the payload plus one element, one collective per wire. A
  floating sum or product that is the only wire and starts with a plain
  floating leaf (a loss, one large tensor, a dict of scalar metrics)
  carries no flag element: a raised flag is a NaN in its first value, and a
  NaN there in the result -- a raised flag or a NaN in the data -- is resolved
  on every rank by one more 1-element collective.
- A rank whose structure differs (or that failed, or a site that never agreed
  in this group) sends a buffer of the *agreed* first wire's layout (a fixed
  1-element buffer at a fresh site) with its flag 1. The flag survives the
  wire's op, so every rank sees it in the same collective and takes the slow
  path together: an ``all_gather_object`` of every rank's structure
  description (or error). Then every rank raises (a failure: the failing
  rank its own error, the others a :class:`ReductionError` naming it; a
  mismatch: a :class:`ReductionError` saying which keys differ on which
  rank, at which call sites), or every rank adopts the new layout and the
  reduction is done again with it.

The steady state has a fast path (:class:`~ddpctx.reduce.fastpath.FastPath`)
for the commonest results -- a 0-d tensor, a Python float, a flat dict of
either: with the site agreed in this group, a result of the agreed structure
is packed without planning, sent with its flag down in one synchronous
collective, and read back from the buffer. Any other result, or a raised
flag in the reply, goes to the general path below, so the fast path decides
nothing the general path would decide otherwise.

Only the structure is compared, never the call site: the same reduction
written on two lines of a rank-dependent ``if`` agrees. The layout, and so
every result, depends on the structure alone, not on what the site reduced
before; a site that reduced a large tensor once and scalars since sends
scalars. Ranks must reach their call sites in the same order (as any
collective requires); pairing one site with different sites on different
ranks over time is not detected before the collective.

``async_op=True`` returns a :class:`Reduction` handle after the first wire is
sent; the check, the other wires and the slow path run in ``.wait()`` /
``.result()``, which raise what the synchronous call would have raised.
Handles finish in the order they were issued: reading one first finishes
the earlier ones, so their collectives pair on every rank whatever order the
program reads them in.

Every entry point first refuses a caller no other rank could join (another
thread, a DataLoader worker, rank-zero-only work: :mod:`ddpctx.reduce.guard`).

Object collectives pickle on the sending rank first: an object that cannot be
pickled is an error on every rank (never a wait), and what arrives is exactly
what torch's own object collectives deliver (a ``Counter`` stays a
``Counter``), including a copy, never the same object, of this rank's own.

Layering: this module knows ``torch.distributed`` and nothing of
:mod:`ddpctx.session.context`; callers pass the :class:`Site`.

Example:
    >>> all_reduce_tree({"loss": 2.0, "count": 4}, weight="count", site=Site("doc"))
    {'loss': 2.0, 'count': 4}
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ddpctx.reduce.fastpath import FastPath
from ddpctx.reduce.guard import check_caller
from ddpctx.reduce.handles import Reduction as Reduction
from ddpctx.reduce.packing import OPS, OpSpec, Plan, plan_key
from ddpctx.reduce.transport import all_reduce
from ddpctx.reduce.tree import signature
from ddpctx.reduce.wire import Wire
from ddpctx.utils.issuing import ISSUING

#: The first wire of a site that has not agreed on a layout in this group yet: its raised
#: flag is a NaN, so a rank at a steady one-value site it meets (ranks out of step)
#: takes the slow path too, instead of reading a flag of 1.0 as part of a sum.
_FRESH = Wire("sum", torch.float64, [], 1, False, False, 0, flag_in_nan=True)
#: Structures a call site remembers before it starts over.
_PLANS_PER_SITE = 16


class ReductionError(RuntimeError):
    """Ranks could not reduce together: different structures, or another rank failed.

    Example (what every rank sees when rank 1 returned other keys)::

        ReductionError: all_reduced(evaluate): ranks returned different structures,
        so they cannot be reduced together: rank 1 lacks ['acc']; adds ['f1']. ...
    """


@dataclass
class Site:
    """One call site (a decorated function, a calling line): the plans it made for the
    structures it has seen, and the one every rank agreed on last, in which group."""

    name: str
    plans: dict[Any, Plan] = field(default_factory=dict)
    agreed: Plan | None = None
    group: Callable[[], Any] | None = None  # weak reference to the group of `agreed`
    fast: FastPath | None = None  # the steady state of `agreed`, where it has one
    label: str | None = None  # debug mode tells ranks at different labelled sites apart

    _transport: tuple[Any, int, torch.device] | None = None

    def transport(self, group: Any) -> tuple[int, torch.device]:
        """The group's world size and buffer device (looked up once per group)."""
        the_group = _the_group(group) if dist.is_initialized() else None
        cached = self._transport
        if cached is None or cached[0]() is not the_group:
            world, device = group_size(group), comm_device(group)
            ref = weakref.ref(the_group) if the_group is not None else (lambda: None)
            self._transport = cached = (ref, world, device)
        return cached[1], cached[2]

    def agreed_in(self, group: Any) -> Plan | None:
        return self.agreed if self.group is not None and self.group() is group else None

    def agree(self, plan: Plan, group: Any) -> None:
        """Every rank of ``group`` (None: no process group) has this plan from now on."""
        self.agreed, self.fast = plan, plan.fast
        self.group = weakref.ref(group) if group is not None else _no_group


def check_op(op: object) -> None:
    """Refuse an unknown op before any communication."""
    names = op.values() if isinstance(op, Mapping) else [op]
    for name in names:
        if name not in OPS:
            raise ValueError(
                f"op={op!r}: {name!r} is not a reduction. Use one of "
                f"{', '.join(map(repr, OPS))}, or a dict mapping result keys to them."
            )


def group_size(group: Any = None) -> int:
    """World size of ``group``, or 1 with no process group."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def comm_device(group: Any = None) -> torch.device:
    """Where buffers must live for the group's backend: the current GPU for NCCL, else CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _the_group(group: Any) -> Any:
    return group if group is not None else dist.group.WORLD


def _no_group() -> None:
    return None


def all_reduce_tree(
    obj: Any,
    op: OpSpec = "mean",
    weight: str | None = None,
    *,
    site: Site,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """Reduce every numeric leaf of ``obj`` across ranks; same structure and leaf kinds back.

    With ``async_op=True``, a :class:`Reduction` handle instead of the value. Refused at
    once where no other rank could join (see :mod:`ddpctx.reduce.guard`).
    """
    check_caller(site.name)
    if site.label is None:
        return _all_reduce_tree(obj, op, weight, site, group, async_op)
    token = ISSUING.set(site.label)  # debug mode's lockstep check names the site
    try:
        return _all_reduce_tree(obj, op, weight, site, group, async_op)
    finally:
        ISSUING.reset(token)


def _all_reduce_tree(
    obj: Any, op: OpSpec, weight: str | None, site: Site, group: Any, async_op: bool
) -> Any:
    fast = site.fast
    if (
        fast is not None
        and site.group() is (group if group is not None else dist.group.WORLD)  # type: ignore[misc]
        and fast.matches(op, weight)
    ):
        buffer = fast.pack(obj)
        if buffer is not None:
            return _send_fast(fast, buffer, obj, site, group, async_op)
    world, device = site.transport(group)
    try:
        plan, values = _prepare(obj, op, weight, world, site, device)
        buffers = plan.pack(values, device)
    except Exception as error:  # whatever failed here, every rank must hear of it
        if async_op:
            return failed_reduction(error, site, group)
        report_failure(error, site, group)
        raise
    if world == 1:
        site.agree(plan, _the_group(group) if dist.is_initialized() else None)
        return _done(_local(plan, values, buffers, device), async_op)
    first_call = site.agreed_in(_the_group(group)) is None
    finish, ready = _send(plan, values, buffers, site, group, device, world, sync=not async_op)
    if not async_op:
        return finish()
    handle = Reduction(finish, site.name, ready=ready)
    if first_call:  # the site's agreement: at the same point on every rank, not at a read
        handle.wait()
    return handle


def _prepare(
    obj: Any, op: OpSpec, weight: str | None, world: int, site: Site, device: torch.device
) -> tuple[Plan, list[Any]]:
    """The plan for ``obj``'s structure (cached per site) and its leaf values."""
    values: list[Any] = []
    try:
        structure = signature(obj, values)
    except RecursionError:  # a result that contains itself: flatten names where
        structure = None
    key = plan_key(structure, op, weight, world) if structure is not None else None
    plan = site.plans.get(key) if key is not None else None
    if plan is None:
        check_op(op)
        plan, values = Plan.make(obj, op, weight, world)
        plan.fast = FastPath.of(plan, obj, op, weight, world, device)
        if key is not None:
            if len(site.plans) >= _PLANS_PER_SITE:
                site.plans.clear()
            site.plans[key] = plan
    return plan, values


def _send_fast(
    fast: FastPath, buffer: torch.Tensor, obj: Any, site: Site, group: Any, async_op: bool
) -> Any:
    """The steady state: one collective, the flag read, the result read back."""
    if fast.world == 1:
        return _done(fast.unpack(buffer), async_op)
    op = fast.wire.op
    if not async_op:
        all_reduce(buffer, op, group)
        return _finish_fast(fast, buffer, obj, site, group)
    work = all_reduce(buffer, op, group, async_op=True)

    def finish() -> Any:
        work.wait()
        return _finish_fast(fast, buffer, obj, site, group)

    return Reduction(finish, site.name)


def _finish_fast(fast: FastPath, buffer: torch.Tensor, obj: Any, site: Site, group: Any) -> Any:
    if fast.whole:  # one large tensor: only its first value, the flag
        numbers = None
        flag = buffer[0].item()
    else:
        numbers = buffer.tolist()  # a few elements: cheaper than reading one of them
        flag = numbers[0]
    if not _raised(fast.wire, flag, False, group):
        return fast.unpack(buffer, numbers)
    # Another rank's structure changed, or it failed: the slow path, as in _send.
    world, device = site.transport(group)
    plan, values = _prepare(obj, fast.op, fast.weight, world, site, device)
    buffers = plan.pack(values, device)
    _agree(plan, None, site, group, world)
    all_reduce(buffers[0], plan.wires[0].op, group)
    return _rest(plan, values, buffers, group, device, world)


def _done(value: Any, async_op: bool) -> Any:
    return Reduction(lambda: value, communicates=False) if async_op else value


def _local(plan: Plan, values: list[Any], buffers: list[torch.Tensor], device: Any) -> Any:
    for wire, buffer in zip(plan.wires, buffers, strict=True):
        if wire.nan_seen(buffer):
            _put_nans(wire, buffer, values, device, None)
    return plan.unpack(buffers, 1)


def _send(
    plan: Plan,
    values: list[Any],
    buffers: list[torch.Tensor],
    site: Site,
    group: Any,
    device: torch.device,
    world: int,
    sync: bool = False,
) -> tuple[Callable[[], Any], Callable[[], bool]]:
    """Send every wire now; return the function that completes the reduction, and its poll.

    ``sync``: the caller completes it at once; a lone wire is then reduced by a plain
    blocking collective (an async one and its wait cost ~50-90 us more CPU a call).

    In the steady state (this rank's structure is the agreed one) completing
    needs no collective of its own, so a handle read on one rank only, or at
    different points on different ranks, pairs nothing wrongly. A rank whose
    structure changed sends the agreed wires empty, the first one flagged,
    so every rank sends as many; then every rank takes the slow path.
    """
    the_group = _the_group(group)
    agreed = site.agreed_in(the_group)
    if agreed is not None and agreed is not plan and agreed.lines == plan.lines:
        site.agree(plan, the_group)  # the same structure, planned again
        agreed = plan
    sent = _issued_wires(agreed, plan, buffers, device)
    if sync and len(sent) == 1:
        all_reduce(sent[0][1], sent[0][0].op, group)
        works: list[Any] = []
    else:  # several wires travel at once
        works = [all_reduce(buffer, wire.op, group, async_op=True) for wire, buffer in sent]
    wire, first = sent[0]

    def finish() -> Any:
        for work in works:
            work.wait()
        if _raised(wire, float(first[0]), agreed is not plan, group):
            _agree(plan, None, site, group, world)
            all_reduce(buffers[0], plan.wires[0].op, group)
            return _rest(plan, values, buffers, group, device, world)
        return _rest(plan, values, buffers, group, device, world, sent=True)

    return finish, lambda: all(work.is_completed() for work in works)


def _issued_wires(
    agreed: Plan | None, plan: Plan | None, buffers: list[torch.Tensor], device: torch.device
) -> list[tuple[Wire, torch.Tensor]]:
    """What a reduction sends at once: the agreed wires (empty and flagged unless ``plan``).

    ``plan`` None: this rank failed and has nothing to send but the flag.
    """
    if plan is not None and agreed is plan:
        return list(zip(plan.wires, buffers, strict=True))
    if agreed is None:  # a site's first call: the fresh flag alone
        return [(_FRESH, _FRESH.empty(device, raised=True))]
    return [(w, w.empty(device, raised=n == 0)) for n, w in enumerate(agreed.wires)]


def _raised(wire: Wire, reduced: float, mine: bool, group: Any) -> bool:
    """Whether any rank raised the flag (``mine``: this rank did), from the reduced flag.

    A flag carried as NaN (a single floating value summed: see :mod:`ddpctx.reduce.packing`)
    is unclear when the result is NaN -- every rank then asks, in one more collective.
    """
    if wire.flag_unclear(reduced):
        ballot = torch.tensor([float(mine)], dtype=torch.float64, device=comm_device(group))
        dist.all_reduce(ballot, group=group)
        return float(ballot) > 0.5
    return wire.flag_raised(reduced)


def _rest(
    plan: Plan,
    values: list[Any],
    buffers: list[torch.Tensor],
    group: Any,
    device: torch.device,
    world: int,
    sent: bool = False,
) -> Any:
    """The first wire is reduced and every flag is down: the other wires, then the result.

    ``sent``: the other wires were sent and reduced with the first.
    """
    for wire, buffer in zip(plan.wires[1:], buffers[1:], strict=True):
        if not sent:
            all_reduce(buffer, wire.op, group)
    for wire, buffer in zip(plan.wires, buffers, strict=True):
        if wire.nan_seen(buffer):  # the same answer on every rank: all take this branch
            _put_nans(wire, buffer, values, device, group)
    return plan.unpack(buffers, world)


def _put_nans(
    wire: Wire, reduced: torch.Tensor, values: list[Any], device: torch.device, group: Any
) -> None:
    """Mark NaN where any rank held one (max/min would otherwise pick by position)."""
    raw = wire.pack(values, device, hide_nans=False)
    held = torch.isnan(raw).to(wire.dtype)
    if group_size(group) > 1:
        all_reduce(held, "max", group)
    start = int(wire.flag)
    body = slice(start, wire.length - 1)
    reduced[body] = torch.where(held[body] > 0, torch.nan, reduced[body])


def _agree(
    plan: Plan | None, error: BaseException | None, site: Site, group: Any, world: int
) -> None:
    """The slow path: compare every rank's structure (or error); adopt it or raise everywhere."""
    mine: tuple[Any, ...]
    if error is not None or plan is None:
        mine = ("failed", site.name, f"{type(error).__name__}: {error}", site.label)
    else:
        mine = ("ok", site.name, plan.lines, site.label)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    failed = [(rank, entry[2]) for rank, entry in enumerate(everyone) if entry[0] == "failed"]
    if failed:
        if error is not None:
            return  # the caller re-raises this rank's own error
        details = "; ".join(f"rank {rank}: {text}" for rank, text in failed)
        raise ReductionError(
            f"rank {failed[0][0]} could not reduce its result, so no rank can ({details}). "
            "Fix the error on that rank."
        )
    labels = [entry[3] for entry in everyone]
    if None not in labels and len(set(labels)) > 1:  # every rank in an @all_reduced function
        places = "; ".join(f"rank {rank} in {label}" for rank, label in enumerate(labels))
        raise ReductionError(
            f"ranks are in different @all_reduced functions ({places}), so their results "
            "cannot be reduced together. Call them in the same order on every rank."
        )
    reference = everyone[0][2]
    problems = [
        f"rank {rank} {_difference(reference, entry[2])}"
        for rank, entry in enumerate(everyone)
        if rank > 0 and entry[2] != reference
    ]
    if problems:
        names = {entry[1] for entry in everyone}
        where = (
            f"{site.name}: "
            if len(names) == 1
            else "("
            + "; ".join(f"rank {rank} at {entry[1]}" for rank, entry in enumerate(everyone))
            + ") "
        )
        raise ReductionError(
            f"{where}ranks returned different structures, so they cannot be reduced "
            f"together: {'; '.join(problems)}. Return the same keys, types and shapes on every "
            "rank (use a zero count for a rank with no data)."
        )
    assert plan is not None
    site.agree(plan, _the_group(group))


def report_failure(error: BaseException, site: Site, group: Any = None) -> None:
    """Tell the other ranks, through the reduction they are waiting in, that this rank failed.

    Call it where this rank would have called :func:`all_reduce_tree` but
    cannot; then raise ``error``. The others raise a :class:`ReductionError`
    naming this rank. Errors while communicating are swallowed: ``error`` is
    the one worth raising.
    """
    _tell_failure(error, site, group, async_op=False).wait()


def failed_reduction(error: Exception, site: Site, group: Any = None) -> Reduction[Any]:
    """The ``async_op=True`` form of :func:`report_failure`: a handle raising ``error``.

    The flag goes out now, like the first wire of a reduction; the rest of
    the protocol runs at ``.result()``, where the other ranks run theirs.
    """
    return _tell_failure(error, site, group, async_op=True)


def _tell_failure(error: BaseException, site: Site, group: Any, async_op: bool) -> Reduction[Any]:
    world = group_size(group)
    works: list[Any] = []
    agreed = site.agreed_in(_the_group(group)) if world > 1 else None
    if world > 1:
        sent = _issued_wires(agreed, None, [], comm_device(group))  # as the others send
        try:
            works = [all_reduce(buffer, wire.op, group, async_op=True) for wire, buffer in sent]
        except Exception:  # a broken group: nothing more can be told
            works = []

    def finish() -> Any:
        if works:
            try:
                for work in works:
                    work.wait()
                wire, buffer = sent[0]
                _raised(wire, float(buffer[0]), True, group)  # a NaN flag: answer the question
                _agree(None, error, site, group, world)
            except Exception:  # a broken group: nothing more can be told
                pass
        raise error

    handle: Reduction[Any] = Reduction(finish, site.name, communicates=world > 1)
    if not async_op or agreed is None:  # a site's first call agrees at once, as the others do
        handle.wait()
    return handle


def _difference(reference: Sequence[str], theirs: Sequence[str]) -> str:
    """How one rank's structure description differs from rank 0's, in words."""
    ours = dict(line.partition(" ")[::2] for line in reference)
    other = dict(line.partition(" ")[::2] for line in theirs)
    parts = [f"lacks {path}" for path in ours if path not in other]
    parts += [f"adds {path}" for path in other if path not in ours]
    parts += [
        f"has {path} as {other[path]} (rank 0: {ours[path]})"
        for path in ours
        if path in other and other[path] != ours[path]
    ]
    return "; ".join(parts) or "has the same leaves in another order"


# Object collectives ------------------------------------------------------------------------
