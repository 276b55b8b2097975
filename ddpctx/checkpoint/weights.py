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

The checkpoint read is :mod:`ddpctx.checkpoint.choice`'s: ``load_checkpoint``'s
for an unsharded model, its small state read once while choosing it.

Beside a running job that prunes (``keep=``), a read it overtakes starts over on
the newest checkpoint (:func:`~ddpctx.checkpoint.choice.read_chosen`).

Example:
    >>> import tempfile
    >>> checkpoint_meta(tempfile.mkdtemp()) is None
    True
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, overload

import torch

from ddpctx.checkpoint.choice import chosen_checkpoint, read_chosen, read_newest, resolve
from ddpctx.checkpoint.claims import refusal
from ddpctx.checkpoint.files import read_state
from ddpctx.checkpoint.shardfiles import METADATA_FILE, STATE_FILE
from ddpctx.checkpoint.sums import SHARDED_MANIFEST, read_manifest, sidecar

#: ``chosen_checkpoint``, ``read_newest`` and ``resolve`` live in :mod:`ddpctx.checkpoint.choice`.
__all__ = ["checkpoint_meta", "chosen_checkpoint", "load_weights", "read_newest", "resolve"]

Weights = dict[str, torch.Tensor]


def _small_state(checkpoint: Path) -> dict[str, Any]:
    """The state without the shards (``ddpctx.pt``), or the ``.pt`` memory-mapped."""
    sharded = checkpoint.suffix == ".dcp"  # by its name: one pruned under the read is no .pt
    target = checkpoint / STATE_FILE if sharded else checkpoint
    manifest = checkpoint / SHARDED_MANIFEST if sharded else sidecar(checkpoint)
    return read_state(target, "cpu", mmap=True, verified=manifest.exists())


#: Meta keys ddpctx itself stores and ``load_checkpoint`` removes (the metrics trail's last
#: logged step, under ``distributed(log_dir=...)``): never the caller's.
RUN_META = ("ddpctx_log_step",)


def meta_of(checkpoint: Path, small: dict[str, Any] | None = None) -> dict[str, Any]:
    """The meta ``load_checkpoint`` returns for ``checkpoint`` (``step`` added when saved).

    ``small``: its small state, read already (:class:`~ddpctx.checkpoint.choice.Chosen`).
    """
    state = _small_state(checkpoint) if small is None else small
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
    found = read_chosen(directory, lambda chosen: meta_of(chosen.path, chosen.small))
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
    found = read_chosen(
        path, lambda chosen: weights_of(chosen.path, optimizer=optimizer, small=chosen.small)
    )
    if found is None:
        raise FileNotFoundError(
            f"{str(path)!r} holds no checkpoint (or does not exist). Pass the directory given "
            "to ctx.save_checkpoint after a save, or one checkpoint file."
        )
    weights, optimizer_state = found[1]
    return (weights, optimizer_state) if optimizer_state is not None else weights


def weights_of(
    checkpoint: Path, *, optimizer: bool = False, small: dict[str, Any] | None = None
) -> tuple[Weights, dict[str, Any] | None]:
    """The full state dict of the one ``checkpoint``, and (``optimizer=True``) the optimizer's.

    ``small``: its small state, read already (:class:`~ddpctx.checkpoint.choice.Chosen`).
    """
    small = _small_state(checkpoint) if small is None else small
    if checkpoint.suffix == ".dcp":  # by its name: one pruned under the read is no .pt
        if optimizer and not small.get("optimizer_saved"):
            raise _no_optimizer(checkpoint)
        state = _sharded(checkpoint, {"model", "optimizer"} if optimizer else {"model"})
        weights: Weights = dict(state.get("model", {}))
        return weights, _numbered(state["optimizer"]) if optimizer else None
    state = small
    weights = dict(state["model"])
    if not optimizer:
        return weights, None
    if state.get("optimizer") is None:
        raise _no_optimizer(checkpoint)
    return weights, state["optimizer"]


def _no_optimizer(checkpoint: Path) -> ValueError:
    return ValueError(
        f"{str(checkpoint)!r} was saved without an optimizer (save_checkpoint had no "
        "optimizer=), so it holds no optimizer state. Call load_weights without optimizer=True."
    )
