"""Watching's face on ``DistContext``: ``log``, ``log_config``, ``timings``, ``profile``.

:class:`Watch` is what ``distributed(log_dir=..., loggers=..., timings=...,
straggler=...)`` sets up for a block: the metrics trail
(:mod:`ddpctx.watch.trail`), the step clock (:mod:`ddpctx.watch.clock`), the
straggler watcher (:mod:`ddpctx.watch.watcher`) and armed profiles
(:mod:`ddpctx.watch.profiling`). :class:`WatchFaces` is mixed into
``DistContext``; each method is a thin call into those modules.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddpctx.hang.inflight import Tracker
from ddpctx.reduce.collectives import Site, all_reduce_tree, check_op
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
    if "timings" in metrics:
        raise ValueError(
            f"ctx.log(..., timings=True) adds the key 'timings', but the metrics already hold "
            f"one ({metrics['timings']!r}). Rename that metric, or log without timings=True."
        )
    ops = dict(op) if isinstance(op, Mapping) else {key: op for key in metrics}
    ops.update(timings="mean", **{MEASURED: "max"})
    timed = {**metrics, "timings": {**mine.as_metrics(), MEASURED: float(mine.steps)}}
    return timed, ops


#: A step travels as float64 halves of this many bits (their squares summed stay exact).
_HALF_BITS = 20
#: Up to this many ranks those sums are exact in float64: ranks * 2**40 < 2**53.
_FLOAT_RANKS = 2**12


def with_step(
    metrics: Mapping[str, Any], op: OpSpec, step: int, world_size: int = 1
) -> tuple[dict[str, Any], OpSpec]:
    """``metrics`` with leaves that tell, after the reduction, whether every rank had ``step``.

    They ride the wire the metrics use (no collective of their own where the
    op is "mean"/"sum", "max" or "min"). Summed: each 20-bit half ``h`` of the
    step and ``h**2`` as Python floats (for each half, all ranks' are equal
    exactly when ``n * sum(h**2) == sum(h)**2``; every sum is exact in
    float64 while the step is below 2**40 and the ranks fewer than 4,096).
    Floats travel as they are, where integers would travel as exact int64
    pieces, cut and joined by a dozen tensor operations a call (167 against
    80 us for a loss and its step, one process). Beyond those bounds the step
    and its square travel as integers. Under "max" or "min": ``step`` and
    ``-step`` (all equal exactly when the two agree). See :func:`steps_agree`.

    >>> with_step({"loss": 1.0}, "max", 3)
    ({'loss': 1.0, 'ddpctx_step': {'s': 3.0, 's2': -3.0}}, {'loss': 'max', 'ddpctx_step': 'max'})
    >>> with_step({"loss": 1.0}, "mean", 2**20 + 3)[0]["ddpctx_step"]
    {'a': 3.0, 'a2': 9.0, 'b': 1.0, 'b2': 1.0}
    """
    if STEP_KEY in metrics:
        raise ValueError(
            f"ctx.log got a metric named {STEP_KEY!r}, which ddpctx uses to check the step "
            "across ranks. Name the metric otherwise."
        )
    kind = op if isinstance(op, str) and op in ("max", "min") else "sum"
    leaves: dict[str, Any]
    if kind != "sum":
        leaves = {"s": float(step), "s2": -float(step)}
    elif 0 <= step < 2 ** (2 * _HALF_BITS) and world_size < _FLOAT_RANKS:
        low, high = step & (2**_HALF_BITS - 1), step >> _HALF_BITS
        leaves = {"a": float(low), "a2": float(low * low), "b": float(high), "b2": float(high**2)}
    else:
        leaves = {"s": step, "s2": step * step}
    ops = dict(op) if isinstance(op, Mapping) else {key: op for key in metrics}
    ops[STEP_KEY] = kind
    return {**metrics, STEP_KEY: leaves}, ops


def steps_agree(leaves: Mapping[str, Any], world_size: int) -> bool:
    """Whether the reduced leaves of :func:`with_step` say every rank logged one step.

    >>> steps_agree({"s": 6, "s2": 18}, 2), steps_agree({"s": 5, "s2": 13}, 2)
    (True, False)
    >>> steps_agree({"a": 6.0, "a2": 18.0, "b": 2.0, "b2": 2.0}, 2)
    True
    """
    if "a" in leaves:  # exact sums of floats: compared as integers, where no square rounds
        return all(
            world_size * int(leaves[square]) == int(leaves[half]) ** 2
            for half, square in (("a", "a2"), ("b", "b2"))
        )
    first, second = leaves["s"], leaves["s2"]
    if isinstance(first, float):  # "max"/"min": max(s) == -max(-s) only when all are equal
        return bool(first == -second)
    return bool(world_size * second == first * first)


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

    def stop(self) -> None:
        """Stop the watcher (its last judgement), finish profiles, flush and close the trail."""
        try:
            self._stop_clock()
            if self.watcher is not None:
                self.watcher.stop()
        finally:
            try:
                for profiling in self.profiles:
                    profiling.stop()
            finally:
                self.trail.close()

    def _stop_clock(self) -> None:
        """Take the clock's hooks off; say so when a training loop went untimed."""
        clock, unhook, self._unhook = self.clock, self._unhook, None
        if clock is None or unhook is None:
            return
        unhook()
        clock.close()
        if clock.count == 0 and clock.worked and self.rank == 0 and self.world_size > 1:
            warn_user(
                "ddpctx timed no step in this block: its models ran forward/backward, but "
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
        check_op(op)
        watch = self._watch
        trail = watch.trail if watch is not None else None
        number = trail.next_step(step) if trail is not None else step
        check_scalars(metrics)
        if timings:
            metrics, op = with_timings(metrics, op, self._own_timings())
        checked = trail is not None and number is not None and self.world_size > 1
        if checked:
            metrics, op = with_step(metrics, op, number, self.world_size)  # type: ignore[arg-type]
        caller = sys._getframe(1)
        key = f"log:{caller.f_code.co_filename}:{caller.f_lineno}"
        site = self._sites.setdefault(key, Site(f"ctx.log at {key[4:]}"))
        reduced: dict[str, Any] = all_reduce_tree(dict(metrics), op, weight, site=site)
        if checked and not steps_agree(reduced.pop(STEP_KEY), self.world_size):
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

        ``log_dir/config.json`` for the ``jsonl``/``csv`` loggers, a ``config`` text
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
