"""Atomic saves and training checkpoints that resume exactly.

- :func:`atomic_save`: write to a temporary file in the target directory
  (created with the process umask, never in a shared temporary location),
  fsync it, rename it over the target, fsync the directory. A crash leaves
  either the old file or the new one, never a torn one; a temporary file
  left by a killed writer is removed by the next save of the same path.
- A training checkpoint is one such file, ``checkpoint-000007.pt``, holding
  the bare model's state, the optimizer's and scheduler's, the caller's
  meta (e.g. ``epoch``), the world size, and **every rank's** generator
  states, so each rank resumes with exactly its own random stream.
- :func:`newest_checkpoint` skips, with a warning, files that do not load
  (torn by a crash on a filesystem without atomic rename, or not checkpoints).

Everything is loaded with ``weights_only=True``: the states are stored as
tensors and plain numbers, so no pickled code is ever needed.

This module does the file work; :class:`ddpctx.DistContext` decides which rank
writes and makes the others wait.

Example:
    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "weights.pt"
    >>> atomic_save({"w": torch.ones(2)}, target)
    >>> torch.load(target, weights_only=True)["w"]
    tensor([1., 1.])
"""

from __future__ import annotations

import os
import re
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

FORMAT = "ddpctx-checkpoint-1"
_NAME = re.compile(r"^checkpoint-(\d{6,})\.pt$")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The bare module inside DDP (and ``torch.compile``) wrappers."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
            model = inner
        else:
            return model


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` that never leaves a torn file at ``path``."""
    directory = path.parent
    if not directory.is_dir():
        raise FileNotFoundError(
            f"cannot save to {str(path)!r}: the directory {str(directory)!r} does not exist. "
            "Create it first (os.makedirs), or save elsewhere."
        )
    for stale in directory.glob(f".{path.name}.*.tmp"):  # left by a writer that was killed
        stale.unlink(missing_ok=True)
    temporary = directory / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except PermissionError as error:
        raise PermissionError(
            f"cannot save to {str(path)!r}: no permission to create files in "
            f"{str(directory)!r} ({error.strerror}). Save to a directory you can write."
        ) from error
    try:
        with os.fdopen(descriptor, "wb") as handle:
            torch.save(obj, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. platforms that cannot open directories
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def load_file(path: Path, device: torch.device | str, weights_only: bool) -> Any:
    """``torch.load`` with errors that say which file and what to do."""
    if not path.exists():
        raise FileNotFoundError(
            f"{str(path)!r} does not exist. Check the path, or save it first (ctx.save)."
        )
    try:
        return torch.load(path, map_location=device, weights_only=weights_only)
    except Exception as error:
        if weights_only and "GLOBAL" in str(error):  # a pickled callable or class, refused
            raise RuntimeError(
                f"{str(path)!r} holds pickled objects that weights_only=True refuses to run "
                f"({type(error).__name__}). Load it with weights_only=False only if you trust "
                "whoever wrote it."
            ) from error
        raise RuntimeError(
            f"{str(path)!r} could not be loaded as a torch file ({type(error).__name__}: "
            f"{error}). It may be torn or not a checkpoint; use another file."
        ) from error


def checkpoint_paths(directory: Path) -> list[Path]:
    """The checkpoint files in ``directory``, newest (highest number) first."""
    if not directory.is_dir():
        return []
    numbered = [
        (int(match.group(1)), path)
        for path in directory.iterdir()
        if (match := _NAME.match(path.name))
    ]
    return [path for _, path in sorted(numbered, reverse=True)]


def next_checkpoint_path(directory: Path) -> Path:
    existing = checkpoint_paths(directory)
    newest = _NAME.match(existing[0].name) if existing else None
    number = int(newest.group(1)) + 1 if newest else 1
    return directory / f"checkpoint-{number:06d}.pt"


def prune(directory: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints."""
    for old in checkpoint_paths(directory)[keep:]:
        old.unlink(missing_ok=True)


def newest_checkpoint(directory: Path) -> Path | None:
    """The newest checkpoint in ``directory`` that loads; torn ones are skipped with a warning."""
    for path in checkpoint_paths(directory):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            warnings.warn(
                f"skipping {str(path)!r}: it does not load ({type(error).__name__}: {error}); "
                "trying an older checkpoint.",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        if isinstance(state, dict) and state.get("format") == FORMAT:
            return path
        warnings.warn(
            f"skipping {str(path)!r}: it is not a ddpctx checkpoint.", RuntimeWarning, stacklevel=2
        )
    return None


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    meta: dict[str, Any],
    world_size: int,
    rng_states: list[Any],
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "world_size": world_size,
        "model": unwrap_model(model).state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "meta": meta,
        "rng": rng_states,
    }


def check_world_size(state: dict[str, Any], path: Path, world_size: int) -> None:
    if state["world_size"] != world_size:
        raise ValueError(
            f"{str(path)!r} was written by a run of world size {state['world_size']}, and this "
            f"run has world size {world_size}: each rank's random state cannot be restored, so "
            f"the run would not continue exactly. Resume with {state['world_size']} ranks, or "
            "start a new run from its weights: "
            "model.load_state_dict(torch.load(path, weights_only=True)['model'])."
        )
