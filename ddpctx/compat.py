"""The helper names of a Kronos-style ``training_utils.py``, on ddpctx machinery.

For scripts written around ``setup_ddp`` / ``cleanup_ddp`` / ``set_seed`` /
``reduce_tensor``: swap the import and keep the script. What changes:

- ``setup_ddp`` works without a GPU (gloo) and without torchrun (world size
  1), and validates the launcher's variables;
- ``reduce_tensor`` never mutates its input and computes a true mean on every
  backend (gloo has no ``ReduceOp.AVG``; dividing an AVG by the world size
  again is the classic bug it avoids);
- ``cleanup_ddp`` is safe to call twice, or without ``setup_ddp``.

Example:
    >>> rank, world_size, local_rank = setup_ddp()
    >>> (rank, world_size, local_rank)
    (0, 1, 0)
    >>> cleanup_ddp()
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ddpctx.reduce.collectives import Site, all_reduce_tree, check_op, group_size
from ddpctx.session.context import current, distributed
from ddpctx.utils.seeding import seed_everything, validate_seed


def setup_ddp() -> tuple[int, int, int]:
    """Enter distributed mode and return ``(rank, world_size, local_rank)``.

    Pair it with :func:`cleanup_ddp` in a ``finally``; new code should prefer
    ``with distributed() as ctx:``, which cannot forget the clean-up.

    >>> rank, world_size, local_rank = setup_ddp()
    >>> cleanup_ddp()
    """
    context = current()
    if context is None:
        context = distributed().__enter__()
    return context.rank, context.world_size, context.local_rank


def cleanup_ddp() -> None:
    """Tear down what :func:`setup_ddp` started; a no-op when nothing is active.

    >>> cleanup_ddp()  # nothing active: nothing to do
    """
    context = current()
    if context is not None:
        context._close()


def set_seed(seed: int, rank: int = 0) -> None:
    """Seed ``random``, NumPy, torch and CUDA with ``seed + rank``.

    As in the original, on CUDA this also makes cuDNN deterministic and turns
    off its autotuner.

    >>> set_seed(42, rank=1)
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(
            f"rank={rank!r} must be a non-negative int, e.g. the rank setup_ddp() returned."
        )
    # world_size=rank + 1 makes validate_seed check that seed + rank still fits.
    base = validate_seed(seed, world_size=rank + 1)
    if base is None:
        raise ValueError("seed=None: set_seed() needs an int such as 42.")
    seed_everything(base + rank)
    if torch.cuda.is_available():
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def reduce_tensor(
    tensor: torch.Tensor, world_size: int | None = None, op: str = "mean"
) -> torch.Tensor:
    """Reduce ``tensor`` across ranks into a new tensor; the input is left untouched.

    ``op`` is ``"mean"`` (alias ``"avg"``), ``"sum"``, ``"max"``, ``"min"`` or
    ``"prod"``. ``world_size`` is accepted for old call sites and checked
    against the actual group size. Runs on the engine behind ``@all_reduced``,
    so ranks passing different shapes get an error, not garbage.

    >>> reduce_tensor(torch.tensor([2.0, 4.0]))
    tensor([2., 4.])
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"reduce_tensor() needs a torch.Tensor, got {type(tensor).__name__} {tensor!r:.40}. "
            "Wrap it (torch.tensor(x)), or reduce plain values with ctx.all_reduce."
        )
    name = "mean" if isinstance(op, str) and op.lower() == "avg" else op
    check_op(name)
    actual = group_size()
    if world_size is not None and world_size != actual:
        raise ValueError(
            f"world_size={world_size} but the process group has {actual} ranks; pass "
            "world_size=None (or the group's size)."
        )
    caller = sys._getframe(1)
    key = f"reduce_tensor at {caller.f_code.co_filename}:{caller.f_lineno}"
    context = current()
    sites = context._sites if context is not None else {}
    result: torch.Tensor = all_reduce_tree(tensor, name, site=sites.setdefault(key, Site(key)))
    return result.clone() if result.data_ptr() == tensor.data_ptr() else result


def get_model_size(model: nn.Module) -> str:
    """Trainable parameters, human-readable: ``24,714,690 -> "24.7M"``.

    >>> get_model_size(torch.nn.Linear(1000, 1000))
    '1.0M'
    """
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for threshold, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= threshold:
            return f"{count / threshold:.1f}{suffix}"
    return str(count)


def format_time(seconds: float) -> str:
    """``H:MM:SS`` for a duration, whole seconds (truncated): ``3725.9 -> "1:02:05"``.

    >>> format_time(3725.9)
    '1:02:05'
    """
    if not seconds >= 0:
        raise ValueError(
            f"seconds={seconds!r} must be a non-negative duration; pass e.g. "
            "time.monotonic() - started."
        )
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
