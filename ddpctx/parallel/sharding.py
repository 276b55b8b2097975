"""Sharded models: telling them apart, and sharding one with FSDP2 per block.

A model is *sharded* when its ``state_dict()`` on one rank does not hold the
whole model: FSDP2 (``fully_shard``, whose parameters are ``DTensor``s, also
when the user applied it without ddpctx) and FSDP1 wrappers
(``FullyShardedDataParallel``). Saving such a model the DDP way would write
rank 0's shard and load it onto every rank -- wrong weights, no error -- so
the checkpoint code asks :func:`sharding_of` first.

:func:`shard_model` applies ``fully_shard`` to each block, then to the root,
on a one-dimensional device mesh over all ranks. The default blocks are the
children of every ``nn.ModuleList`` (the transformer-layer idiom) and any
other submodule holding at least ``min_params`` parameters that no smaller
block holds already; ``blocks=`` (module classes, or a ``(name, module) ->
bool`` predicate) overrides them.

This module knows torch and nothing of the context.

Example:
    >>> import torch
    >>> sharding_of(torch.nn.Linear(2, 1)) is None
    True
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from ddpctx.parallel.wrapping import unwrap_model

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: ``blocks=``: module classes to shard one by one, or a ``(name, module) -> bool`` predicate.
BlockPolicy = Sequence[type[nn.Module]] | type[nn.Module] | Callable[[str, nn.Module], bool]

DEFAULT_MIN_PARAMS = 1_000_000


def sharding_of(model: nn.Module) -> str | None:
    """``"fsdp2"`` (DTensor parameters), ``"fsdp1"`` (a FullyShardedDataParallel inside), or None.

    >>> import torch
    >>> sharding_of(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None
    True
    """
    # FSDP and DTensor are imported only by those who use them (0.7 s): a model can hold
    # neither while their modules are not loaded
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        if any(isinstance(module, fsdp.FullyShardedDataParallel) for module in model.modules()):
            return "fsdp1"
        if isinstance(model, fsdp.FSDPModule):
            return "fsdp2"
    if any(isinstance(p, dtensor_type()) for p in model.parameters()):
        return "fsdp2"
    return None


def dtensor_type() -> Any:
    """For ``isinstance``: ``DTensor`` once ``torch.distributed.tensor`` is loaded, else ``()``.

    Nothing can be a DTensor before its module is loaded, and ddpctx does not
    load it for the check (it takes most of a second).

    >>> import torch
    >>> isinstance(torch.ones(1), dtensor_type())
    False
    """
    module = sys.modules.get("torch.distributed.tensor")
    return () if module is None else module.DTensor


def _block_test(blocks: BlockPolicy) -> Callable[[str, nn.Module], bool]:
    if isinstance(blocks, type):
        blocks = [blocks]
    if not isinstance(blocks, Sequence):
        return blocks
    classes = tuple(blocks)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(
            f"blocks={blocks!r} must be nn.Module classes (e.g. blocks=[TransformerBlock]) or a "
            "function (name, module) -> bool that says which submodules to shard one by one."
        )
    return lambda _name, module: isinstance(module, classes)


def default_blocks(model: nn.Module, min_params: int) -> list[nn.Module]:
    """The submodules the default policy shards, deepest first (never the root itself).

    >>> import torch
    >>> layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    >>> len(default_blocks(torch.nn.Sequential(layers), min_params=10**9))
    2
    """
    chosen: list[nn.Module] = []
    in_lists = {id(child) for m in model.modules() if isinstance(m, nn.ModuleList) for child in m}

    def visit(module: nn.Module) -> int:
        """Parameters of ``module`` not yet in a chosen block (post-order)."""
        loose = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            loose += visit(child)
        block = id(module) in in_lists or loose >= min_params
        if module is not model and loose > 0 and block:
            chosen.append(module)
            return 0
        return loose

    visit(model)
    return chosen


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: BlockPolicy | None = None,
    min_params: int = DEFAULT_MIN_PARAMS,
    block_kwargs: dict[str, Any] | None = None,
    **fsdp_kwargs: Any,
) -> nn.Module:
    """``fully_shard`` each block of ``model`` (see the module docstring), then the root.

    ``block_kwargs`` override ``fsdp_kwargs`` for the blocks (not the root).
    """
    if sharding_of(model) is not None:
        raise ValueError(
            f"shard() got a model that is already sharded ({sharding_of(model)}); pass the "
            "unsharded module, or use it as it is."
        )
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 1:
        raise ValueError(
            f"min_params={min_params!r} must be a positive int (the parameter count from which "
            "a submodule is sharded on its own)."
        )
    from torch.distributed.fsdp import fully_shard

    if blocks is None:
        chosen = default_blocks(model, min_params)
    else:
        test = _block_test(blocks)
        chosen = [m for name, m in model.named_modules() if m is not model and test(name, m)]
        chosen.reverse()  # deepest first: fully_shard of a parent skips its sharded children
    for block in chosen:
        if sharding_of(block) is None:  # a block inside a block already taken is left whole
            fully_shard(block, mesh=mesh, **{**fsdp_kwargs, **(block_kwargs or {})})
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def refuse_unsaveable(model: nn.Module, what: str) -> None:
    """Refuse a model whose ``state_dict()`` on one rank is not the whole model.

    >>> import torch
    >>> refuse_unsaveable(torch.nn.Linear(2, 1), "save_checkpoint")
    """
    kind = sharding_of(model)
    if kind == "fsdp1":
        raise TypeError(
            f"{what} got a model holding a FullyShardedDataParallel (FSDP1) wrapper: its "
            "state_dict() on one rank is not the whole model, so it would be saved as one "
            "rank's shard. Shard it with ctx.shard(model) (FSDP2) instead, whose checkpoints "
            "ddpctx writes with torch.distributed.checkpoint, or save it yourself with "
            "torch.distributed.checkpoint."
        )
    if kind == "fsdp2":
        raise TypeError(
            f"{what} got a sharded model (FSDP2: its parameters are DTensors): its "
            "state_dict() on one rank holds only that rank's shard. Save it with "
            "ctx.save_checkpoint(dir, model=model, ...), which writes every rank's shards "
            "with torch.distributed.checkpoint, or get the whole weights with "
            "ctx.full_state_dict(model)."
        )


def full_state_dict(model: nn.Module, rank: int) -> dict[str, Any]:
    """The whole model's weights on rank 0, on CPU; an empty dict on the other ranks.

    A collective for sharded models (every rank must call it); a copy of the
    bare module's state on rank 0 for the others.

    >>> import torch
    >>> sorted(full_state_dict(torch.nn.Linear(2, 1), rank=0))
    ['bias', 'weight']
    """
    if sharding_of(model) is not None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return dict(get_model_state_dict(model, options=options))
    if rank != 0:
        return {}
    return {name: value.detach().cpu() for name, value in unwrap_model(model).state_dict().items()}
