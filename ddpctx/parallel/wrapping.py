"""Finding the bare module inside DDP and ``torch.compile`` wrappers, and the way back.

:func:`unwrap_model` goes inwards: the bare module inside DDP and compile
wrappers. :func:`wrapper_of` goes outwards, for the DDP wrappers ``ctx.wrap``
made: scripts keep the bare module (nanoGPT's ``raw_model = model.module``)
and hand it to ``ctx.save_checkpoint``/``load_checkpoint``, whose DDP gradient-bucket
layout (:mod:`ddpctx.parallel.buckets`) lives on the wrapper. The map holds
both weakly: a wrapper the script dropped is forgotten, and the map keeps no
module alive.

>>> import torch
>>> layer = torch.nn.Linear(2, 1)
>>> unwrap_model(torch.compile(layer)) is layer
True
>>> wrapper_of(layer) is None  # never wrapped by ctx.wrap
True
"""

from __future__ import annotations

import weakref

from torch import nn
from torch.nn.parallel import DistributedDataParallel

#: Module -> the DDP wrapper ``ctx.wrap`` made around it (a weak reference: the wrapper
#: holds the module, so a strong one would keep both alive for good).
_WRAPPERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[DistributedDataParallel]] = (
    weakref.WeakKeyDictionary()
)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare module inside DDP (and ``torch.compile``) wrappers."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
            model = inner
        else:
            return model


def remember_wrapper(wrapper: DistributedDataParallel) -> None:
    """Note that ``wrapper`` wraps its module (and the bare one inside a compiled module)."""
    for module in (wrapper.module, unwrap_model(wrapper.module)):
        _WRAPPERS[module] = weakref.ref(wrapper)


def wrapper_of(module: nn.Module) -> DistributedDataParallel | None:
    """The DDP wrapper ``ctx.wrap`` made around ``module`` (the newest, while it lives), or None."""
    found = _WRAPPERS.get(module)
    wrapper = found() if found is not None else None
    if wrapper is None or unwrap_model(wrapper) is not unwrap_model(module):
        return None
    return wrapper
