"""The session's guards on a parallel model's calls: collectives, and rank-zero work's limits.

A ddpctx call that is a collective (``ctx.shard``, ``ctx.full_state_dict``,
...) runs through the session's :class:`CollectiveCall`, which refuses a
caller no other rank can join. The rest of this module is about two calls
that are no ddpctx collective, yet rank-zero work may not make them.

Inside a ``@rank_zero_only`` function, a ``ctx.rank_zero()`` block or
``ctx.atomic_dir()`` (and the first run of a ``rank_zero_first`` block) only
rank 0 runs the code. Two model calls there went wrong without a ddpctx
collective to refuse them:

- **A DDP model's** ``ctx.clip_grad_norm_`` sends nothing, but it scales rank
  0's gradients alone: after ``optimizer.step()`` the replicas differ, and
  nothing says so. Refused, at every world size.
- **The forward of the model ``ctx.wrap`` or ``ctx.shard`` returned.** DDP's
  forward may issue collectives of its own (it broadcasts buffers, rebuilds
  its buckets once), and FSDP2's forward gathers every block's shards: rank 0
  alone waited for the timeout, or met another collective of the others
  (gloo's "collective mismatch", with rank 1 blamed). Refused always -- also
  where this forward happens to send nothing (no buffer, no grad), so a
  script does not start hanging when its model gains a buffer. The bare
  module of a DDP model (``ctx.unwrap(model)(x)``, ``model.module(x)``)
  runs no collective and stays allowed: sample generation or evaluation on
  rank 0 calls it (under ``ctx.autocast()`` for the run's mixed precision).
  A sharded model has no collective-free forward: every rank runs it.

The refusal is raised on rank 0 at the call, naming its file and line; the
rank-zero work carries it to the other ranks at once (``RankZeroError``). The
session passes the check in (this layer knows nothing of rank-zero work): a
``refuse(what, why)`` that raises inside rank-zero work, else returns. A
DDP forward gets it through its instance ``forward`` (torch's fast call path
stays: ~0.3 us a call); a sharded model through a forward pre-hook placed
before FSDP2's own (which gathers), on the root and every sharded block.
Compiled code traces the check (dynamo guards the thread-local read): no
graph break.

Example:
    >>> import torch
    >>> layer = torch.nn.Linear(2, 1)
    >>> def refuse(what: str, why: str) -> None:
    ...     raise RuntimeError(what)
    >>> guard_forward(layer, refuse, sharded=False)
    >>> try:
    ...     layer(torch.ones(1, 2))
    ... except RuntimeError as error:
    ...     print(error)
    the forward of a DDP model (model(...))
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from torch import nn

T = TypeVar("T")


class CollectiveCall(Protocol):
    """``(what, call, one_wait=..., everyone=...) -> call()``: a ddpctx call that is a
    collective, guarded.

    ``what`` names it (``"ctx.full_state_dict()"``); ``one_wait``: the hang
    doctor counts the whole call as one wait in it; ``everyone``: every rank of
    the default group makes it (not a subgroup's ranks alone).
    """

    def __call__(
        self, what: str, call: Callable[[], T], *, one_wait: bool, everyone: bool
    ) -> T: ...


#: ``refuse(what, why)``: raises inside rank-zero work, else returns (see the docstring).
Refuse = Callable[[str, str], None]

CLIP_WHY = (
    "rank 0's gradients alone would be scaled and, after optimizer.step(), the replicas "
    "would differ, without an error. Call ctx.clip_grad_norm_(model, ...) before or after "
    "the rank-zero work, on every rank (it returns the same norm on every rank, ready to log)."
)

_DDP_FORWARD_WHY = (
    "the other ranks never join the collectives DDP's forward may issue (a buffer broadcast, "
    "its bucket rebuild; its backward's gradient all-reduce) and the job would fail or wait "
    "until the timeout. Call the bare module there, which runs no collective: "
    "ctx.unwrap(model)(x) or model.module(x) (under `with ctx.autocast():` for the run's "
    "mixed precision), or run the model before or after the rank-zero work, on every rank."
)

_SHARDED_FORWARD_WHY = (
    "the other ranks never join the all-gather of its shards that its forward makes, and "
    "every rank would wait until the timeout. A sharded model has no forward one rank can "
    "run alone: run it on every rank (e.g. generate on every rank, print on rank 0), or "
    "gather ctx.full_state_dict(model) on every rank before the rank-zero work and load it "
    "into a plain copy of the model there."
)


def guard_forward(model: nn.Module, refuse: Refuse, *, sharded: bool) -> None:
    """Refuse ``model``'s forward in rank-zero work (see the module docstring).

    Compiled code traces the check (a thread-local read, guarded by dynamo): no graph break.
    """
    if sharded:
        fsdp = sys.modules.get("torch.distributed.fsdp")
        shards = getattr(fsdp, "FSDPModule", ())
        for name, module in model.named_modules():
            if module is model or isinstance(module, shards):
                label = "model(...)" if module is model else f"model.{name}(...)"
                _refuse_before_gathering(
                    module, refuse, f"the forward of a sharded model ({label})"
                )
        return
    what = "the forward of a DDP model (model(...))"
    inner = model.__dict__.get("forward")  # the run's precision, else the class's

    def wrapper(*args: Any, **kwargs: Any) -> Any:  # "wrapper": the refusal names the caller
        refuse(what, _DDP_FORWARD_WHY)
        if inner is not None:
            return inner(*args, **kwargs)
        return type(model).forward(model, *args, **kwargs)

    model.forward = wrapper


def _refuse_before_gathering(module: nn.Module, refuse: Refuse, what: str) -> None:
    """A forward pre-hook on ``module`` that runs before FSDP2's own (which gathers)."""

    def wrapper(*_: Any) -> None:  # "wrapper": the refusal names the caller
        refuse(what, _SHARDED_FORWARD_WHY)

    module.register_forward_pre_hook(wrapper, prepend=True)
