"""Seeds and the deterministic-algorithm switches.

Each rank is seeded with ``seed + rank`` so that dropout masks, augmentations
and random crops differ between ranks, while anything that must agree across
ranks (the DistributedSampler's shuffle) is seeded with the base seed
elsewhere. Seeding here covers Python's ``random``, NumPy's global generator,
torch's CPU generator and every CUDA device's generator.

Example:
    >>> import random
    >>> seed_everything(7); first = random.random()
    >>> seed_everything(7); first == random.random()
    True
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import numpy as np
import torch

#: NumPy's global generator takes seeds in [0, 2**32).
MAX_SEED = 2**32 - 1

# cuBLAS needs a fixed workspace for reproducible results on CUDA >= 10.2;
# torch's deterministic mode raises at the first matmul without it.
_CUBLAS_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
_CUBLAS_DETERMINISTIC = ":4096:8"


def validate_seed(seed: object, world_size: int) -> int | None:
    """Check ``seed`` before anything starts: an int such that every rank's seed fits.

    >>> validate_seed(42, world_size=4)
    42
    """
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise ValueError(
            f"seed={seed!r} ({type(seed).__name__}) is not an int. Pass an integer such as "
            "seed=42, or seed=None to leave the generators alone."
        )
    value = int(seed)
    highest = value + world_size - 1
    if value < 0 or highest > MAX_SEED:
        raise ValueError(
            f"seed={value} gives rank seeds {value}..{highest}, outside [0, {MAX_SEED}] that "
            f"NumPy accepts (each rank uses seed + rank). Pass a seed between 0 and "
            f"{MAX_SEED - world_size + 1}."
        )
    return value


def seed_everything(seed: int) -> None:
    """Seed ``random``, NumPy, torch and every CUDA device with ``seed``."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device when CUDA is initialised
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def enable_deterministic() -> Callable[[], None]:
    """Turn on deterministic algorithms and the cuDNN flags; return a function that undoes it.

    >>> restore = enable_deterministic()
    >>> torch.are_deterministic_algorithms_enabled()
    True
    >>> restore(); torch.are_deterministic_algorithms_enabled()
    False
    """
    was_enabled = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_cudnn_deterministic = torch.backends.cudnn.deterministic
    was_cudnn_benchmark = torch.backends.cudnn.benchmark
    had_cublas = os.environ.get(_CUBLAS_VARIABLE)

    if had_cublas is None:
        os.environ[_CUBLAS_VARIABLE] = _CUBLAS_DETERMINISTIC
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False

    def restore() -> None:
        torch.use_deterministic_algorithms(was_enabled, warn_only=was_warn_only)
        torch.backends.cudnn.deterministic = was_cudnn_deterministic
        torch.backends.cudnn.benchmark = was_cudnn_benchmark
        if had_cublas is None:
            os.environ.pop(_CUBLAS_VARIABLE, None)

    return restore
