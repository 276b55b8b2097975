"""Checkpoints read beyond the run: the meta before the model exists, the weights in one process.

- :func:`checkpoint_meta` returns the meta of the checkpoint that
  ``ctx.load_checkpoint`` would restore: the newest one that loads, torn
  or damaged ones skipped with the same warnings, checksums verified. It
  reads no tensor (a ``.pt`` is memory-mapped; of a sharded checkpoint only
  its small ``ddpctx.pt``), needs no process group, changes nothing in the
  directory (no pruning), so it is safe before ``distributed()`` or inside
  it, on any rank. Build the model from it (``GPT(GPTConfig(**meta["model_args"]))``),
  then load.
- :func:`load_weights` returns the model's full state dict -- plain CPU
  tensors, keyed as the unwrapped model's ``state_dict()`` (no DDP or FSDP
  prefixes) -- from a checkpoint directory (the same choice) or one
  checkpoint, a ``.pt`` or a sharded ``.dcp``, in one plain process. A
  ``.pt`` is memory-mapped (copy-on-write) and only the model's bytes are
  read; a sharded checkpoint is read into one full tensor per entry,
  shard by shard (no shard is held twice). Either way memory holds one copy
  of the weights. ``optimizer=True`` adds the optimizer's state, in the form
  ``Optimizer.state_dict()`` has (parameters numbered in the order of the
  optimizer's parameter groups), for an optimizer built over the model's
  parameters as in training.

The choice is :func:`chosen_checkpoint`: ``load_checkpoint``'s for an unsharded
model, from :mod:`ddpctx.checkpoint.files` and :mod:`ddpctx.checkpoint.shardfiles`;
whole when every file its manifest lists is here (:mod:`ddpctx.checkpoint.listed`).
A checkpoint named directly is verified too; a damaged one is an error naming
the damage (there is no older one to fall back to: you chose it).

Beside a running job (:func:`read_newest`): a job that saves with ``keep=``
removes its older checkpoints while a reader may be reading one. A read of a
directory whose failure or "skipping" warnings coincide with the directory's
checkpoints changing (one published, one removed) was overtaken by the
writer: its warnings are dropped (the checkpoint was removed, not damaged)
and the read starts over on the newest checkpoint as soon as the writer
publishes its next one, for :data:`PATIENCE_S` seconds and at least
:data:`ATTEMPTS` times (a busy machine slows a read past one save, not past
many). A read the directory did not change under is reported as before. A
checkpoint named directly that is removed while it is read is a
``FileNotFoundError`` naming it. Only ddpctx's errors escape: a
failure inside DCP's reader is a ``RuntimeError`` naming the checkpoint.

Example:
    >>> import tempfile
    >>> checkpoint_meta(tempfile.mkdtemp()) is None
    True
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

import torch

from ddpctx.checkpoint.claims import refusal
from ddpctx.checkpoint.files import (
    ANY_NAME,
    FORMAT,
    RefusedCheckpoint,
    checkpoint_paths,
    newest_checkpoint,
    probe,
    read_state,
)
from ddpctx.checkpoint.shardfiles import (
    METADATA_FILE,
    STATE_FILE,
    checkpoint_dirs,
    complete,
    newest_checkpoint_dir,
    newest_is_sharded,
)
from ddpctx.checkpoint.sums import SHARDED_MANIFEST, intact, read_manifest, sidecar
from ddpctx.utils.warn import warn_user

__all__ = ["checkpoint_meta", "chosen_checkpoint", "load_weights", "read_newest", "resolve"]

Weights = dict[str, torch.Tensor]
T = TypeVar("T")

#: A read a running job's saves overtook starts over at least ATTEMPTS times and for PATIENCE_S
#: seconds, each time after the writer's next save (waited for at most NEXT_SAVE_S seconds).
ATTEMPTS, PATIENCE_S, NEXT_SAVE_S = 8, 30.0, 0.5


def chosen_checkpoint(directory: Path) -> Path | None:
    """The checkpoint ``load_checkpoint`` restores from ``directory`` into an unsharded model.

    The newest that loads (torn or damaged ones skipped with a warning), a
    ``.pt`` or a ``.dcp``; None when there is no checkpoint at all.
    """
    if newest_is_sharded(directory):
        return newest_checkpoint_dir(directory)
    return newest_checkpoint(directory)


def resolve(path: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``path`` names: the chosen one of a directory, or the one given (verified).

    None for a directory without checkpoints, or not there yet (a run's first start).
    """
    where = Path(path)
    if not where.exists():
        if where.suffix in (".pt", ".dcp"):
            raise FileNotFoundError(f"{str(where)!r} does not exist. Check the path.")
        return None  # a run's first start: no directory yet, as load_checkpoint sees it
    # A checkpoint-NNNNNN*.dcp folder is one sharded checkpoint, also with a file missing
    # (said below, by name), never the directory of checkpoints load_checkpoint takes.
    one_sharded = where.is_dir() and where.suffix == ".dcp" and ANY_NAME.match(where.name)
    if where.is_dir() and not one_sharded:
        return chosen_checkpoint(where)
    if not ANY_NAME.match(where.name):
        raise ValueError(
            f"{str(where)!r} is not a ddpctx checkpoint (those are named checkpoint-NNNNNN*.pt, "
            "or checkpoint-NNNNNN*.dcp folders). An export (python -m ddpctx export) is read "
            "with torch.load(path, weights_only=True); otherwise pass a checkpoint, or the "
            "directory given to ctx.save_checkpoint to read the newest one that loads."
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        if one_sharded:
            good = complete(where)
        else:
            verified = sidecar(where).exists()
            good = intact(sidecar(where), where.parent, (where.name,), where) and _probed(
                where, verified
            )
    for warning in caught:
        if good:  # e.g. "no checksum manifest": said as loading would say it
            warn_user(warning.message, RuntimeWarning)
    if not good:
        said = "; ".join(str(w.message) for w in caught) or "it does not load"
        said = said.replace("; trying an older checkpoint", "").rstrip(".")  # it was named
        raise RuntimeError(
            f"{str(where)!r} cannot be read: {said.replace('skipping ', '', 1)}. Name an older "
            "checkpoint, or pass the directory to use the newest one that loads."
        )
    return where


def _probed(path: Path, verified: bool) -> bool:
    """Whether the one file named loads; not a ddpctx checkpoint (an export?) says so."""
    try:
        return probe(path, verified) is not None
    except RefusedCheckpoint as error:
        if "not a ddpctx checkpoint" not in str(error):
            raise
        raise ValueError(
            f"{str(path)!r} is not a ddpctx checkpoint (no format {FORMAT!r}). An export "
            "(python -m ddpctx export) is read with torch.load(path, weights_only=True)"
            "['model']; pass a checkpoint, or the directory given to ctx.save_checkpoint."
        ) from error


def _small_state(checkpoint: Path) -> dict[str, Any]:
    """The state without the shards (``ddpctx.pt``), or the ``.pt`` memory-mapped."""
    target = checkpoint / STATE_FILE if checkpoint.is_dir() else checkpoint
    manifest = checkpoint / SHARDED_MANIFEST if checkpoint.is_dir() else sidecar(checkpoint)
    return read_state(target, "cpu", mmap=True, verified=manifest.exists())


#: Meta keys ddpctx itself stores and ``load_checkpoint`` removes (the metrics trail's last
#: logged step, under ``distributed(log_dir=...)``): never the caller's.
RUN_META = ("ddpctx_log_step",)


def meta_of(checkpoint: Path) -> dict[str, Any]:
    """The meta ``load_checkpoint`` returns for ``checkpoint`` (``step`` added when saved)."""
    state = _small_state(checkpoint)
    meta: dict[str, Any] = {k: v for k, v in state["meta"].items() if k not in RUN_META}
    if state.get("step") is not None:
        meta["step"] = state["step"]
    return meta


def checkpoint_meta(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The meta of the checkpoint ``load_checkpoint`` would restore; None when there is none.

    None when there is no checkpoint, or no directory yet (as ``load_checkpoint``
    sees it). Reads no tensor, needs no process group, changes nothing: call it before
    ``distributed()`` to build the model from the saved settings. Also takes
    one checkpoint (a ``.pt`` file or a ``.dcp`` directory). ``step`` is in it
    when the checkpoint was saved with ``step=``.

    >>> import tempfile
    >>> from ddpctx import distributed
    >>> folder = tempfile.mkdtemp()
    >>> with distributed() as ctx:
    ...     model = ctx.wrap(torch.nn.Linear(3, 2))
    ...     args = {"n_in": 3}
    ...     _ = ctx.save_checkpoint(folder, model=model, step=7, model_args=args)
    >>> checkpoint_meta(folder)
    {'model_args': {'n_in': 3}, 'step': 7}
    """
    found = read_newest(directory, meta_of)
    return None if found is None else found[1]


def _sharded(checkpoint: Path, keys: set[str]) -> dict[str, Any]:
    """The entries ``keys`` of a sharded checkpoint, whole, in this process (no process group).

    ``checkpoint`` was verified by :func:`resolve` (every file); it is read through
    ddpctx's reader all the same: ``.metadata`` restricted, every entry ``weights_only``.
    """
    # DCP's own single-process reading (what its dcp_to_torch_save does): each full tensor
    # is allocated once from the metadata and every shard read straight into it.
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from ddpctx.checkpoint.dcpread import Reader, cause_of, failures_said, read_metadata

    # Read here, not by DCP: DCP logs a traceback for a .metadata it cannot read (pruned by
    # a writer), then looks for per-rank ones and fails on that instead.
    manifest = checkpoint / SHARDED_MANIFEST  # verified by resolve; its records weigh the claims
    recorded = read_manifest(manifest) if manifest.exists() else None
    if isinstance(recorded, str):
        raise RuntimeError(f"{str(checkpoint)!r} cannot be read: {recorded}. Read it again.")
    metadata = read_metadata(checkpoint / METADATA_FILE, recorded)
    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            storage_reader=Reader(checkpoint, metadata),
            planner=_EmptyStateDictLoadPlanner(keys=keys),  # type: ignore[no-untyped-call]
            no_dist=True,
        )
    except CheckpointException as error:  # DCP wraps what its reader raised: say it plainly
        if (cause := cause_of(error)) is not None:
            raise cause from None
        said = failures_said(error)[:300]
        # its checksums matched and it is still there: written so (a writer pruning it mid-read
        # takes it away: that is read again, as before)
        if recorded is not None and (checkpoint / METADATA_FILE).exists():
            raise refusal(checkpoint / METADATA_FILE, f"entries DCP cannot read ({said})") from None
        raise RuntimeError(
            f"{str(checkpoint)!r} could not be read by DCP ({said}). If a job is writing this "
            "directory, read it again (or pass the directory, whose newest checkpoint is read)."
        ) from None
    return state


def _numbered(saved: dict[str, Any]) -> dict[str, Any]:
    """A sharded checkpoint's optimizer state (keyed by parameter name) as torch numbers it."""
    groups = saved.get("param_groups") or []
    order = {name: number for number, name in enumerate(n for g in groups for n in g["params"])}
    return {
        "state": {order[name]: value for name, value in (saved.get("state") or {}).items()},
        "param_groups": [
            {**group, "params": [order[name] for name in group["params"]]} for group in groups
        ],
    }


@overload
def load_weights(path: str | os.PathLike[str], *, optimizer: Literal[False] = False) -> Weights: ...


@overload
def load_weights(
    path: str | os.PathLike[str], *, optimizer: Literal[True]
) -> tuple[Weights, dict[str, Any]]: ...


def load_weights(
    path: str | os.PathLike[str], *, optimizer: bool = False
) -> Weights | tuple[Weights, dict[str, Any]]:
    """The model's full state dict from a checkpoint, in one plain process (CPU tensors).

    ``path``: the checkpoint directory (the checkpoint ``load_checkpoint``
    would restore) or one checkpoint, a DDP ``.pt`` or a sharded ``.dcp``.
    Keys are the unwrapped model's (``model.load_state_dict(weights)`` on a
    plain model). ``optimizer=True`` returns ``(weights, optimizer_state)``,
    the latter loadable by ``Optimizer.load_state_dict`` of an optimizer made
    as in training. No process group is needed; inside ``distributed()`` each
    rank that calls it reads the whole model.

    >>> import tempfile
    >>> from ddpctx import distributed
    >>> folder = tempfile.mkdtemp()
    >>> with distributed() as ctx:
    ...     model = ctx.wrap(torch.nn.Linear(3, 2))
    ...     _ = ctx.save_checkpoint(folder, model=model)
    >>> sorted(load_weights(folder))
    ['bias', 'weight']
    """
    found = read_newest(path, lambda checkpoint: weights_of(checkpoint, optimizer=optimizer))
    if found is None:
        raise FileNotFoundError(
            f"{str(path)!r} holds no checkpoint (or does not exist). Pass the directory given "
            "to ctx.save_checkpoint after a save, or one checkpoint file."
        )
    weights, optimizer_state = found[1]
    return (weights, optimizer_state) if optimizer_state is not None else weights


def weights_of(
    checkpoint: Path, *, optimizer: bool = False
) -> tuple[Weights, dict[str, Any] | None]:
    """The full state dict of the one ``checkpoint``, and (``optimizer=True``) the optimizer's."""
    if checkpoint.is_dir():
        small = _small_state(checkpoint)
        if optimizer and not small.get("optimizer_saved"):
            raise _no_optimizer(checkpoint)
        state = _sharded(checkpoint, {"model", "optimizer"} if optimizer else {"model"})
        weights: Weights = dict(state.get("model", {}))
        return weights, _numbered(state["optimizer"]) if optimizer else None
    state = _small_state(checkpoint)
    weights = dict(state["model"])
    if not optimizer:
        return weights, None
    if state.get("optimizer") is None:
        raise _no_optimizer(checkpoint)
    return weights, state["optimizer"]


def listing(directory: Path) -> tuple[str, ...]:
    """The names of the checkpoints in ``directory``, files and folders (what a writer changes)."""
    return tuple(p.name for p in (*checkpoint_paths(directory), *checkpoint_dirs(directory)))


def one_checkpoint(where: Path) -> bool:
    """Whether ``where`` names one checkpoint (a ``.pt`` or ``.dcp``), not their directory."""
    return where.suffix in (".pt", ".dcp") and bool(ANY_NAME.match(where.name))


def read_newest(path: str | os.PathLike[str], read: Callable[[Path], T]) -> tuple[Path, T] | None:
    """``read`` of the checkpoint :func:`resolve` chooses, started over if a writer overtook it.

    (the checkpoint, what ``read`` returned); None when there is no checkpoint. See the
    module docstring: a directory changed under a read that failed or skipped a
    checkpoint is read again, quietly, on its newest checkpoint.
    """
    where = Path(path)
    directory = where.parent if one_checkpoint(where) else where
    deadline = time.monotonic() + PATIENCE_S
    attempt = 0
    while attempt < ATTEMPTS or time.monotonic() < deadline:
        attempt += 1
        before, existed = listing(directory), where.exists()
        failure: Exception | None = None
        result: tuple[Path, T] | None = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                chosen = resolve(where)
                result = None if chosen is None else (chosen, read(chosen))
            except RefusedCheckpoint:
                raise  # what it holds is refused, whoever writes beside it
            except (OSError, RuntimeError) as error:
                failure = error
        moved = (failure is not None or bool(caught)) and listing(directory) != before
        if moved and directory is where:
            _next_save(directory)
            continue  # overtaken by the writer: the newest checkpoint, again
        if failure is not None and directory is not where and existed:
            if moved:
                time.sleep(0.1)  # a folder being removed may still be there for a moment
            if not where.exists():
                raise FileNotFoundError(
                    f"{str(where)!r} was removed while it was read: a job saving to "
                    f"{str(directory)!r} with keep= pruned it (or it was deleted). Pass the "
                    "directory to read its newest checkpoint, or copy the checkpoint first."
                ) from None
        for warning in caught:
            warn_user(warning.message, warning.category)
        if failure is not None:
            raise failure
        return result
    raise RuntimeError(
        f"{str(directory)!r} changed under each of {attempt} reads of its newest checkpoint "
        f"in {PATIENCE_S:g} s: the job writing it saves, and prunes (keep=), faster than one "
        "checkpoint is read. "
        "Read it again, save with a larger keep= (each checkpoint then outlives a read), or "
        "copy a checkpoint out of the directory and read the copy."
    )


def _next_save(directory: Path) -> None:
    """Wait (at most :data:`NEXT_SAVE_S`) for the writer's next checkpoint and its pruning.

    A read started just after a save has the whole time until the next one, when
    ``keep=`` prunes it; one started at once may have only the end of that time.
    """
    now = listing(directory)
    give_up = time.monotonic() + NEXT_SAVE_S
    while listing(directory) == now and time.monotonic() < give_up:
        time.sleep(0.005)
    time.sleep(0.01)  # its pruning, right after it is published


def _no_optimizer(checkpoint: Path) -> ValueError:
    return ValueError(
        f"{str(checkpoint)!r} was saved without an optimizer (save_checkpoint had no "
        "optimizer=), so it holds no optimizer state. Call load_weights without optimizer=True."
    )
