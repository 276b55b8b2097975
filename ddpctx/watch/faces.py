"""Watching's face on ``DistContext``: ``log``, ``log_config``, ``timings``, ``profile``.

:class:`Watch` is what ``distributed(log_dir=..., loggers=..., timings=...,
straggler=...)`` sets up for a block: the metrics trail
(:mod:`ddpctx.watch.trail`), the step clock (:mod:`ddpctx.watch.clock`), the
straggler watcher (:mod:`ddpctx.watch.watcher`) and armed profiles
(:mod:`ddpctx.watch.profiling`). :class:`WatchFaces` is mixed into
``DistContext``; each method is a thin call into those modules.
"""

from __future__ import annotations

import functools
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddpctx.hang.inflight import Tracker
from ddpctx.reduce.collectives import Site, all_reduce_tree, check_op, report_failure
from ddpctx.reduce.objects import all_gather_objects
from ddpctx.reduce.packing import OpSpec
from ddpctx.utils.warn import warn_user
from ddpctx.watch.clock import PhaseTimes, StepClock
from ddpctx.watch.metrics import check_scalars
from ddpctx.watch.profiling import Profiling, parse_profile_env
from ddpctx.watch.straggler import StragglerSettings
from ddpctx.watch.trail import Trail
from ddpctx.watch.watcher import Watcher

#: The leaf that says whether any rank has measured a step (the max of the counts), dropped
#: from what ``ctx.log`` returns.
MEASURED = "ddpctx_measured_steps"
#: The leaf that checks that every rank logs the same step (dropped from what ``ctx.log`` returns).
STEP_KEY = "ddpctx_step"


def with_timings(
    metrics: Mapping[str, Any], op: OpSpec, mine: PhaseTimes
) -> tuple[dict[str, Any], OpSpec]:
    """``metrics`` with this rank's timings under ``"timings"``, and the op that averages them.

    The user's ``op`` still applies to every one of their keys; the timings are a mean.

    >>> metrics, op = with_timings({"loss": 1.0}, "sum", PhaseTimes(0, "h", 0, 0, 0, 0))
    >>> sorted(metrics["timings"])[-1], op
    ('step_ms', {'loss': 'sum', 'timings': 'mean', 'ddpctx_measured_steps': 'max'})
    """
    clash = next(
        (k for k in metrics if k == "timings" or (isinstance(k, str) and k.startswith("timings/"))),
        None,
    )
    if clash is not None:  # "timings/data_ms" would name the same column as the timings' own
        raise ValueError(
            f"ctx.log(..., timings=True) adds the key 'timings' (written as 'timings/data_ms', "
            f"...), but the metrics already hold {clash!r} ({metrics[clash]!r}). Rename that "
            "metric, or log without timings=True."
        )
    ops = dict(op) if isinstance(op, Mapping) else {key: op for key in metrics}
    ops.update(timings="mean", **{MEASURED: "max"})
    timed = {**metrics, "timings": {**mine.as_metrics(), MEASURED: float(mine.steps)}}
    return timed, ops


#: The step check's hash: this many bits, so that ``ranks * 2**bits`` sums exactly in float64.
_HASH_BITS = 40
_MASK = 2**64 - 1
_HASHED = f"{STEP_KEY}.h"


