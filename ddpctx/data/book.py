"""The context's loaders: held weakly, kept in the current epoch, matched to saved positions.

Three jobs, one small object (:class:`LoaderBook`, one per context):

- **Weak references.** The context must reach every loader ``ctx.dataloader``
  made (``ctx.epochs`` sets their epoch; a checkpoint saves their positions),
  but must not keep them alive: a validation loader made every epoch is freed
  with its dataset as soon as the user drops it.
- **The current epoch.** A loader made inside ``for epoch in ctx.epochs(n)``
  starts at that epoch, so it shuffles anew every epoch like one made before
  the loop.
- **Which saved position is whose.** Positions are saved under each loader's
  identity: its ``name=`` if given, else a description of its data (dataset
  type, length, shuffle, pad). A loader made after ``load_checkpoint`` gets
  the position saved under its identity, whatever order the loaders are made
  in. What cannot be matched safely is refused with an error naming the
  loaders: two live loaders with one identity at different positions (at
  save) or competing for one mid-epoch position (at load), and a loader
  whose data changed since the save (same name, or same kind of dataset,
  another length).

Example:
    >>> book = LoaderBook()
    >>> book.set_epoch(3)
    >>> book.epoch
    3
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ddpctx.data.loader import ShardLoader
from ddpctx.data.sampling import Position
from ddpctx.data.streamloader import SavedStream, StreamLoader

#: What each rank reports per loader at a save: (identity, (epoch, consumed, complete, done)),
#: or for a stream (identity, its position dict; see StreamLoader.position).
Snapshot = list[tuple[str, Any]]
Loader = ShardLoader | StreamLoader


@dataclass(frozen=True)
class SavedLoader:
    """One loader as a checkpoint recorded it, and the position to resume it at."""

    key: str | None  # None in checkpoints written before loaders had identities
    description: str
    length: int
    pad: bool
    batch_size: int
    world_size: int
    position: Position | None  # None: its pass was complete or had not started
    drop_last: bool = False

    @property
    def kind(self) -> str:
        """The description without the length: the same kind of data, maybe resized."""
        return without_length(self.description)


class LoaderBook:
    """The loaders one context made, held weakly, and the positions waiting for them."""

    def __init__(self) -> None:
        self._loaders: list[weakref.ref[Loader]] = []
        self.epoch: int | None = None  # set by ctx.epochs while its loop runs
        self._pending: list[SavedLoader | SavedStream] = []
        self._before_resumed_pass: Callable[[], None] | None = None

    def live(self) -> list[Loader]:
        """The loaders still in use, oldest first."""
        alive = [(ref, ref()) for ref in self._loaders]
        self._loaders = [ref for ref, loader in alive if loader is not None]
        return [loader for _, loader in alive if loader is not None]

    def add(self, loader: Loader) -> None:
        """Book a new loader: it joins the current epoch and takes its saved position, if any."""
        if self.epoch is not None:
            _set_epoch(loader, self.epoch)
        others = self.live()
        self._loaders.append(weakref.ref(loader))
        self._claim(loader, others)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for loader in self.live():
            _set_epoch(loader, epoch)

    def snapshot(self) -> Snapshot:
        """This rank's loaders and their positions, for a checkpoint."""
        return [(loader.identity, loader.position()) for loader in self.live()]

    def records(self, everyone: Sequence[Snapshot]) -> list[dict[str, Any]]:
        """One record per identity from every rank's snapshot; ambiguous identities refused."""
        live = {loader.identity: loader for loader in self.live()}
        keys = [key for key, _ in everyone[0] if all(key in dict(rank) for rank in everyone)]
        records: dict[str, dict[str, Any]] = {}
        for key in keys:
            positions = [[p for k, p in rank if k == key] for rank in everyone]
            if any(len(set(map(_comparable, mine))) > 1 for mine in positions):
                raise ValueError(
                    f"two loaders made by ctx.dataloader are both {key} but have read different "
                    "parts of the epoch, so a checkpoint could not tell which position is "
                    "whose. Give them names: ctx.dataloader(..., name='train') and "
                    "ctx.dataloader(..., name='val')."
                )
            if key in records or key not in live:
                continue
            mine = [rank[0] for rank in positions]
            loader = live[key]
            if isinstance(loader, StreamLoader):
                records[key] = stream_record(key, loader, mine)
                continue
            mine = _per_data_rank(key, mine, loader.shard.num_replicas)
            records[key] = {
                "key": key,
                "description": loader.description,
                "epoch": mine[0][0],
                "world_size": len(mine),
                "consumed": [consumed for _, consumed, _, _ in mine],
                "complete": all(complete for _, _, complete, _ in mine),
                "done": torch.tensor(list(mine[0][3]), dtype=torch.uint8),
                "length": loader.shard.length,
                "pad": loader.shard.pad,
                "batch_size": loader.shard_batch_size,
                "drop_last": bool(loader.drop_last),
                "fill": loader.shard.fill,
            }
        return list(records.values())

    def restore(
        self,
        saved: list[SavedLoader | SavedStream],
        before_resumed_pass: Callable[[], None] | None = None,
    ) -> None:
        """Positions from a checkpoint: live loaders take theirs now, later ones when made.

        ``before_resumed_pass`` is called when a loader given a mid-epoch
        position is about to read the first batch of its resumed pass.
        """
        self._pending = list(saved)
        self._before_resumed_pass = before_resumed_pass
        live = self.live()
        for loader in live:
            self._claim(loader, [other for other in live if other is not loader])

    def _claim(self, loader: Loader, others: list[Loader]) -> None:
        if isinstance(loader, StreamLoader):
            self._claim_stream(loader, others)
            return
        for index, saved in enumerate(self._pending):
            if isinstance(saved, SavedStream):
                if saved.key == loader.identity:
                    raise ValueError(_other_kind(loader.identity, "a stream", "a map dataset"))
                continue
            if not _matches(saved, loader):
                continue
            twins = [other for other in others if _matches(saved, other)]
            if twins and saved.position is not None:
                raise ValueError(
                    f"two loaders made by ctx.dataloader are both {loader.identity}, and the "
                    "checkpoint holds one mid-epoch position for that: which of them should "
                    "resume is ambiguous. Give them names, ctx.dataloader(..., name='train') "
                    "and (..., name='val'), in the run that saves and in the one that resumes."
                )
            if saved.key is not None and saved.description != loader.description:
                raise ValueError(
                    f"the loader {loader.identity} reads {loader.description}, but when the "
                    f"checkpoint was saved it read {saved.description}: the data changed, so "
                    "its position cannot be resumed. Resume with the same data, or give the "
                    "new loader another name."
                )
            del self._pending[index]
            if saved.position is not None:
                loader.resume(saved.position)
                loader.before_resumed_pass = self._before_resumed_pass
            return
        for saved in self._pending:
            if isinstance(saved, SavedStream):
                continue
            resized = saved.kind == _kind(loader) and saved.length != loader.shard.length
            if saved.position is not None and saved.key != loader.identity and resized:
                raise ValueError(
                    f"ctx.dataloader made a loader over {loader.description}; the "
                    f"checkpoint holds a mid-epoch position for {saved.description}. The "
                    "data changed length, so that position cannot be resumed. Resume with "
                    "the same data, or give the loaders names (name='train') so a new "
                    "dataset is not mistaken for the old one."
                )

    def _claim_stream(self, loader: StreamLoader, others: list[Loader]) -> None:
        for index, saved in enumerate(self._pending):
            if saved.key != loader.identity:
                continue
            if not isinstance(saved, SavedStream):
                raise ValueError(_other_kind(loader.identity, "a map-style dataset", "a stream"))
            twins = [other for other in others if other.identity == loader.identity]
            if twins and saved.position is not None:
                raise ValueError(
                    f"two loaders made by ctx.dataloader are both {loader.identity}, and the "
                    "checkpoint holds one mid-epoch position for that: which of them should "
                    "resume is ambiguous. Give them names, ctx.dataloader(..., name='train') "
                    "and (..., name='val'), in the run that saves and in the one that resumes."
                )
            if saved.description != loader.description:
                raise ValueError(
                    f"the loader {loader.identity} reads {loader.description}, but when the "
                    f"checkpoint was saved it read {saved.description}: the data changed, so "
                    "its position cannot be resumed. Resume with the same data, or give the "
                    "new loader another name."
                )
            if saved.position is not None:  # refused: the position waits for a loader that fits
                loader.resume(saved, loader.shard.rank, loader.shard.world_size)
                loader.before_resumed_pass = self._before_resumed_pass
            del self._pending[index]
            return


