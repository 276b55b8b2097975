"""Any picklable object from one rank to all (``broadcast``), or from all to all (``all_gather``).

torch's object collectives, with two things added: tensors come back on the
device they were sent from (not the receiver's current GPU), and an object
that cannot be pickled on one rank is an error on every rank, at once,
instead of a hang of the others. Both refuse a caller no other rank could
join (see :mod:`ddpctx.reduce.guard`).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
import torch.distributed as dist

from ddpctx.reduce.collectives import ReductionError, comm_device, group_size
from ddpctx.reduce.guard import check_caller


def _on_this_gpu(tensor: torch.Tensor) -> torch.Tensor:
    """Where a CUDA tensor sent by another rank lands: the receiver's own GPU."""
    return tensor.to(torch.device("cuda", torch.cuda.current_device()))


class _Pickler(pickle.Pickler):
    """pickle, but a CUDA tensor travels as a CPU copy and lands on the receiver's GPU."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            return _on_this_gpu, (obj.detach().cpu(),)
        return NotImplemented


def _pickled(obj: Any) -> tuple[str, bytes | str]:
    """("ok", bytes) or ("failed", why): pickling happens before any communication."""
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except Exception as error:  # anything pickle raises: every rank must hear of it
        return "failed", f"{type(error).__name__}: {error}"
    return "ok", buffer.getvalue()


def _raise_unsent(entries: list[tuple[Any, ...]], rank: int, obj: Any) -> None:
    failed = [(r, entry[1]) for r, entry in enumerate(entries) if entry and entry[0] == "failed"]
    if not failed:
        return
    if any(r == rank for r, _ in failed):
        pickle.dumps(obj)  # raises this rank's own error, with its own traceback
    details = "; ".join(f"rank {r}: {text}" for r, text in failed)
    raise ReductionError(
        f"rank {failed[0][0]} could not pickle its object, so nothing was sent ({details}). "
        "Send only picklable objects (e.g. a defaultdict with a named function, not a lambda)."
    )


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` from rank ``src`` on every rank: any picklable object, of any size.

    CPU tensors arrive on the CPU, CUDA tensors on the receiver's own GPU. An
    object ``src`` cannot pickle is an error on every rank.
    """
    check_caller("an object broadcast (ctx.broadcast)")
    world = group_size(group)
    if not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(f"src={src!r} is not a rank of this group; use 0..{world - 1}.")
    if world == 1:
        return obj
    rank = dist.get_rank(group)
    box: list[Any] = [_pickled(obj) if rank == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    entries: list[Any] = [None] * world
    entries[src] = box[0]
    _raise_unsent(entries, rank, obj)
    return obj if rank == src else pickle.loads(box[0][1])


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank; sizes may differ between ranks.

    Every entry is a copy (this rank's own too), as torch's ``all_gather_object``
    gives. An object some rank cannot pickle is an error on every rank.
    """
    check_caller("an object gather (ctx.all_gather)")
    world = group_size(group)
    if world == 1:
        return [pickle.loads(pickle.dumps(obj))]
    rank = dist.get_rank(group)
    entries: list[Any] = [None] * world
    dist.all_gather_object(entries, _pickled(obj), group=group)
    _raise_unsent(entries, rank, obj)
    return [pickle.loads(entry[1]) for entry in entries]


def all_gather_rare(obj: Any, group: Any = None) -> list[Any]:
    """:func:`all_gather_objects` for what nearly every rank sends as None (a finding, an error).

    One 1-element ``all_reduce`` tells every rank whether any rank has something
    to send; only then are the objects gathered. All None (the common case), each
    entry is None, for the price of the smallest collective rather than two
    gathers and a pickle per rank.
    """
    check_caller("an object gather (ctx.all_gather)")
    world = group_size(group)
    if world == 1:
        return [None if obj is None else pickle.loads(pickle.dumps(obj))]
    vote = torch.tensor([0.0 if obj is None else 1.0], device=comm_device(group))
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
    if vote.item() == 0.0:
        return [None] * world
    return all_gather_objects(obj, group)
