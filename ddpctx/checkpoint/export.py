"""Export a checkpoint as the plain files other code loads: a state dict and its meta.

``python -m ddpctx export CHECKPOINT OUT.pt`` (or :func:`export_checkpoint`)
writes, atomically, what :func:`~ddpctx.checkpoint.weights.load_weights` and
:func:`~ddpctx.checkpoint.weights.checkpoint_meta` return for ``CHECKPOINT``
(a checkpoint directory -- its newest checkpoint that loads -- or one
checkpoint, DDP ``.pt`` or sharded ``.dcp``):

- ``OUT.pt``: ``{"model": state_dict, "meta": meta, "format": "ddpctx-export-1",
  "checkpoint": name}``, loadable with ``torch.load(OUT, weights_only=True)``
  in any process, ddpctx installed or not.
- ``OUT.safetensors`` (``--safetensors``, or an ``OUT`` ending in
  ``.safetensors``; needs the ``safetensors`` package: ``pip install
  'ddpctx[export]'``): the tensors, with the meta as JSON in the file's
  metadata under ``"ddpctx.meta"``. Tensors that share memory (tied
  embeddings) are written once each, as safetensors requires; loading
  them into the model ties them again. Meta that JSON cannot hold (a
  tensor, bytes) is refused, naming the key: export to ``.pt`` instead.

Example:
    >>> import tempfile, os
    >>> from ddpctx import distributed
    >>> folder = tempfile.mkdtemp()
    >>> with distributed() as ctx:
    ...     _ = ctx.save_checkpoint(folder, model=ctx.wrap(torch.nn.Linear(3, 2)), n_in=3)
    >>> out = export_checkpoint(folder, os.path.join(folder, "model.pt"))
    >>> sorted(torch.load(out, weights_only=True)["model"]), torch.load(out)["meta"]
    (['bias', 'weight'], {'n_in': 3})
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ddpctx.checkpoint.choice import one_checkpoint, read_chosen
from ddpctx.checkpoint.files import ANY_NAME
from ddpctx.checkpoint.weights import meta_of, weights_of
from ddpctx.utils.atomic import atomic_save, temporary_name

EXPORT_FORMAT = "ddpctx-export-1"
META_KEY = "ddpctx.meta"


def export_checkpoint(
    checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *, safetensors: bool = False
) -> Path:
    """Write ``checkpoint``'s weights and meta to ``out`` (see the module docstring); ``out``."""
    target = Path(out)
    as_safetensors = safetensors or target.suffix == ".safetensors"
    save_file = _safetensors_writer() if as_safetensors else None  # refused before reading
    where = Path(checkpoint)
    _refuse_a_checkpoint_name(target, where.parent if one_checkpoint(where) else where)
    found = read_chosen(
        where,
        lambda chosen: (
            weights_of(chosen.path, small=chosen.small)[0],
            meta_of(chosen.path, chosen.small),
        ),
    )
    if found is None:
        raise FileNotFoundError(
            f"{str(checkpoint)!r} holds no checkpoint to export. Pass the directory given to "
            "ctx.save_checkpoint after a save, or one checkpoint in it."
        )
    chosen, (weights, meta) = found
    target.parent.mkdir(parents=True, exist_ok=True)
    if save_file is None:
        state = {"format": EXPORT_FORMAT, "model": weights, "meta": meta, "checkpoint": chosen.name}
        atomic_save(state, target)
        return target
    text = _json_meta(meta)
    temporary = temporary_name(target)
    try:
        save_file(unshared(weights), str(temporary), metadata={META_KEY: text, "format": "pt"})
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(
            temporary, 0o666 & ~mask
        )  # safetensors writes 0600; a .pt export follows the umask
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target


def _refuse_a_checkpoint_name(target: Path, directory: Path) -> None:
    """An export named like a checkpoint, in the checkpoints' directory, is refused.

    Every later read of the directory (``load_checkpoint``, ``load_weights``,
    a resume) would take it for a checkpoint and refuse it, as it is none.
    """
    if ANY_NAME.match(target.name) and target.parent.resolve() == directory.resolve():
        raise ValueError(
            f"export destination {str(target)!r} is named like a checkpoint "
            f"(checkpoint-NNNNNN...) inside the checkpoint directory {str(directory)!r}: every "
            "later read of that directory would take the export for a checkpoint and refuse "
            f"it. Export under another name (e.g. {str(directory / 'model.pt')!r}) or into "
            "another directory."
        )


def _safetensors_writer() -> Any:
    try:
        from safetensors.torch import save_file
    except ImportError as error:
        raise ModuleNotFoundError(
            "exporting to safetensors needs the safetensors package, which is not installed: "
            "pip install 'ddpctx[export]' (or pip install safetensors), or export to a .pt file."
        ) from error
    return save_file


def unshared(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor contiguous and in memory of its own (a tied weight's second name: a copy).

    >>> shared = torch.ones(2)
    >>> out = unshared({"a": shared, "b": shared})
    >>> out["a"].data_ptr() != out["b"].data_ptr()
    True
    """
    seen: set[int] = set()
    out = {}
    for name, tensor in weights.items():
        storage = tensor.untyped_storage().data_ptr()
        whole = tensor.is_contiguous() and tensor.numel() * tensor.element_size() == (
            tensor.untyped_storage().nbytes()
        )
        out[name] = tensor if storage not in seen and whole else tensor.contiguous().clone()
        seen.add(storage)
    return out


_JSON_LEAVES = (str, int, float, bool, type(None))


def _not_json(value: Any, where: str) -> tuple[str, Any] | None:
    """The key path (``meta['opt']['betas'][1]``) and value of the first thing JSON cannot hold."""
    if isinstance(value, _JSON_LEAVES):
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, _JSON_LEAVES):
                return f"a key of {where}", key
            if found := _not_json(item, f"{where}[{key!r}]"):
                return found
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if found := _not_json(item, f"{where}[{index}]"):
                return found
        return None
    return where, value


def _json_meta(meta: dict[str, Any]) -> str:
    found = _not_json(meta, "meta")
    if found is not None:
        where, value = found
        raise TypeError(
            f"{where} is a {type(value).__name__} ({value!r:.60}), which a safetensors "
            "file's metadata (JSON strings) cannot hold. Export to a .pt file instead (it keeps "
            "every meta value), or save that value as a number, string or list."
        )
    return json.dumps(meta)