def with_step(
    metrics: Mapping[str, Any], op: OpSpec, step: int, world_size: int = 1
) -> tuple[dict[str, Any], OpSpec]:
    """``metrics`` with a leaf that tells, after the reduction, whether every rank had ``step``.

    It rides the wire the metrics use (no collective of its own). Summed (op
    "mean"/"sum"): one float, a 40-bit hash ``g`` of the step
    (:func:`step_hash`); every rank had this rank's step when the sum is
    ``ranks * g(step)``. Equal steps always pass on every rank; unequal ones
    pass on a rank only where the hashes of the others happen to sum to that
    (about once in 10**12 calls with unequal steps), so every rank refuses
    them together. One element, not the four an exact check needs (each
    20-bit half of the step and its square): gloo's latency grows with the
    element count in steps (2 ranks: 1 element 0.27 ms, 2 elements 0.40 ms,
    3 or more 0.6-1.3 ms), so a loss and its check travel in the 2-element
    band. Under "max" or "min": ``step`` and ``-step`` (all equal exactly when
    the two agree). See :func:`steps_agree`.

    The leaf sits first, beside the metrics, as a ``ddpctx_step.<name>`` key
    (not in a dict of its own): a flat dict of scalars stays flat and takes
    the reduction's fast path (:mod:`ddpctx.reduce.fastpath`), and the
    protocol's flag rides as NaN in a value that is never NaN.
    :func:`take_step` takes it back out.

    >>> with_step({"loss": 1.0}, "max", 3)
    ({'ddpctx_step.s': 3.0, 'ddpctx_step.s2': -3.0, 'loss': 1.0}, {'loss': 'max', \
'ddpctx_step.s': 'max', 'ddpctx_step.s2': 'max'})
    >>> take_step(with_step({"loss": 1.0}, "mean", 7)[0]) == {"h": float(step_hash(7))}
    True
    """
    clash = next((key for key in metrics if _is_step_key(key)), None)
    if clash is not None:
        raise ValueError(
            f"ctx.log got a metric named {clash!r}, which ddpctx uses to check the step "
            "across ranks. Name the metric otherwise."
        )
    kind = op if isinstance(op, str) and op in ("max", "min") else "sum"
    leaves: dict[str, Any]
    if kind != "sum":  # exact as floats below 2**53; beyond, as ints (an int64 wire)
        exact = -(2**53) < step < 2**53
        leaves = {"s": float(step), "s2": -float(step)} if exact else {"s": step, "s2": -step}
    else:
        leaves = {"h": float(step_hash(step, world_size))}
    ops = dict(op) if isinstance(op, Mapping) else {key: op for key in metrics}
    flat = {f"{STEP_KEY}.{name}": value for name, value in leaves.items()}
    ops.update(dict.fromkeys(flat, kind))
    return {**flat, **metrics}, ops


def take_step(reduced: dict[str, Any]) -> dict[str, Any]:
    """Pop :func:`with_step`'s leaves out of ``reduced``; return them by their own names.

    >>> reduced = {"ddpctx_step.s": 6.0, "ddpctx_step.s2": -6.0, "loss": 0.5}
    >>> take_step(reduced), reduced
    ({'s': 6.0, 's2': -6.0}, {'loss': 0.5})
    """
    if _HASHED in reduced:  # the common case: one leaf, popped by name
        return {"h": reduced.pop(_HASHED)}
    names = [key for key in reduced if _is_step_key(key)]
    return {name[len(STEP_KEY) + 1 :]: reduced.pop(name) for name in names}


def _is_step_key(key: Any) -> bool:
    return isinstance(key, str) and (key == STEP_KEY or key.startswith(STEP_KEY + "."))


@functools.lru_cache(maxsize=8)  # with_step and steps_agree hash the same step
def step_hash(step: int, world_size: int = 1) -> int:
    """A well-mixed hash of ``step`` (splitmix64's finaliser) with as many bits as ``world_size``
    ranks can sum exactly in float64: 40 up to 8,192 ranks, fewer beyond.

    >>> step_hash(0) != step_hash(1) and step_hash(1) < 2**40
    True
    """
    bits = min(_HASH_BITS, 53 - max(1, world_size).bit_length())
    mixed = (step + 0x9E3779B97F4A7C15) & _MASK
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _MASK
    return (mixed ^ (mixed >> 31)) >> (64 - bits)


def steps_agree(leaves: Mapping[str, Any], world_size: int, step: int) -> bool:
    """Whether the reduced leaves of :func:`with_step` say every rank logged ``step``.

    >>> steps_agree({"h": 2.0 * step_hash(5, 2)}, 2, 5)
    True
    >>> steps_agree({"h": float(step_hash(5, 2) + step_hash(6, 2))}, 2, 5)
    False
    >>> steps_agree({"s": 6.0, "s2": -5.0}, 2, 6)  # under "max": max(s) 6, min(s) 5
    False
    """
    if "h" in leaves:
        return bool(leaves["h"] == world_size * step_hash(step, world_size))
    return bool(leaves["s"] == -leaves["s2"])