def _per_data_rank(key: str, positions: list[Any], data_ranks: int) -> list[Any]:
    """One position per rank the data is split over: under tensor parallel, one per group.

    ``ctx.dataloader(..., tp_size=N)`` deals the data to ``world_size // N``
    data ranks; global ranks ``d*N .. d*N+N-1`` read data rank ``d``'s
    batches, so their positions must agree, and the record holds ``d``'s.
    """
    if len(positions) == data_ranks:
        return positions
    group = len(positions) // data_ranks
    groups = [positions[d * group : (d + 1) * group] for d in range(data_ranks)]
    split = [d for d, peers in enumerate(groups) if len(set(map(_comparable, peers))) > 1]
    if split:
        raise ValueError(
            f"the ranks of tensor-parallel group {split[0]} read the loader {key} to different "
            "positions, so a checkpoint cannot say where it stands: every rank of a group must "
            "run the same steps over ctx.dataloader(..., tp_size=N)."
        )
    return [peers[0] for peers in groups]


def _set_epoch(loader: Loader, epoch: int) -> None:
    if isinstance(loader, StreamLoader):
        loader.set_epoch(epoch)
    else:
        loader.shard.set_epoch(epoch)


def _other_kind(identity: str, saved: str, now: str) -> str:
    return (
        f"the checkpoint holds the position of {identity} reading {saved}, but the loader "
        f"{identity} now reads {now}: the data changed, so its position cannot be resumed. "
        "Resume with the same data, or give the new loader another name."
    )


