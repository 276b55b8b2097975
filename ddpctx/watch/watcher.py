"""The straggler watcher: a thread per rank that publishes its timings; rank 0 judges and prints.

Every ``tick_s`` (1 s) each rank's thread writes its
:class:`~ddpctx.watch.clock.PhaseTimes` (medians over the window) to the job's
store -- the store the hang doctor uses, never the process group, so the
training thread never waits for it and ranks never need to agree on when.
Rank 0's thread reads every rank's and, once each has a full window, asks
:func:`~ddpctx.watch.straggler.find_straggler`. A straggler is printed to stderr
(the report's first line starts ``ddpctx straggler report:``) once it has
lasted ``persist`` windows, again for the same rank at most every ``every``
steps, and a reported rank that has stayed back in the lower band for a
window is said to have caught up (:class:`~ddpctx.watch.straggler.Judge`).
On leaving the block each rank publishes once more and rank 0 judges the
last window (waiting a few seconds at most for the others), so a short job
is judged too.

Keys are per block: each rank counts the blocks it entered on this store,
so a process group that outlives a block (the pytest plugin's) never mixes
two blocks' timings.

The thread never raises into the job: a store that fails ends the watching.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from typing import Any

from ddpctx.watch.clock import PhaseTimes, StepClock
from ddpctx.watch.straggler import Judge, StragglerSettings

PREFIX = "ddpctx/watch/"
#: How long rank 0 waits at the end of the block for the others' last timings.
FINAL_WAIT_S = 3.0


class Watcher:
    """One rank's thread (see the module docstring); :meth:`stop` ends it."""

    def __init__(
        self,
        settings: StragglerSettings,
        clock: StepClock,
        store: Any,
        rank: int,
        world_size: int,
        host: str | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.host = host or socket.gethostname()
        #: The reports rank 0 printed, in order.
        self.reports: list[str] = []
        block = int(store.add(f"{PREFIX}blocks/rank{rank}", 1))
        self._keys = [f"{PREFIX}{block}/rank{r}" for r in range(world_size)]
        self._judge_of = Judge(settings)  # rank 0's: who was reported, whether caught up
        self._published = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpctx-watch", daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Publish and judge once more, then end the thread (bounded time)."""
        self._stop.set()
        self._thread.join(timeout=2 * self.settings.tick_s + 1)
        if self.clock.count == 0:
            return  # no step was timed: nothing to say, and nobody to wait for
        with contextlib.suppress(Exception):
            self._publish(final=True)
            if self.rank == 0:
                self._judge(self._collect(final=True))

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.settings.tick_s):
                if self.clock.count == self._published:
                    continue
                self._publish()
                if self.rank == 0:
                    self._judge(self._collect())
        except Exception:  # the store went away (shutdown) or broke: stop watching, quietly
            return

    def _publish(self, final: bool = False) -> None:
        summary = self.clock.summary(self.rank, self.host)
        self._published = summary.steps
        self.store.set(self._keys[self.rank], json.dumps({**summary.to_json(), "final": final}))

    def _collect(self, final: bool = False) -> list[PhaseTimes] | None:
        """Every rank's latest timings; None while some rank has published none.

        ``final``: wait (a few seconds at most) for every rank's last ones.
        """
        deadline = time.monotonic() + (FINAL_WAIT_S if final else 0.0)
        while True:
            found = [self._read(key) for key in self._keys]
            ready = all(f is not None and (f[1] or not final) for f in found)
            if ready or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if any(f is None for f in found):
            return None
        return [f[0] for f in found if f is not None]

    def _read(self, key: str) -> tuple[PhaseTimes, bool] | None:
        if not self.store.check([key]):
            return None
        record = json.loads(self.store.get(key))
        final = bool(record.pop("final", False))
        return PhaseTimes(**record), final

    def _judge(self, ranks: list[PhaseTimes] | None) -> None:
        if ranks is None:
            return
        report = self._judge_of.observe(ranks)
        if report is not None:
            self._say(report)

    def _say(self, report: str) -> None:
        self.reports.append(report)
        print(report, file=sys.stderr, flush=True)
