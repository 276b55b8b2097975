"""Tensor parallel on a 2-D mesh: FSDP2 over the data axis, torch's plans over the other.

``ctx.shard(model, tp_plan={...}, tp_size=2)`` is the recipe torchtitan uses
(and Lightning Fabric's ``ModelParallelStrategy``): the ranks form a mesh of
``(world_size // tp_size, tp_size)`` named ``("dp", "tp")``; torch's
``parallelize_module`` applies the plan (``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``, ...) over the ``"tp"`` axis, then
``fully_shard`` shards every block over the ``"dp"`` axis. The tensor-parallel
axis is the inner one: ranks ``0..tp_size-1`` form the first tensor-parallel
group, and rank ``r`` reads the data of data-parallel rank ``r // tp_size``
(``ctx.dataloader(..., tp_size=2)``): every rank of a group must see the
same batch, as torch's plans assume (their inputs are replicated).

Why an argument of ``ctx.shard`` and not of ``distributed()``: the mesh is a
fact of how one model is split, and ``ctx.mesh`` (one dimension over every
rank) is already a public contract that ``ctx.shard`` without a plan keeps.
:func:`parallel_mesh` makes the two-dimensional mesh once per size
(``ctx.parallel_mesh(tp_size)``), for what a plan needs beside the model
(``loss_parallel``, a rank's place on each axis).

What is checked before any collective, with the fix in the message: the
world size divides by ``tp_size`` (both named), every key of the plan names
a submodule (torch's ``fnmatch`` wildcards allowed, as ``parallelize_module``
reads them; torch itself only warns and skips), every value is a
``ParallelStyle``, and a plan comes with a ``tp_size`` and the reverse.
``tp_size=1`` shards as ``ctx.shard`` without a plan does (the plan's keys are
still checked, so the script stays right at any size).

What was measured on torch 2.13, CPU and gloo, at 2 x 2 ranks: the mesh,
``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` (and
``SequenceParallel`` applied, not trained), ``fully_shard(mesh=mesh["dp"])``
over it, training, ``get_model_state_dict(full_state_dict=True)`` and
``dcp.save``/``dcp.load`` all work. torch's ``clip_grad_norm_`` does not:
parameters a plan leaves out live on the ``"dp"`` mesh, planned ones on
the ``("dp", "tp")`` mesh, and ``torch.stack`` of their norms raises "All
operands in aten.stack.default must have the same mesh";
:mod:`ddpctx.parallel.clipping` takes each mesh's norm apart and combines
them.

This module knows torch and nothing of the context.

Example:
    >>> check_tp_size(2, world_size=4)
    2
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The names of the two-dimensional mesh's axes, outer (data) first.
AXES = ("dp", "tp")


def check_tp_size(tp_size: object, world_size: int) -> int:
    """``tp_size`` as an int dividing ``world_size``; anything else refused naming both and the fix.

    >>> check_tp_size(3, world_size=4)
    Traceback (most recent call last):
    ...
    ValueError: tp_size=3 does not divide the world size 4: ...
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(
            f"tp_size={tp_size!r} must be a positive int: the number of ranks that split each "
            "planned layer (e.g. tp_size=2); the data-parallel size is world_size // tp_size."
        )
    if world_size % tp_size:
        raise ValueError(
            f"tp_size={tp_size} does not divide the world size {world_size}: the mesh is "
            f"(data={world_size}//tp_size, tensor=tp_size), so data x tensor must equal "
            f"{world_size}. Start a multiple of {tp_size} ranks (torchrun --nproc_per_node), or "
            f"pass a tp_size that divides {world_size}."
        )
    return tp_size


def parallel_mesh(device_type: str, world_size: int, tp_size: int) -> DeviceMesh:
    """The ``("dp", "tp")`` mesh of ``(world_size // tp_size, tp_size)`` ranks (a collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    tp_size = check_tp_size(tp_size, world_size)
    return init_device_mesh(device_type, (world_size // tp_size, tp_size), mesh_dim_names=AXES)


def _matches(key: str, name: str) -> bool:
    """Whether plan key ``key`` names module path ``name``, atom by atom, as torch reads it."""
    atoms, parts = key.split("."), name.split(".")
    return len(atoms) == len(parts) and all(
        fnmatch(p, a) for a, p in zip(atoms, parts, strict=True)
    )


def check_plan(model: nn.Module, plan: object, tp_size: object) -> dict[str, Any]:
    """The plan as a dict, once every key names a submodule of ``model`` and every value is a style.

    >>> import torch
    >>> from torch.distributed.tensor.parallel import ColwiseParallel
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 4))
    >>> check_plan(model, {"1": ColwiseParallel()}, tp_size=2)
    Traceback (most recent call last):
    ...
    ValueError: tp_plan key '1' names no submodule of Sequential: ...
    """
    if plan is None:
        if tp_size is not None:
            raise ValueError(
                f"ctx.shard(tp_size={tp_size!r}) got no tp_plan: say which layers to split, "
                "e.g. tp_plan={'layers.*.attn.q': ColwiseParallel(), 'layers.*.attn.out': "
                "RowwiseParallel()} (torch.distributed.tensor.parallel), or drop tp_size."
            )
        return {}
    if tp_size is None:
        raise ValueError(
            "ctx.shard(tp_plan=...) needs tp_size=: how many ranks split each planned layer "
            "(e.g. tp_size=2; the world size must divide by it)."
        )
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(
            f"tp_plan={plan!r} must be a non-empty dict of module paths to parallel styles, "
            "e.g. {'0': ColwiseParallel(), '2': RowwiseParallel()} "
            "(torch.distributed.tensor.parallel)."
        )
    names = [name for name, _ in model.named_modules() if name]
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise TypeError(
                f"tp_plan key {key!r} must be a module path such as 'layers.0.attn.q' "
                "(wildcards allowed: 'layers.*.attn.q')."
            )
        if not any(_matches(key, name) for name in names):
            near = [name for name in names if name.split(".")[-1] == key.split(".")[-1]]
            raise ValueError(
                f"tp_plan key {key!r} names no submodule of {type(model).__name__}: torch "
                "would skip it and leave that layer whole. Use a path from "
                f"model.named_modules(){f', e.g. {near[:3]}' if near else ''} (wildcards "
                "allowed: 'layers.*.mlp.up')."
            )
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"tp_plan[{key!r}] is a {type(style).__name__}, not a ParallelStyle: use "
                "ColwiseParallel(), RowwiseParallel(), SequenceParallel(), ... from "
                "torch.distributed.tensor.parallel."
            )
    return dict(plan)


def apply_plan(model: nn.Module, mesh: DeviceMesh, plan: Mapping[str, Any]) -> nn.Module:
    """``parallelize_module`` of ``model`` over ``mesh["tp"]`` with a checked ``plan``."""
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh[AXES[1]], dict(plan))
