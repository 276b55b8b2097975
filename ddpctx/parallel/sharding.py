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
block holds already, except a module whose parameter is tied to one outside it
(GPT-2's embedding and output layer share a weight): tied parameters are
sharded together, by the parent the modules share (or the root). ``blocks=``
(module classes, or a ``(name, module) -> bool`` predicate) overrides the
default; a block it selects that holds a tied parameter is refused.

This module knows torch and nothing of the context.

Example:
    >>> import torch
    >>> sharding_of(torch.nn.Linear(2, 1)) is None
    True
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ddpctx.parallel.compiling import compile_in_place
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
    everywhere = _registrations(model)

    def visit(module: nn.Module) -> int:
        """Parameters of ``module`` not yet in a chosen block (post-order)."""
        loose = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            loose += visit(child)
        block = id(module) in in_lists or loose >= min_params
        # a tied parameter (GPT-2's embedding and output layer) belongs to one FSDP group:
        # a block holding it while a module outside holds it too is left to its parent
        if block and _shared_outside(module, everywhere) is not None:
            return loose
        if module is not model and loose > 0 and block:
            chosen.append(module)
            return 0
        return loose

    visit(model)
    return chosen


def _registrations(module: nn.Module) -> dict[int, int]:
    """How many times each parameter (by id) is registered in ``module``'s tree."""
    counts: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        counts[id(param)] = counts.get(id(param), 0) + 1
    return counts


def _shared_outside(block: nn.Module, everywhere: dict[int, int]) -> str | None:
    """The name (in ``block``) of a parameter that a module outside ``block`` also holds."""
    inside = _registrations(block)
    for name, param in block.named_parameters():
        if inside[id(param)] < everywhere.get(id(param), 0):
            return name
    return None


def _refuse_tied_blocks(model: nn.Module, chosen: list[nn.Module]) -> None:
    """``blocks=`` naming a block whose parameter is tied to one outside it: say so and the fix."""
    everywhere = _registrations(model)
    names = {id(module): name for name, module in model.named_modules()}
    for block in chosen:
        tied = _shared_outside(block, everywhere)
        if tied is not None:
            raise ValueError(
                f"blocks= selects {names[id(block)]!r}, whose parameter {tied!r} is tied to a "
                "module outside it (e.g. an embedding shared with the output layer); tied "
                "parameters must be sharded together, in one block. Leave this module out of "
                "blocks= (its parameters then go with its parent, or the root), or pass the "
                "default policy (blocks=None), which does so."
            )


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    blocks: BlockPolicy | None = None,
    min_params: int = DEFAULT_MIN_PARAMS,
    block_kwargs: dict[str, Any] | None = None,
    batch_norm_kwargs: dict[str, Any] | None = None,
    compile_options: dict[str, Any] | None = None,
    split_first: Callable[[nn.Module], object] | None = None,
    **fsdp_kwargs: Any,
) -> nn.Module:
    """``fully_shard`` each block of ``model`` (see the module docstring), then the root.

    With ``compile_options`` each block is compiled in place before it is
    sharded, or the root when no block is (:mod:`ddpctx.parallel.compiling`).

    ``block_kwargs`` override ``fsdp_kwargs`` for the blocks (not the root).
    With ``batch_norm_kwargs`` every batch-norm layer is sharded on its own
    first, with those (mixed precision keeps its weights float32, like its
    float32 running statistics, as FSDP1 did). ``split_first`` (tensor
    parallel's plan) runs on the model before anything is sharded.
    """
    check_shardable(model, min_params)
    from torch.distributed.fsdp import fully_shard

    before = list(model.parameters())
    if split_first is not None:
        split_first(model)
    if blocks is not None:  # refused before anything is sharded
        test = _block_test(blocks)
        chosen = [m for name, m in model.named_modules() if m is not model and test(name, m)]
        chosen.reverse()  # deepest first: fully_shard of a parent skips its sharded children
        _refuse_tied_blocks(model, chosen)

    if batch_norm_kwargs is not None:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module is not model:
                fully_shard(module, mesh=mesh, **{**fsdp_kwargs, **batch_norm_kwargs})

    if blocks is None:
        chosen = default_blocks(model, min_params)
    sharded_blocks = []
    for block in chosen:
        if sharding_of(block) is None:  # a block inside a block already taken is left whole
            if compile_options is not None:
                compile_in_place([block], compile_options)
            fully_shard(block, mesh=mesh, **{**fsdp_kwargs, **(block_kwargs or {})})
            sharded_blocks.append(block)
    if compile_options is not None and not sharded_blocks:
        compile_in_place([model], compile_options)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    now = {id(param) for param in model.parameters()}
    _REPLACED.update((id(param), param) for param in before if id(param) not in now)
    return model


