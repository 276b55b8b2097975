"""How a sharded model starts: with rank 0's weights on every rank, as under DDP.

``DistributedDataParallel`` broadcasts rank 0's parameters and buffers when
it wraps a model, so ``if ctx.is_main: model.load_state_dict(pretrained)``
and a rank-offset seed both give every rank rank 0's model. ``fully_shard``
broadcasts nothing: each rank would keep its slice of its *own* tensors.
:func:`start_like_rank0` makes ``ctx.shard`` start where ``ctx.wrap`` does:

- a model with real tensors: rank 0's parameters and buffers are broadcast
  before sharding (the tensors DDP broadcasts, in place);
- ``full_state_dict=`` (read on rank 0 only, e.g. ``torch.load(path,
  mmap=True, weights_only=True) if ctx.is_main else None``): loaded after
  sharding, each rank receiving only its shards -- the way in for a model
  too big for one rank, built under ``with torch.device("meta"):``. A meta
  model is sharded on the meta device, materialised with ``to_empty`` on
  the run's device and filled from rank 0's state dict. Buffers no state
  dict holds (non-persistent: a rotary table, a fixed random projection) are
  broadcast from rank 0, on a real model and on a meta one (where they must
  have been made on a real device, outside the meta block).

Every rank learns what rank 0 decided (one small ``all_gather_object``), so a
refusal is raised on every rank, never left to a timeout.

This module knows torch and nothing of the context.

Example:
    >>> import torch
    >>> on_meta(torch.nn.Linear(2, 1))
    False
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpctx.parallel.sharding import dtensor_type


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (has no data).

    >>> with torch.device("meta"):
    ...     on_meta(torch.nn.Linear(2, 1))
    True
    """
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _agree(rank: int, world_size: int, meta: bool, given: object) -> tuple[bool, bool]:
    """Rank 0's (meta, has a state dict), checked on every rank; a refusal reaches all ranks."""
    kind = None if given is None else type(given).__name__
    mine = (meta, kind, isinstance(given, Mapping))
    seen: list[Any] = [mine] * world_size
    if world_size > 1:
        dist.all_gather_object(seen, mine)
    metas = [m for m, _, _ in seen]
    if len(set(metas)) > 1:
        on = [r for r, m in enumerate(metas) if m]
        raise ValueError(
            f"ctx.shard got a model on the meta device on rank(s) {on} and a real one on the "
            "others: build it the same way on every rank (all under `with torch.device('meta'):` "
            "with full_state_dict= from rank 0, or all on a real device)."
        )
    _, rank0_kind, rank0_mapping = seen[0]
    if rank0_kind is not None and not rank0_mapping:
        raise TypeError(
            f"full_state_dict must be rank 0's state dict (a mapping of names to tensors), and "
            f"rank 0 passed a {rank0_kind}; pass e.g. torch.load(path, mmap=True, "
            "weights_only=True) on rank 0 and None on the other ranks."
        )
    return metas[0], rank0_kind is not None


def broadcast_rank0_tensors(model: nn.Module) -> None:
    """Overwrite ``model``'s parameters and buffers with rank 0's, in place (DDP's start).

    An expanded tensor (a stride of 0) is refused first, as DDP refuses it: a
    broadcast writes every element, past the few bytes such a tensor owns.
    """
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    for name, tensor in named:
        if any(st == 0 and n > 1 for st, n in zip(tensor.stride(), tensor.size(), strict=True)):
            raise ValueError(
                f"{name!r} of the model is an expanded tensor (a stride of 0, size "
                f"{tuple(tensor.size())}): ctx.shard cannot give it rank 0's values (DDP refuses "
                "it too). Make it a tensor of its own (.expand(...).clone()), or build it in "
                "forward from a smaller buffer."
            )
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(tensor.data, src=0)


def start_like_rank0(
    model: nn.Module,
    shard: Callable[[nn.Module], nn.Module],
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    full_state_dict: object,
) -> nn.Module:
    """Shard ``model`` with ``shard`` so that every rank holds its slice of rank 0's model.

    ``full_state_dict`` is read on rank 0 only (other ranks may pass None);
    see the module docstring for the two ways in.
    """
    meta, load = _agree(rank, world_size, on_meta(model), full_state_dict)
    if meta and not load:
        raise ValueError(
            "ctx.shard got a model on the meta device (its tensors hold no values) and no "
            "full_state_dict on rank 0. Pass rank 0's weights: ctx.shard(model, "
            "full_state_dict=torch.load(path, mmap=True, weights_only=True) if ctx.is_main "
            "else None); every rank then receives only its shards."
        )
    if not load:
        if world_size > 1:
            broadcast_rank0_tensors(model)
        return shard(model)
    kept = {name: b for name, b in model.named_buffers() if not b.is_meta}
    saved = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    empty = [n for n, b in model.named_buffers() if b.is_meta and n not in saved]
    if empty:
        raise ValueError(
            f"ctx.shard got a meta-device model whose non-persistent buffers {empty} would stay "
            "without values: no state dict holds them. Create them on a real device (e.g. "
            "compute the rotary table outside the `with torch.device('meta'):` block and "
            "register it after) or make them persistent."
        )
    weights = dict(full_state_dict) if rank == 0 and isinstance(full_state_dict, Mapping) else {}
    _check_fits(saved, weights, rank, world_size)  # before fully_shard changes the model
    sharded = shard(model)
    if meta:
        sharded.to_empty(device=device)
        _restore_buffers(sharded, kept)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(sharded, weights, options=options)
    if world_size > 1:  # no state dict holds them: rank 0's, as DDP's start gives
        with torch.no_grad():
            for name, buffer in sharded.named_buffers():
                if name not in saved and not isinstance(buffer, dtensor_type()):
                    dist.broadcast(buffer.data, src=0)
    return sharded


def _restore_buffers(model: nn.Module, kept: Mapping[str, torch.Tensor]) -> None:
    """Put back the buffers that had values before ``to_empty`` emptied them."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in kept:
                buffer.copy_(kept[name])


def _check_fits(
    expected: Mapping[str, tuple[int, ...]], state_dict: dict[str, Any], rank: int, world_size: int
) -> None:
    """Refuse, on every rank, rank 0's state dict whose names or shapes do not match the model's."""
    problem: list[Any] = [None]
    if rank == 0:
        missing = sorted(expected.keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - expected.keys())
        shapes = [
            f"{name} {tuple(value.shape)}, not {expected[name]}"
            for name, value in state_dict.items()
            if name in expected
            and isinstance(value, torch.Tensor)
            and tuple(value.shape) != expected[name]
        ]
        found = [
            f"{what} {names[:5]}{' ...' if len(names) > 5 else ''}"
            for what, names in (("missing", missing), ("unexpected", unexpected), ("shape", shapes))
            if names
        ]
        if found:
            problem[0] = (
                "ctx.shard(..., full_state_dict=...) got a state dict that does not fit the "
                f"model: {'; '.join(found)}. Pass the unsharded model's state_dict() (names "
                "without a 'module.' or '_orig_mod.' prefix)."
            )
    if world_size > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise ValueError(problem[0])
