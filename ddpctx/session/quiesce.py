"""Let gloo's worker threads finish before the group is left, so the process can exit cleanly.

A gloo collective runs on one of the process group's worker threads. When it
completes, the caller's ``wait()`` returns at once, but the worker thread
still holds the finished work (and through it the tensors it reduced) for a
moment longer. If the caller has dropped those tensors by then, the worker's
release is the last one, and freeing a tensor that Python created needs the
GIL. Normally that is harmless. But when the worker is descheduled (a busy
machine) until the interpreter is already shutting down, taking the GIL ends
the thread with ``pthread_exit``, which cannot unwind through torch's C++
frames: the process dies with ``terminate called without an active
exception`` (SIGABRT) after the script finished successfully. Destroying the
group does not help while anything still holds it: a DDP model left in a
global holds its group until the interpreter frees it.

Measured with plain torch (2 ranks under torchrun, an async ``all_reduce``
of a Python tensor as the last collective, then exit): 3 of 12 runs aborted
so; 1 of 12 with ``destroy_process_group()`` called while a reference to the
group was kept, as DDP keeps it.

:func:`quiesce_gloo_workers` waits, bounded, until every gloo worker thread
of this process is asleep (waiting for its next work), reading the threads'
states from ``/proc`` (Linux; elsewhere it returns at once). ``distributed()``
calls it as the block ends, after its last collective and before the group
is destroyed. While it waits it sleeps, so a worker waiting for the GIL gets
it.
"""

from __future__ import annotations

import time
from pathlib import Path

#: The name gloo's worker threads carry (``/proc/<pid>/task/<tid>/comm``).
WORKER_NAME = "pt_gloo_runloop"
#: How long the end of a block waits at most for busy workers.
QUIESCE_TIMEOUT_S = 2.0
#: Consecutive reads with every worker asleep that count as idle.
CALM_READS = 3
#: The pause between reads (the GIL is free meanwhile).
READ_PAUSE_S = 0.002


def worker_states(tasks: Path = Path("/proc/self/task")) -> list[str]:
    """The scheduler state (``R``, ``S``, ``D``, ...) of each gloo worker thread in this process.

    Empty where ``/proc`` is not there (not Linux) or the process has no gloo
    group. A thread that ends while being read is left out.

    >>> isinstance(worker_states(), list)
    True
    """
    states = []
    try:
        threads = list(tasks.iterdir())
    except OSError:
        return []
    for thread in threads:
        try:
            if (thread / "comm").read_text().strip() != WORKER_NAME:
                continue
            stat = (thread / "stat").read_text()
        except OSError:
            continue
        # "tid (comm) S ...": the state follows the last ')' (a name may hold one); a line
        # read while it changed, without one, is left out like a thread that ended
        fields = stat.rsplit(")", 1)[-1].split() if ")" in stat else []
        if fields:
            states.append(fields[0])
    return states


def quiesce_gloo_workers(
    timeout_s: float = QUIESCE_TIMEOUT_S, tasks: Path = Path("/proc/self/task")
) -> bool:
    """Wait until every gloo worker thread sleeps; False if one was still busy at ``timeout_s``.

    Returns at once (True) where there are no such threads or no ``/proc``.
    A thread counts as busy while it runs or waits to run (state ``R``) or
    is in uninterruptible sleep (``D``).

    >>> quiesce_gloo_workers(timeout_s=0.1)
    True
    """
    deadline = time.monotonic() + timeout_s
    calm = 0
    while True:
        states = worker_states(tasks)
        if not states:
            return True
        calm = calm + 1 if all(state not in ("R", "D") for state in states) else 0
        if calm >= CALM_READS:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(READ_PAUSE_S)