def check_shardable(model: nn.Module, min_params: object) -> None:
    """Refuse an already sharded model and a bad ``min_params``, before any collective.

    >>> import torch
    >>> check_shardable(torch.nn.Linear(2, 1), min_params=0)
    Traceback (most recent call last):
    ...
    ValueError: min_params=0 must be a positive int ...
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
    """A snapshot of the whole model's weights on rank 0, on CPU; an empty dict on the other ranks.

    Every tensor is a fresh copy: a later optimizer step does not change it.

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
        gathered = get_model_state_dict(model, options=options)
        # At world size 1 a gathered parameter, and at any size a buffer, is the live tensor
        live = {_storage(t) for t in itertools.chain(model.parameters(), model.buffers())}
        return {
            name: value.detach().clone()
            if isinstance(value, torch.Tensor) and _storage(value) in live
            else value
            for name, value in gathered.items()
        }
    if rank != 0:
        return {}
    return {
        name: value.detach().to("cpu", copy=True)
        for name, value in unwrap_model(model).state_dict().items()
    }


def _storage(value: object) -> int | None:
    """The address of ``value``'s memory (a DTensor's local shard's), None for a non-tensor."""
    if not isinstance(value, torch.Tensor):
        return None
    local = value.to_local() if isinstance(value, dtensor_type()) else value
    return int(local.untyped_storage().data_ptr())


#: Parameters that sharding replaced: an optimizer holding them was made before ``ctx.shard``.
#: (by id: a tensor's ``==`` is elementwise, so a WeakSet's membership test cannot serve).
_REPLACED: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()
#: Optimizers already checked for them (once each: the step pre-hook runs every step).
_CHECKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

#: The process's one step pre-hook of :func:`refuse_flattening_optimizers` (torch's
#: optimizer hooks are process-wide, so the guard is too; installed at most once).
_FLATTENING_GUARD: list[Any] = []


def refuse_flattening_optimizers() -> None:
    """Make LBFGS over sharded parameters fail at its first ``step`` with the cause and the fix.

    LBFGS flattens every parameter and gradient into one vector (``view(-1)``),
    which a sharded ``DTensor`` cannot do; torch's own error ("would remove or
    reshape sharded dimension 0") names neither, and at one rank it comes for
    some shapes only, so it is refused at every world size. The check runs
    before each ``step`` of an LBFGS (a type test for the others).
    """
    if _FLATTENING_GUARD:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    _FLATTENING_GUARD.append(register_optimizer_step_pre_hook(_refuse_lbfgs_on_shards))


def _refuse_lbfgs_on_shards(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    if _REPLACED and optimizer not in _CHECKED:
        _CHECKED.add(optimizer)
        params = [param for group in optimizer.param_groups for param in group["params"]]
        stale = sum(1 for param in params if _REPLACED.get(id(param)) is param)
        if stale:
            _CHECKED.discard(optimizer)
            raise ValueError(
                f"{type(optimizer).__name__} holds {stale} of {len(params)} parameters from "
                "before ctx.shard: sharding replaced them, so its steps would change tensors the "
                "model no longer uses and the model would never train. Create the optimizer "
                "after ctx.shard(model), from the sharded model's parameters."
            )
    if not isinstance(optimizer, torch.optim.LBFGS):
        return
    dtensor = dtensor_type()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, dtensor):
                raise TypeError(
                    f"{type(optimizer).__name__} cannot step a model sharded with ctx.shard: it "
                    "flattens all parameters into one vector, which sharded DTensor parameters "
                    "cannot do (at one rank too, where it fails for some shapes only). Use "
                    "ctx.wrap(model) (DDP) for LBFGS, or an optimizer that works per parameter "
                    "(SGD, Adam, AdamW) with ctx.shard."
                )
