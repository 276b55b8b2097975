"""The plugin's warm rank pools, and stopping them when pytest is told to stop.

One warm :class:`~ddpctx.launching.pool.RankPool` per world size, kept for
the session (an ``isolated=True`` test gets a pool of its own for its run).

SIGTERM or SIGHUP to the pytest process (a CI job cancelled, a terminal
closed) would end it at once: its ranks die with it (``PR_SET_PDEATHSIG``),
but what a test started in a rank -- a subprocess, a DataLoader worker -- is
left running, reparented to PID 1. While pools exist, those signals first
close every pool (its ranks' process groups are killed, their children with
them) and then take their default action, so pytest still ends by the
signal. Only from the main thread, and only where nobody installed a handler
of their own.

This module imports neither torch nor ddpctx's torch-using modules at import
time: pytest loads the plugin in every session.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpctx.launching.pool import RankPool

#: What stops pytest without running its clean-up: these close the pools first.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Pools:
    """One warm :class:`~ddpctx.launching.pool.RankPool` per world size."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}
        self._isolated: RankPool | None = None  # an isolated test's pool, while it runs
        self._handlers: dict[int, Any] = {}  # signal -> the handler before ours
        self._owner = os.getpid()  # a forked rank inherits the handler, never the pools

    def run(
        self,
        world_size: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
        *,
        isolated: bool = False,
        init: bool = True,
        echo: bool = False,
    ) -> tuple[list[Any], list[tuple[str, str]]]:
        """Per-rank results and per-rank ``(stdout, stderr)``."""
        warm_up()
        from ddpctx.launching.pool import RankPool
        from ddpctx.launching.worker import Task

        self._close_on_stop_signals()

        if isolated or not _picklable((fn, args, kwargs)):
            # Fresh ranks, forked with the function and its arguments in memory.
            first = Task(fn, args, kwargs, None, timeout, init=init)
            with RankPool(world_size, first=first) as pool:
                self._isolated = pool
                try:
                    results = pool.run(fn, args, kwargs, timeout=timeout, init=init, echo=echo)
                finally:
                    self._isolated = None
                return results, pool.last_outputs
        if world_size not in self._pools or not self._pools[world_size].healthy:
            self._pools[world_size] = RankPool(world_size)
        pool = self._pools[world_size]
        results = pool.run(fn, args, kwargs, timeout=timeout, init=init, echo=echo)
        return results, pool.last_outputs

    def close(self) -> None:
        """Stop every pool's ranks and what they started; put the signal handlers back."""
        for pool in [*self._pools.values(), *filter(None, [self._isolated])]:
            pool.close()
        self._pools.clear()
        for signum, handler in self._handlers.items():
            if signal.getsignal(signum) == self._stop:
                signal.signal(signum, handler)
        self._handlers.clear()

    def _close_on_stop_signals(self) -> None:
        """SIGTERM/SIGHUP to pytest close the pools first (see the module docstring)."""
        if self._handlers or threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                self._handlers[signum] = signal.SIG_DFL
                signal.signal(signum, self._stop)

    def _stop(self, signum: int, frame: object) -> None:
        for number in self._handlers:
            signal.signal(number, signal.SIG_DFL)  # a second signal ends the process at once
        try:
            if os.getpid() == self._owner:
                self.close()
        finally:
            os.kill(os.getpid(), signum)  # the default action: pytest ends by the signal


#: Imported once in the pytest process, before any pool forks, so that every rank -- of
#: every pool, also one that replaces a spoiled pool -- starts with them loaded: torch;
#: ddpctx's rank side (which pytest compiles anew, rewriting its asserts, as the plugin's
#: package); and ``torch._dynamo``, which DDP's constructor imports on first use (3-8 s,
#: paid otherwise by the first ``ctx.wrap`` in each rank of each pool).
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "ddpctx.session.context",
    "ddpctx.launching.worker",
    "ddpctx.launching.taskstate",
    "torch.nn.parallel",
    "torch._dynamo",
)


def warm_up() -> None:
    """Import :data:`WARM_MODULES` here (once; later calls cost a dict lookup each)."""
    import importlib

    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # torch._dynamo may be missing from a minimal torch build
            continue


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True
