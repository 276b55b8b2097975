"""Per-rank state in a checkpoint: ``rank_state={name: obj}``, saved on every rank, back to it.

``extra=`` saves rank 0's state only (one copy, loaded by every rank): right
for an EMA of the weights, wrong for anything that differs between ranks.
``rank_state=`` captures each rank's own object in the same ``all_gather``
that carries the random states, so rank ``r`` gets back exactly what rank
``r`` saved. An object may have ``state_dict``/``load_state_dict``, or be a
``random.Random``, ``np.random.Generator``, ``np.random.RandomState`` or
``torch.Generator`` (captured by :func:`~ddpctx.utils.seeding.generator_state`).

On another world size (``allow_world_size_change=True``) a rank's old state
has no natural new owner. Generators are then re-seeded, each new rank from
its own seed derived from the base seed, the step, the rank and the name
(deterministic, distinct; as for the global generators). An object with a
``state_dict`` cannot be split or merged correctly by ddpctx, so it is
refused with an error naming it.

A restored generator that the user's code reseeds before the resumed epoch
reads on (a per-epoch ``set_epoch_seed``) silently undoes the restore; the
loaders then warn, naming it and the fix (:class:`RestoredWatch`).

Example:
    >>> import random
    >>> rng = random.Random(1); saved = capture({"rng": rng}); first = rng.random()
    >>> _ = restore({"rng": rng}, saved, "ckpt.pt"); rng.random() == first
    True
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from ddpctx.utils.seeding import (
    generator_kind,
    generator_state,
    reseed_generator,
    set_generator_state,
)
from ddpctx.utils.warn import warn_user


def check_rank_state(rank_state: dict[str, Any] | None) -> dict[str, Any]:
    """``rank_state`` as a dict, every object one that can be captured; a TypeError otherwise."""
    if rank_state is None:
        return {}
    if not isinstance(rank_state, dict):
        raise TypeError(
            f"rank_state={type(rank_state).__name__} must be a dict of name -> object, e.g. "
            "rank_state={'sampler_rng': dataset.rng}."
        )
    for name, item in rank_state.items():
        stateful = hasattr(item, "state_dict") and hasattr(item, "load_state_dict")
        if not stateful and generator_kind(item) is None:
            raise TypeError(
                f"rank_state[{name!r}] is a {type(item).__name__}, which has no state_dict() / "
                "load_state_dict() and is not a random.Random, np.random.Generator, "
                "np.random.RandomState or torch.Generator. Pass one of those, or keep the value "
                "in an object with state_dict() and load_state_dict()."
            )
    return rank_state


def capture(rank_state: dict[str, Any]) -> dict[str, Any]:
    """This rank's states, by name."""
    captured = {}
    for name, item in rank_state.items():
        if generator_kind(item) is not None:
            captured[name] = generator_state(item)
        else:
            captured[name] = {"kind": "state_dict", "state": item.state_dict()}
    return captured


def restore(rank_state: dict[str, Any], saved: dict[str, Any], where: str) -> RestoredWatch:
    """Load this rank's saved states into the objects of ``rank_state``.

    Returns the :class:`RestoredWatch` over the generators restored, for the
    loaders to call before the resumed epoch reads its first batch.
    """
    for name, item in rank_state.items():
        if name not in saved:
            raise ValueError(
                f"{where} holds no rank_state {name!r} (it has {sorted(saved) or 'none'}); it "
                f"was saved without it. Leave {name!r} out of rank_state= for this resume, or "
                "start a new run."
            )
        kind = generator_kind(item) or "state_dict"
        if saved[name]["kind"] != kind:
            raise TypeError(
                f"rank_state[{name!r}] is a {kind} here but {where} saved a "
                f"{saved[name]['kind']} under that name. Pass the same kind of object as the run "
                "that saved it."
            )
        if kind == "state_dict":
            item.load_state_dict(saved[name]["state"])
        else:
            set_generator_state(item, saved[name])
    generators = {name: item for name, item in rank_state.items() if generator_kind(item)}
    return RestoredWatch(generators, where)


class ReseededGeneratorWarning(UserWarning):
    """A generator restored through ``rank_state=`` changed before the resumed epoch read on."""


class RestoredWatch:
    """The restored generators' states; :meth:`check` warns about any that changed since.

    A dataset that reseeds its generator at the start of every epoch (Kronos'
    ``set_epoch_seed`` calls ``self.py_rng.seed``) does so in the resumed
    epoch too, after ``load_checkpoint`` restored it: the restore is undone
    and the resumed epoch draws that epoch's *first* numbers again, without
    an error. The loaders call :meth:`check` once, when a mid-epoch resumed
    pass is about to read its first batch; a generator whose state is not the
    restored one by then was reseeded or drawn from in between, which the
    uninterrupted run did not do at that point of the epoch.
    """

    def __init__(self, generators: dict[str, Any], where: str) -> None:
        self._restored = {name: (item, generator_state(item)) for name, item in generators.items()}
        self._where = where

    def check(self) -> None:
        """Warn (once) naming each restored generator whose state changed, and the fix."""
        restored, self._restored = self._restored, {}
        for name, (item, state) in restored.items():
            if _same(generator_state(item), state):
                continue
            what = "reseeded" if _freshly_seeded(item) else "reseeded or drawn from"
            warn_user(
                f"load_checkpoint restored rank_state[{name!r}] (a {generator_kind(item)}) from "
                f"{self._where}, but it was {what} before the resumed epoch read its first "
                "batch, which undoes the restore: the rest of the epoch draws other numbers "
                "than the uninterrupted run (not an exact resume). A reseed at the start of "
                "every epoch (e.g. dataset.set_epoch_seed(epoch)) does this. Fix: reseed only "
                "in an epoch that starts from its first batch, `if loader.start == 0: "
                "dataset.set_epoch_seed(epoch)` (the restored state carries a resumed epoch "
                "on), or draw from the global generators instead (random.randint for "
                "self.py_rng.randint), which ddpctx seeds per rank, worker and batch and saves "
                "in every checkpoint.",
                ReseededGeneratorWarning,
            )


def _freshly_seeded(item: Any) -> bool:
    """A ``random.Random`` seeded and not drawn from since (its Mersenne Twister index is 624)."""
    if generator_kind(item) != "random.Random":
        return False
    return bool(item.getstate()[1][-1] == 624)


def _same(first: Any, second: Any) -> bool:
    """Whether two captured generator states are equal (tensors compared by value)."""
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return (
            isinstance(first, torch.Tensor)
            and isinstance(second, torch.Tensor)
            and first.shape == second.shape
            and torch.equal(first, second)
        )
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(_same(first[k], second[k]) for k in first)
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        return len(first) == len(second) and all(map(_same, first, second))
    return bool(first == second)


def reseed(rank_state: dict[str, Any], seed: int, where: str, old_world_size: int) -> None:
    """After a world-size change: re-seed generators per rank; refuse objects with state_dict."""
    stateful = [name for name, item in rank_state.items() if generator_kind(item) is None]
    if stateful:
        raise ValueError(
            f"rank_state {stateful} of {where} was saved per rank by {old_world_size} ranks; on "
            "another world size there is no right way to hand those states to the new ranks. "
            f"Resume on {old_world_size} ranks, or leave {stateful} out of rank_state= (they "
            "start fresh), or save what must survive a resize in extra= (rank 0's copy)."
        )
    for name, item in rank_state.items():
        reseed_generator(item, (seed + zlib.crc32(name.encode())) % 2**63)