def _comparable(position: Any) -> Any:
    """A position as a hashable value (a stream's: its epoch, counts and completeness)."""
    if isinstance(position, dict):
        return (position["epoch"], position["batches"], position["complete"])
    return position


def stream_record(
    key: str, loader: StreamLoader, positions: list[dict[str, Any]]
) -> dict[str, Any]:
    """What a checkpoint saves for a stream loader: every rank's position, and how it read."""
    return {
        "key": key,
        "kind": "stream",
        "description": loader.description,
        "epoch": positions[0]["epoch"],
        "world_size": len(positions),
        "workers": loader.slots,
        "split": loader.shard.split,
        "complete": all(position["complete"] for position in positions),
        "ranks": positions,
        # what older readers of every record expect: no map-style position here
        "consumed": [0] * len(positions),
        "done": torch.zeros(0, dtype=torch.uint8),
        "length": 0,
        "pad": loader.shard.drop_last,
        "batch_size": loader.shard.batch_size,
    }


def without_length(description: str) -> str:
    """``"T of 16 samples (shuffle=True, pad=True)"`` -> ``"T (shuffle=True, pad=True)"``."""
    return re.sub(r" of \d+ samples", "", description)


def _kind(loader: ShardLoader) -> str:
    return without_length(loader.description)


def _matches(saved: SavedLoader, loader: Loader) -> bool:
    if isinstance(loader, StreamLoader):
        return False
    if saved.key is None:  # an older checkpoint: length and padding are all it recorded
        return saved.length == loader.shard.length and saved.pad == loader.shard.pad
    return saved.key == loader.identity


def saved_loaders(records: list[dict[str, Any]]) -> list[SavedLoader | SavedStream]:
    """The loaders a checkpoint's records describe."""
    return [
        SavedStream(
            key=str(record["key"]),
            description=str(record["description"]),
            epoch=int(record["epoch"]),
            world_size=int(record["world_size"]),
            workers=int(record["workers"]),
            split=str(record["split"]),
            ranks=tuple(record["ranks"]),
            complete=bool(record["complete"]),
        )
        if record.get("kind") == "stream"
        else SavedLoader(
            key=record.get("key"),
            description=str(record.get("description", "")),
            length=int(record["length"]),
            pad=bool(record["pad"]),
            batch_size=int(record.get("batch_size", 0)),
            world_size=int(record["world_size"]),
            position=_position(record),
            drop_last=bool(record.get("drop_last", False)),
        )
        for record in records
    ]


def _position(record: dict[str, Any]) -> Position | None:
    done = record["done"]
    if record["complete"] or (not any(record["consumed"]) and not done.numel()):
        return None  # a finished pass, or one not started: the next pass reads everything
    return Position(
        epoch=int(record["epoch"]),
        world_size=int(record["world_size"]),
        consumed=tuple(int(c) for c in record["consumed"]),
        done=bytes(done.cpu().numpy().tobytes()) if done.numel() else b"",
        fill=int(record.get("fill", 1)),
    )
