"""Finding the bare module inside DDP and ``torch.compile`` wrappers.

>>> import torch
>>> layer = torch.nn.Linear(2, 1)
>>> unwrap_model(torch.compile(layer)) is layer
True
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare module inside DDP (and ``torch.compile``) wrappers."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
            model = inner
        else:
            return model
