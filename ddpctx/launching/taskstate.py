"""What one task may change in a reused rank process, and undoing it afterwards.

A warm rank (:mod:`ddpctx.launching.worker`) runs many tasks -- under the pytest
plugin, many tests -- so whatever a task changes in the process would reach
the next one, and outcomes would depend on test order. :func:`task_state`
wraps one task and, on the way out, puts back:

- ``os.environ`` (every variable: added, changed, removed) and the working
  directory;
- torch's default dtype, the deterministic-algorithm switches and the cuDNN
  flags;
- the generator states of ``random``, NumPy and torch, reset to those the
  rank started with, so every task starts from the same random state
  whatever ran before it.

Not restored -- it cannot be, cheaply: module-level globals, imported
modules, class attributes, open files and threads a task started. Tests that
need a truly fresh process ask for one (``isolated=True`` in the plugin).

Example:
    >>> import os
    >>> saved = capture()
    >>> os.environ["DDPCTX_EXAMPLE"] = "1"
    >>> restore(saved)
    >>> "DDPCTX_EXAMPLE" in os.environ
    False
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ddpctx.utils.seeding import rng_state, set_rng_state


@dataclass
class RankState:
    environ: dict[str, str]
    cwd: str
    default_dtype: torch.dtype
    deterministic: bool
    deterministic_warn_only: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    rng: dict[str, Any]


def capture() -> RankState:
    """This process's restorable state, now."""
    return RankState(
        environ=dict(os.environ),
        cwd=os.getcwd(),
        default_dtype=torch.get_default_dtype(),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        rng=rng_state(),
    )


def restore(state: RankState) -> None:
    """Put back everything :func:`capture` recorded."""
    replace_environ(state.environ)
    with contextlib.suppress(OSError):  # the directory may have been removed meanwhile
        os.chdir(state.cwd)
    torch.set_default_dtype(state.default_dtype)
    switches = (state.deterministic, state.deterministic_warn_only)
    if switches != (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ):  # only when changed: the call itself can take seconds (it imports torch._inductor)
        torch.use_deterministic_algorithms(switches[0], warn_only=switches[1])
    torch.backends.cudnn.deterministic = state.cudnn_deterministic
    torch.backends.cudnn.benchmark = state.cudnn_benchmark
    set_rng_state(state.rng)


def replace_environ(environ: dict[str, str]) -> None:
    """Make ``os.environ`` exactly ``environ`` (through ``os.environ``, so C code sees it)."""
    for name in [name for name in os.environ if name not in environ]:
        del os.environ[name]
    for name, value in environ.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


@contextlib.contextmanager
def task_state(start: RankState, environ: dict[str, str] | None, cwd: str | None) -> Iterator[None]:
    """Run a task in ``environ`` and ``cwd`` (when given), then restore ``start``."""
    try:
        set_rng_state(start.rng)
        if environ is not None:
            replace_environ(environ)
        if cwd is not None:
            os.chdir(cwd)
        yield
    finally:
        restore(start)