class Watch:
    """One block's watching: trail, clock, straggler watcher, profiles; :meth:`stop` ends them."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        log_dir: Path | None,
        loggers: list[Any],
        timings: bool,
        straggler: StragglerSettings | None,
        tracker: Tracker | None,
        *,
        cuda: bool = False,
        store: Any = None,
        profile_env: str | None = None,
    ) -> None:
        self.rank = rank
        self.host = socket.gethostname()
        self.log_dir = log_dir
        self.trail = Trail(loggers, writer=rank == 0)
        window = straggler.window if straggler is not None else 50
        self.world_size = world_size
        self.clock: StepClock | None = StepClock(tracker, window, cuda=cuda) if timings else None
        self.watcher: Watcher | None = None
        self.profiles: list[Profiling] = []
        if profile_env:
            steps, ranks = parse_profile_env(profile_env, world_size)
            self.add_profile(Profiling(rank, log_dir, steps, ranks, {}, world_size))
        if (
            self.clock is not None
            and straggler is not None
            and store is not None
            and world_size > 1
        ):
            self.watcher = Watcher(straggler, self.clock, store, rank, world_size, self.host)
            self.watcher.start()
        # last: nothing above may raise with the hooks on
        self._unhook = self.clock.install() if self.clock is not None else None

    def watch_model(self, model: object) -> None:
        """Time the forward of a model from ``ctx.wrap`` / ``ctx.shard`` (step timings)."""
        if self.clock is not None:
            self.clock.watch_model(model)

    def add_profile(self, profiling: Profiling) -> Profiling:
        if profiling.steps is not None:
            if self.clock is None:
                raise ValueError(
                    f"ctx.profile(steps={profiling.steps!r}) counts the steps the step clock "
                    "times, but this block has timings=False. Use distributed(timings=True), "
                    "or `with ctx.profile():` around the code to profile."
                )
            self.clock.listeners.append(profiling.on_step)
        self.profiles.append(profiling)
        return profiling

    def stop(self, how: str = "finished") -> None:
        """Stop the watcher, finish profiles, close the trail (the block ``how``: finished...)."""
        try:
            self._stop_clock()
            if self.watcher is not None:
                self.watcher.stop()
        finally:
            try:
                for profiling in self.profiles:
                    profiling.stop()
            finally:
                self.trail.close(how)

    def _stop_clock(self) -> None:
        """Take the clock's hooks off; say so when a training loop went untimed."""
        clock, unhook, self._unhook = self.clock, self._unhook, None
        if clock is None or unhook is None:
            return
        unhook()
        clock.close()
        if clock.count == 0 and clock.trained and self.rank == 0 and self.world_size > 1:
            warn_user(
                "ddpctx timed no step in this block: its models ran backward, but "
                "steps end at an optimizer.step() of a torch.optim optimizer or at each "
                "batch of ctx.dataloader, and neither happened, so there are no timings "
                "and no straggler report. Step a torch.optim optimizer, read batches "
                "through ctx.dataloader, or pass distributed(timings=False) to say you "
                "need none."
            )


