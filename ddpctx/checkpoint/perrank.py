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

Example:
    >>> import random
    >>> rng = random.Random(1); saved = capture({"rng": rng}); first = rng.random()
    >>> restore({"rng": rng}, saved, "ckpt.pt"); rng.random() == first
    True
"""

from __future__ import annotations

import zlib
from typing import Any

from ddpctx.utils.seeding import (
    generator_kind,
    generator_state,
    reseed_generator,
    set_generator_state,
)


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


def restore(rank_state: dict[str, Any], saved: dict[str, Any], where: str) -> None:
    """Load this rank's saved states into the objects of ``rank_state``."""
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
