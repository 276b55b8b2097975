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
from typing import Any

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


def worker_seed(base: int, rank: int, worker: int, epoch: int) -> int:
    """A seed for one DataLoader worker, distinct for every (rank, worker, epoch).

    >>> worker_seed(0, 0, 0, 0) != worker_seed(0, 1, 0, 0) != worker_seed(0, 0, 1, 0)
    True
    """
    words = np.random.SeedSequence([base, rank, worker, epoch]).generate_state(2)
    return int(words[0]) << 32 | int(words[1])


def seed_worker(seed: int) -> None:
    """Seed a DataLoader worker's ``random``, NumPy and torch from one 64-bit seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's generator states, as tensors and numbers (loadable with weights_only=True).

    >>> state = rng_state(); before = random.random()
    >>> set_rng_state(state); random.random() == before
    True
    """
    version, internal, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    cuda_ready = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    return {
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if cuda_ready else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["kind"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["position"],
            numpy["has_gauss"],
            numpy["cached"],
        )
    )
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


#: The generator types :func:`generator_state` captures, by the label stored with the state.
GENERATOR_KINDS: dict[str, type] = {
    "random.Random": random.Random,
    "numpy.random.Generator": np.random.Generator,
    "numpy.random.RandomState": np.random.RandomState,
    "torch.Generator": torch.Generator,
}


def generator_kind(obj: object) -> str | None:
    """The label of ``obj``'s generator type, or None if it is not a generator."""
    for label, kind in GENERATOR_KINDS.items():
        if isinstance(obj, kind):
            return label
    return None


def _plain(value: Any) -> Any:
    """NumPy arrays inside a generator state as int64 tensors (loadable with weights_only)."""
    if isinstance(value, np.ndarray):
        return {"array": torch.from_numpy(value.astype(np.int64)), "dtype": str(value.dtype)}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _numpy(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"array", "dtype"}:
        return value["array"].cpu().numpy().astype(value["dtype"])
    if isinstance(value, dict):
        return {key: _numpy(item) for key, item in value.items()}
    return value


def generator_state(obj: Any) -> dict[str, Any]:
    """The state of one generator object, as tensors and numbers.

    >>> rng = random.Random(3); state = generator_state(rng); first = rng.random()
    >>> set_generator_state(rng, state); rng.random() == first
    True
    """
    kind = generator_kind(obj)
    if kind == "random.Random":
        version, internal, gauss = obj.getstate()
        state: Any = {"version": version, "state": torch.tensor(internal), "gauss": gauss}
    elif kind == "numpy.random.Generator":
        state = _plain(obj.bit_generator.state)
    elif kind == "numpy.random.RandomState":
        state = _plain(obj.get_state(legacy=False))
    elif kind == "torch.Generator":
        state = obj.get_state()
    else:
        raise TypeError(f"{type(obj).__name__} is not a random generator")
    return {"kind": kind, "state": state}


def set_generator_state(obj: Any, captured: dict[str, Any]) -> None:
    """Restore what :func:`generator_state` captured into ``obj`` (of the same kind)."""
    kind, state = captured["kind"], captured["state"]
    if kind == "random.Random":
        obj.setstate((state["version"], tuple(state["state"].tolist()), state["gauss"]))
    elif kind == "numpy.random.Generator":
        obj.bit_generator.state = _numpy(state)
    elif kind == "numpy.random.RandomState":
        obj.set_state(_numpy(state))
    else:
        obj.set_state(state.cpu())


def reseed_generator(obj: Any, seed: int) -> None:
    """Seed one generator object with ``seed`` (a non-negative int below 2**63)."""
    kind = generator_kind(obj)
    if kind == "random.Random":
        obj.seed(seed)
    elif kind == "numpy.random.Generator":
        obj.bit_generator.state = type(obj.bit_generator)(seed).state
    elif kind == "numpy.random.RandomState":
        obj.seed(seed % 2**32)
    else:
        obj.manual_seed(seed)
