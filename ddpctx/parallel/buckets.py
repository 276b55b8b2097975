"""DDP's gradient-bucket layout: saved with a checkpoint, given back to the resumed model.

DDP reduces gradients in *buckets*, flat buffers that hold several
parameters' gradients each. Its first iteration uses one bucket laid out in
parameter order; at the start of the second forward it rebuilds the buckets
in the order the first backward made the gradients ready (then sized by
``bucket_cap_mb``), and keeps that layout for good. Where a gradient element
sits in the buffer matters for the last bits of the sum: from 3 ranks gloo's
ring adds an element's contributions in an order set by its chunk of the
buffer. So a run resumed from a checkpoint, whose fresh DDP starts with the
initial layout again, reduced its first step differently from the
uninterrupted run (which used the rebuilt layout by then): the weights
differed in the last bits (measured: 4 of 8 tensors of a 4-layer MLP at 3
ranks).

The fix costs nothing per step: :func:`bucket_layout` reads the rebuilt
layout (parameter indices per bucket, rank 0's, which DDP broadcast to every
rank) into the checkpoint, and :func:`install_bucket_layout` gives a model
that has not run an iteration yet a reducer built with that layout, as
``DistributedDataParallel.__setstate__`` builds one. Its first step then
reduces exactly as the uninterrupted run's step did; after it, DDP's own
rebuild finds the same gradient-ready order and the same layout.
``find_unused_parameters=True`` (DDP never rebuilds) records nothing.

The layout goes to the model given to ``load_checkpoint``: wrap before
loading (``model = ctx.wrap(net)``, then ``load_checkpoint(model=model)``),
as the README's examples do. The bare module of a ``ctx.wrap`` model
(nanoGPT's ``raw_model = model.module``, or ``ctx.unwrap(model)``) counts as
that model, in a save and in a load: :func:`find_ddp` finds the wrapper
``ctx.wrap`` made around it (:func:`~ddpctx.parallel.wrapping.wrapper_of`). A
bare module loaded and wrapped afterwards, or wrapped in a DDP made by hand,
starts from DDP's initial layout.

One case stays inexact: ``static_graph=True`` with a checkpoint saved after
exactly one iteration. A static graph's first backward records no gradient
order (DDP delays its reduction to the end of that backward), so DDP only
rebuilds at the start of the *third* forward, and after one iteration there
is no rebuilt layout to save. Saved after two or more iterations, a
static-graph run resumes exactly.

Both functions reach into DDP's private reducer API, which changes between
torch releases. Each checks what it uses first (the attributes, and the
``Reducer`` constructor called by keyword, so a renamed or reordered
argument cannot be misread): where the running torch lacks something, or a
saved layout does not fit the model (a bucket that mixes dtypes or devices,
or holds a sparse-gradient parameter with others), it warns and the model
keeps DDP's default layout: the load goes on, and only the first resumed
steps may differ from the uninterrupted run's in the last bits (from 3
ranks). A comm hook registered with DDP's private
``_register_builtin_comm_hook`` is not carried over to the new reducer
(DDP does not record it); one registered with ``register_comm_hook`` is.

Example:
    >>> import torch
    >>> bucket_layout(torch.nn.Linear(2, 1)) is None  # not DDP: nothing to record
    True
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpctx.parallel.wrapping import wrapper_of
from ddpctx.utils.warn import warn_user

#: The attribute that holds the layout a load installed, for a save before the next rebuild.
_INSTALLED = "_ddpctx_installed_bucket_layout"


#: torch's DDP reducer API is private and untyped: reached through ``Any``.
_c10d: Any = torch.distributed


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DDP module of ``model``, or None: ``model`` itself, one inside ``torch.compile``, or
    the wrapper ``ctx.wrap`` made around ``model`` (the bare module a script keeps)."""
    while not isinstance(model, DistributedDataParallel):
        made = wrapper_of(model)
        if made is not None:
            return made
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return model


def bucket_layout(model: nn.Module) -> list[list[int]] | None:
    """The rebuilt bucket layout of a DDP ``model`` (parameter indices per bucket), else None.

    None when ``model`` is no DDP model, has run no iteration yet, or never
    rebuilds (``find_unused_parameters=True``). DDP rebuilds at the start of
    the *second* forward; after exactly one iteration this rebuilds now, as
    that forward would have (same order, same layout), so a checkpoint saved
    then records the layout the next step uses. Call it on every rank: the
    rebuild broadcasts rank 0's layout.
    """
    found = find_ddp(model)
    if found is None:
        return None
    ddp: Any = found
    try:
        if not getattr(ddp, "_has_rebuilt_buckets", False) and ddp.reducer._rebuild_buckets():
            ddp._has_rebuilt_buckets = True  # as DDP's own forward records it
        if not getattr(ddp, "_has_rebuilt_buckets", False):
            installed = getattr(ddp, _INSTALLED, None)  # loaded, not stepped since: current
            return None if installed is None else [list(bucket) for bucket in installed]
        parameters, _ = ddp._build_params_for_reducer()
        index = {id(parameter): number for number, parameter in enumerate(parameters)}
        buckets = ddp.reducer._get_zeros_like_grad_buckets()
        return [[index[id(parameter)] for parameter in bucket.parameters()] for bucket in buckets]
    except (AttributeError, TypeError) as error:  # another torch's private API
        _unsupported(f"{type(error).__name__}: {error}")
        return None


