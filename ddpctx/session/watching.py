"""``distributed()``'s watching options, checked, and their start: trail, timings, straggler watch.

:func:`resolve_watching` checks ``log_dir``, ``loggers``, ``timings``,
``straggler`` and ``DDPCTX_PROFILE`` with no side effect (part of the plan
``distributed()`` makes before it starts anything). :func:`start_watching`
builds the block's :class:`~ddpctx.watch.faces.Watch` once the group exists,
wires it into the context (``ctx.log``, the loaders' and models' step clock, the
checkpoint hooks that record and resume the metrics trail) and registers its
stop, which runs before the hang doctor's trackers come off and the group
is destroyed. Before that, with a built-in file logger, rank 0 checks that it
can write ``log_dir`` (:func:`~ddpctx.watch.loggers.check_log_dir`) and every
rank raises the same ``ValueError`` when it cannot (one object gather).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import contextlib2
import torch
import torch.distributed.distributed_c10d as c10d

from ddpctx.hang.inflight import Tracker
from ddpctx.reduce.objects import all_gather_objects
from ddpctx.session.distcontext import DistContext
from ddpctx.utils.env import LaunchInfo
from ddpctx.watch.faces import Watch
from ddpctx.watch.files import FileLogger
from ddpctx.watch.loggers import check_log_dir, make_loggers
from ddpctx.watch.profiling import ENV as PROFILE_ENV
from ddpctx.watch.profiling import parse_profile_env
from ddpctx.watch.servers import outcome
from ddpctx.watch.straggler import StragglerSettings, resolve_straggler


@dataclass(frozen=True)
class Watching:
    """The resolved watching options of one block."""

    log_dir: Path | None
    loggers: list[Any]
    timings: bool
    straggler: StragglerSettings | None
    profile: str | None


def resolve_watching(
    log_dir: object,
    loggers: object,
    timings: object,
    straggler: object,
    environ: Mapping[str, str],
    world_size: int | None = None,
) -> Watching:
    """The options checked; a bad one is a ``ValueError`` naming it and the fix.

    >>> resolve_watching("runs/a", None, True, True, {}).loggers[0].path.name
    'metrics.jsonl'
    >>> resolve_watching(None, ("jsonl",), True, True, {})
    Traceback (most recent call last):
    ...
    ValueError: loggers=('jsonl',) writes files but no log_dir was given. ...
    """
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise ValueError(
            f"distributed(log_dir={log_dir!r}): a directory path is needed, e.g. log_dir='runs/a'."
        )
    if not isinstance(timings, bool):
        raise ValueError(f"distributed(timings={timings!r}): pass True or False.")
    folder = None if log_dir is None else Path(os.fspath(log_dir))
    chosen: Sequence[object] = ("jsonl",) if loggers is None and folder is not None else ()
    if loggers is not None:
        if not isinstance(loggers, Sequence):
            raise ValueError(
                f"distributed(loggers={loggers!r}): pass a tuple of names or logger objects, "
                "e.g. loggers=('jsonl', 'tensorboard')."
            )
        chosen = loggers
    profile = environ.get(PROFILE_ENV) or None
    if profile is not None:
        parse_profile_env(profile, world_size)
    settings = resolve_straggler(straggler, environ)
    return Watching(folder, make_loggers(chosen, folder), timings, settings, profile)


def start_watching(
    context: DistContext,
    watching: Watching,
    info: LaunchInfo,
    device: torch.device,
    tracker: Tracker | None,
    stack: contextlib2.ExitStack,
) -> Watch:
    """Start the block's watching and wire it into ``context``; ``stack`` stops it."""
    if watching.log_dir is not None and any(
        isinstance(logger, FileLogger) for logger in watching.loggers
    ):
        problem = check_log_dir(watching.log_dir) if info.rank == 0 else None
        if info.world_size > 1:
            problem = all_gather_objects(problem)[0]
        if problem is not None:
            raise ValueError(problem)
    watch = Watch(
        info.rank,
        info.world_size,
        watching.log_dir,
        watching.loggers,
        watching.timings,
        watching.straggler,
        tracker,
        cuda=device.type == "cuda",
        store=_store() if watching.straggler is not None else None,
        profile_env=watching.profile,
    )

    def stop(kind: object, error: BaseException | None, trace: object) -> bool:
        watch.stop(outcome(error))  # the trackers are told how the block ended
        return False

    stack.push(stop)
    context._watch = watch
    context._before_save = watch.trail.checkpoint_meta
    context._after_load = watch.trail.restored
    if watch.clock is not None:
        context._timed = watch.clock.timed
        context._on_model = watch.watch_model  # a loop of its own batches is timed too
    return watch


def _store() -> Any:
    try:
        return c10d._get_default_store()
    except Exception:  # a group without a reachable store: no straggler report
        return None
