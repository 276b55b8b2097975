"""What one task may change in a reused rank process, and undoing it afterwards.

A warm rank (:mod:`ddpctx.launching.worker`) runs many tasks -- under the pytest
plugin, many tests -- so whatever a task changes in the process would reach
the next one, and outcomes would depend on test order. :func:`task_state`
wraps one task and, on the way out, puts back:

- ``os.environ`` (every variable: added, changed, removed), the working
  directory, ``sys.path`` and ``sys.excepthook`` (torch wraps it anew for
  every group a task forms);
- torch's global switches: default dtype and device (also a ``with
  torch.device(...)`` context entered and never left), gradient mode, anomaly
  detection, intra-op thread count, float32 matmul precision, the
  deterministic-algorithm switches, and the cuDNN and CUDA-matmul flags;
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
import sys
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
    path: list[str]
    excepthook: Any
    grad_enabled: bool
    default_device: str | None
    #: Depth of torch's function-mode stack (``with torch.device(...)`` contexts push on it).
    function_modes: int
    anomaly: tuple[bool, bool]
    threads: int
    matmul_precision: str
    #: torch.backends flags, by (module, attribute): set and read as plain attributes.
    backend_flags: dict[tuple[Any, str], bool]


def _backend_flags() -> dict[tuple[Any, str], bool]:
    flags = [
        (torch.backends.cudnn, "enabled"),
        (torch.backends.cudnn, "allow_tf32"),
        (torch.backends.cuda.matmul, "allow_tf32"),
        (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
        (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
    ]
    found = {}
    for module, name in flags:
        with contextlib.suppress(Exception):  # a flag this torch does not have
            found[(module, name)] = bool(getattr(module, name))
    return found


def _default_device() -> str | None:
    """The device ``torch.set_default_device`` set, or None where none is set.

    ``torch.get_default_device()`` says ``cpu`` both when none is set and after
    ``set_default_device("cpu")``, which costs every torch call a mode dispatch.
    """
    context = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    return None if context is None else str(context.device)


def _function_modes() -> int:
    """How many modes torch's function-mode stack holds (0 where this torch cannot say)."""
    depth = getattr(torch._C, "_len_torch_function_stack", None)
    return int(depth()) if depth is not None else 0


def _pop_function_modes(depth: int) -> None:
    """Leave the ``torch.device(...)`` contexts a task entered and never left, down to ``depth``.

    Stops under the context of ``torch.set_default_device``, which only
    ``set_default_device`` may remove (it keeps a reference to it).
    """
    pop = getattr(torch._C, "_pop_torch_function_stack", None)
    push = getattr(torch._C, "_push_on_torch_function_stack", None)
    if pop is None or push is None:
        return
    default = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    while _function_modes() > depth:
        mode = pop()
        if default is not None and mode is default:
            push(mode)
            return


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
        path=list(sys.path),
        excepthook=sys.excepthook,
        grad_enabled=torch.is_grad_enabled(),
        default_device=_default_device(),
        function_modes=_function_modes(),
        anomaly=(torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        threads=torch.get_num_threads(),
        matmul_precision=torch.get_float32_matmul_precision(),
        backend_flags=_backend_flags(),
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
    for (module, name), value in state.backend_flags.items():
        setattr(module, name, value)
    sys.path[:] = state.path
    sys.excepthook = state.excepthook
    torch.set_grad_enabled(state.grad_enabled)
    _pop_function_modes(state.function_modes)  # those over the default device's first
    if _default_device() != state.default_device:
        torch.set_default_device(state.default_device)
    _pop_function_modes(state.function_modes)
    if (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()) != state.anomaly:
        torch.set_anomaly_enabled(*state.anomaly)
    if torch.get_num_threads() != state.threads:
        torch.set_num_threads(state.threads)
    torch.set_float32_matmul_precision(state.matmul_precision)
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