class WatchFaces:
    """``ctx.log``, ``ctx.log_config``, ``ctx.timings``, ``ctx.profile``."""

    rank: int
    world_size: int
    _sites: dict[str, Site]
    _watch: Watch | None = None

    def log(
        self,
        metrics: Mapping[str, Any],
        step: int | None = None,
        *,
        op: OpSpec = "mean",
        weight: str | None = None,
        timings: bool = False,
    ) -> dict[str, Any]:
        """Reduce ``metrics`` across ranks (one collective) and have rank 0 write them.

        Call it on every rank, as ``ctx.all_reduce`` (the same engine: ``op``
        and ``weight`` as in :func:`ddpctx.all_reduced`; nested dicts become
        ``"outer/inner"`` names). ``step`` defaults to one after the last step
        logged (0 first; after ``load_checkpoint``, the checkpoint's next).
        ``timings=True`` adds this rank's median step timings
        (``timings/data_ms``, ...), averaged over ranks whatever ``op`` is,
        once any rank has measured a step (before that they are left out,
        not written as 0 ms). Rank 0's loggers
        (``distributed(log_dir=..., loggers=...)``) write on a thread of their
        own; every rank gets the reduced values back.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     ctx.log({"loss": 0.5, "count": 4}, weight="count")
        {'loss': 0.5, 'count': 4}
        """
        caller = sys._getframe(1)
        key = f"log:{caller.f_code.co_filename}:{caller.f_lineno}"
        site = self._sites.get(key) or self._sites.setdefault(key, Site(f"ctx.log at {key[4:]}"))
        watch = self._watch
        trail = watch.trail if watch is not None else None
        try:  # refused here, on this rank only: the others hear of it in the reduction
            check_op(op)
            number = trail.next_step(step) if trail is not None else step
            check_scalars(metrics)
            if timings:
                metrics, op = with_timings(metrics, op, self._own_timings())
            checked = trail is not None and number is not None and self.world_size > 1
            if checked:
                metrics, op = with_step(metrics, op, number, self.world_size)  # type: ignore[arg-type]
        except (ValueError, TypeError) as error:
            if self.world_size > 1:
                report_failure(error, site)
            raise
        reduced: dict[str, Any] = all_reduce_tree(dict(metrics), op, weight, site=site)
        if checked and not steps_agree(take_step(reduced), self.world_size, number):  # type: ignore[arg-type]
            everyone = all_gather_objects(number)  # every rank saw the disagreement
            raise ValueError(
                "ctx.log was called with a different step on different ranks ("
                + ", ".join(f"rank {rank}: step {s}" for rank, s in enumerate(everyone))
                + "), so no rank wrote it. The trail has one line per step: pass the same "
                "step= on every rank (e.g. a counter every rank keeps alike), or leave step= "
                "out to take the one after the last step logged."
            )
        if timings and not reduced["timings"].pop(MEASURED):
            del reduced["timings"]  # no rank has measured a step yet: nothing to say
        if trail is not None and number is not None:
            trail.record(number, reduced)
        return reduced

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's configuration once (rank 0; a resumed run does not record it again).

        ``log_dir/ddpctx-config.json`` for the ``jsonl`` logger (never ``config.json``,
        which ``save_pretrained`` writes to the same folder), a ``config`` text
        in TensorBoard, ``log_hparams(config)`` of a logger object that has one.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     ctx.log_config({"lr": 0.1})
        """
        if self._watch is not None:
            self._watch.trail.config(dict(config))

    def timings(self) -> dict[int, PhaseTimes]:
        """Every rank's median step timings over the window, by rank (call it on every rank).

        Data wait, compute and collective wait per step, measured with no code
        of yours (:mod:`ddpctx.watch.clock`), as
        :class:`~ddpctx.watch.clock.PhaseTimes` in seconds. One all-gather.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     for batch in ctx.dataloader(list(range(8)), batch_size=2):
        ...         pass
        ...     ctx.timings()[0].steps
        4
        """
        mine = self._own_timings()
        everyone = all_gather_objects(mine) if self.world_size > 1 else [mine]
        return {times.rank: times for times in everyone}

    def profile(
        self,
        steps: tuple[int, int] | None = None,
        ranks: Sequence[int] | None = None,
        **profiler_kwargs: Any,
    ) -> Profiling:
        """``torch.profiler`` traces, one file per rank: ``log_dir/profile/rank<r>.pt.trace.json``.

        ``steps=(first, last)`` profiles those steps as the step clock counts
        them (from 0: optimizer steps, or ``ctx.dataloader`` batches in a loop
        without an optimizer; :mod:`ddpctx.watch.clock`) with no code in the
        loop; without ``steps`` use it as ``with ctx.profile():``. ``ranks``
        limits it to those ranks (each below the world size).
        ``profiler_kwargs`` go to ``torch.profiler.profile`` (e.g.
        ``record_shapes=True``). Also ``DDPCTX_PROFILE=10-12@0,1``. A trace
        never replaces another: a later one is ``rank<r>.1.pt.trace.json``, ...
        Without ``log_dir`` traces go to ``./profile/`` and a warning says so.

        >>> from ddpctx import distributed
        >>> import tempfile, torch
        >>> with distributed(log_dir=tempfile.mkdtemp()) as ctx:
        ...     with ctx.profile() as profiling:
        ...         _ = torch.ones(3) * 2
        >>> profiling.path.name, profiling.done
        ('rank0.pt.trace.json', True)
        """
        watch = self._watch
        profiling = Profiling(
            self.rank,
            watch.log_dir if watch else None,
            steps,
            ranks,
            profiler_kwargs,
            self.world_size,
        )
        return watch.add_profile(profiling) if watch is not None else profiling

    def _own_timings(self) -> PhaseTimes:
        watch = self._watch
        clock = watch.clock if watch is not None else None
        host = watch.host if watch is not None else socket.gethostname()
        if clock is None:
            return PhaseTimes(self.rank, host, 0, 0.0, 0.0, 0.0, 0.0)
        return clock.summary(self.rank, host)
