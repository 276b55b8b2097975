"""ddpctx: torchrun + DistributedDataParallel plumbing that is safe and short.

>>> from ddpctx import distributed
>>> with distributed(seed=42) as ctx:
...     ctx.world_size
1
"""

from ddpctx.collectives import ReductionError
from ddpctx.compat import (
    cleanup_ddp,
    format_time,
    get_model_size,
    reduce_tensor,
    set_seed,
    setup_ddp,
)
from ddpctx.context import DistContext, DistributedSession, current, distributed
from ddpctx.decorators import all_reduced, rank_zero_first, rank_zero_only
from ddpctx.rankzero import RankZeroError

__version__ = "0.1.0"

__all__ = [
    "DistContext",
    "DistributedSession",
    "RankZeroError",
    "ReductionError",
    "__version__",
    "all_reduced",
    "cleanup_ddp",
    "current",
    "distributed",
    "format_time",
    "get_model_size",
    "rank_zero_first",
    "rank_zero_only",
    "reduce_tensor",
    "set_seed",
    "setup_ddp",
]
