"""ddpctx: torchrun + DistributedDataParallel plumbing that is safe and short.

>>> from ddpctx import distributed
>>> with distributed(seed=42) as ctx:
...     ctx.world_size
1

Names are imported on first use, so that ``import ddpctx.testing`` (the pytest
plugin, loaded by every pytest run) does not import torch. The module paths of
the flat layout before the subpackages (``ddpctx.wire``, ...) still import for a
release, each name with a ``DeprecationWarning``: :mod:`ddpctx.utils.moved`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ddpctx.utils.moved import serve_old_paths

if TYPE_CHECKING:
    from ddpctx.checkpoint.weights import checkpoint_meta, load_weights
    from ddpctx.compat import (
        cleanup_ddp,
        format_time,
        get_model_size,
        reduce_tensor,
        set_seed,
        setup_ddp,
    )
    from ddpctx.hang.inflight import HangError
    from ddpctx.launching.launcher import RankError, RankTimeoutError, launch
    from ddpctx.rankzero.decorators import all_reduced, rank_zero_first, rank_zero_only
    from ddpctx.rankzero.outcome import RankZeroError
    from ddpctx.rankzero.report import get_logger, progress
    from ddpctx.reduce.collectives import ReductionError
    from ddpctx.session.context import DistributedSession, current, distributed
    from ddpctx.session.distcontext import DistContext
    from ddpctx.watch.clock import PhaseTimes
    from ddpctx.watch.straggler import StragglerSettings

__version__ = "0.1.0"

serve_old_paths()

_HOMES = {
    "checkpoint_meta": "ddpctx.checkpoint.weights",
    "load_weights": "ddpctx.checkpoint.weights",
    "ReductionError": "ddpctx.reduce.collectives",
    "cleanup_ddp": "ddpctx.compat",
    "format_time": "ddpctx.compat",
    "get_model_size": "ddpctx.compat",
    "reduce_tensor": "ddpctx.compat",
    "set_seed": "ddpctx.compat",
    "setup_ddp": "ddpctx.compat",
    "DistContext": "ddpctx.session.distcontext",
    "DistributedSession": "ddpctx.session.context",
    "current": "ddpctx.session.context",
    "distributed": "ddpctx.session.context",
    "all_reduced": "ddpctx.rankzero.decorators",
    "rank_zero_first": "ddpctx.rankzero.decorators",
    "rank_zero_only": "ddpctx.rankzero.decorators",
    "HangError": "ddpctx.hang.inflight",
    "RankError": "ddpctx.launching.launcher",
    "RankTimeoutError": "ddpctx.launching.launcher",
    "launch": "ddpctx.launching.launcher",
    "RankZeroError": "ddpctx.rankzero.outcome",
    "get_logger": "ddpctx.rankzero.report",
    "progress": "ddpctx.rankzero.report",
    "PhaseTimes": "ddpctx.watch.clock",
    "StragglerSettings": "ddpctx.watch.straggler",
}

__all__ = [
    "DistContext",
    "DistributedSession",
    "HangError",
    "PhaseTimes",
    "RankError",
    "RankTimeoutError",
    "RankZeroError",
    "ReductionError",
    "StragglerSettings",
    "__version__",
    "all_reduced",
    "checkpoint_meta",
    "cleanup_ddp",
    "current",
    "distributed",
    "format_time",
    "get_logger",
    "get_model_size",
    "launch",
    "load_weights",
    "progress",
    "rank_zero_first",
    "rank_zero_only",
    "reduce_tensor",
    "set_seed",
    "setup_ddp",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'ddpctx' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