def install_bucket_layout(model: nn.Module, layout: Any) -> bool:
    """Give a fresh DDP ``model`` a reducer with the saved ``layout``; True if it was given.

    Nothing happens (False) when ``model`` is no DDP model, has already
    rebuilt its buckets (it ran an iteration: its layout is its own), keeps
    its first layout for good (``find_unused_parameters=True``), or when
    ``layout`` is not a partition of its parameters (another model).
    """
    found = find_ddp(model)
    if found is None or getattr(found, "_has_rebuilt_buckets", False):
        return False
    ddp: Any = found
    try:  # everything this uses is checked (and the reducer built) before the old one goes
        if ddp.find_unused_parameters:
            return False
        parameters, expect_sparse_gradient = ddp._build_params_for_reducer()
        if not _partition(layout, len(parameters)):
            return False
        unfit = _unfit_bucket(layout, parameters, expect_sparse_gradient)
        if unfit:
            warn_user(
                f"the checkpoint's DDP gradient-bucket layout does not fit this model ({unfit}), "
                "so it keeps DDP's default layout: from 3 ranks its first resumed steps may "
                "differ from the uninterrupted run's in the last bits.",
                RuntimeWarning,
            )
            return False
        remove_old_hooks = ddp.reducer._remove_autograd_hooks
        reducer = _c10d.Reducer(
            **_reducer_arguments(ddp, parameters, expect_sparse_gradient, layout)
        )
        logger = _c10d.Logger(reducer)
        register_hook = _c10d._register_comm_hook
        static_graph = (reducer._set_static_graph, logger._set_static_graph)
        set_precision = reducer._set_mixed_precision_param_dtype
        reducer.set_logger(logger)
    except (AttributeError, TypeError) as error:  # another torch's private API
        _unsupported(f"{type(error).__name__}: {error}")
        return False
    remove_old_hooks()  # the old reducer must not see this run's gradients
    ddp.reducer, ddp.logger = reducer, logger
    if ddp.static_graph:
        for mark in static_graph:
            mark()
    if ddp.mixed_precision is not None:
        set_precision(ddp.mixed_precision.param_dtype)
    for hook, state in ddp._comm_hooks:  # hooks registered before the load
        register_hook(reducer, state, hook)
    setattr(ddp, _INSTALLED, [list(bucket) for bucket in layout])
    return True


def _reducer_arguments(
    ddp: Any, parameters: list[Any], expect_sparse_gradient: list[bool], layout: list[list[int]]
) -> dict[str, Any]:
    """``dist.Reducer``'s arguments, by name, as ``DistributedDataParallel.__setstate__``
    gives them (torch 2.13); a torch that names them otherwise raises a ``TypeError``."""
    config = ddp._bucket_config
    _, rebuild_limits = config.compute_bucket_size_limits(
        static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters
    )
    return {
        "params": parameters,
        "bucket_indices": [list(bucket) for bucket in layout],
        "per_bucket_size_limits": [config.bucket_bytes_cap] * len(layout),
        "process_group": ddp.process_group,
        "expect_sparse_gradients": expect_sparse_gradient,
        "bucket_bytes_cap": ddp.bucket_bytes_cap,
        "find_unused_parameters": ddp.find_unused_parameters,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "param_to_name_mapping": ddp._build_debug_param_to_name_mapping(parameters),
        "first_bucket_bytes_cap": config.first_bucket_bytes_cap,
        "skip_all_reduce_unused_params": ddp.skip_all_reduce_unused_params,
        "use_python_reducer": ddp._use_python_reducer,
        "bucket_bytes_cap_list": rebuild_limits,
        "batched_grad_copy": ddp.batched_grad_copy,
    }


@functools.cache
def _unsupported(reason: str) -> None:
    """Warn (once per reason) that this torch cannot be given a saved layout."""
    warn_user(
        f"torch {torch.__version__} cannot be given the saved DDP gradient-bucket layout "
        f"(its private DDP API differs: {reason}), so the resumed model keeps DDP's default "
        "layout: the load goes on, but from 3 ranks its first resumed steps may differ from "
        "the uninterrupted run's in the last bits. Use the torch version ddpctx is tested "
        "with (2.13) for bit-identical resumes.",
        RuntimeWarning,
    )


def _unfit_bucket(
    layout: list[list[int]], parameters: list[Any], expect_sparse_gradient: list[bool]
) -> str:
    """Why a bucket of ``layout`` cannot be one of DDP's (mixed dtypes or devices, a sparse
    gradient with others), or "" when every bucket can."""
    for bucket in layout:
        kinds = {(parameters[index].dtype, parameters[index].device) for index in bucket}
        if len(kinds) > 1:
            return f"bucket {bucket} mixes {sorted(map(str, kinds))}"
        sparse = [index for index in bucket if expect_sparse_gradient[index]]
        if sparse and len(bucket) > 1:
            return f"bucket {bucket} puts sparse-gradient parameter {sparse[0]} with others"
    return ""


def _partition(layout: Any, count: int) -> bool:
    """Whether ``layout`` lists every index ``0 .. count-1`` once, in non-empty buckets."""
    if not isinstance(layout, list) or not all(
        isinstance(bucket, list) and bucket for bucket in layout
    ):
        return False
    flat = [index for bucket in layout for index in bucket]
    return all(isinstance(index, int) for index in flat) and sorted(flat) == list(range(count))
