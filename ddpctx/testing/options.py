"""Reading ``@pytest.mark.distributed(...)``: world sizes, timeout, isolated, init.

Pure: no torch, no processes. A bad marker is reported as one line on the test
that carries it (:class:`MarkerError`), not as a collection error of the whole
module.

Example:
    >>> import pytest
    >>> options = read(pytest.mark.distributed(2, timeout=5).mark)
    >>> (options.world_sizes, options.timeout, options.isolated, options.init)
    (2, 5.0, False, True)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pytest

MARKER = "distributed"
DEFAULT_WORLD_SIZE = 2
DEFAULT_TIMEOUT_S = 60.0
OPTIONS = ("world_size", "timeout", "isolated", "init")


class MarkerError(ValueError):
    """A ``@pytest.mark.distributed`` that cannot be run; the message says how to fix it."""


@dataclass(frozen=True)
class Options:
    #: An int, or a list of ints and ``pytest.param(int, ...)`` (one test per entry).
    world_sizes: int | list[Any]
    timeout: float
    isolated: bool
    init: bool


def read(marker: pytest.Mark) -> Options:
    """The marker's options, checked; raises :class:`MarkerError`."""
    usage = f"e.g. @pytest.mark.{MARKER}(world_size=2, timeout=60)"
    if len(marker.args) > 1 or (marker.args and "world_size" in marker.kwargs):
        raise MarkerError(
            f"@pytest.mark.{MARKER} takes one positional argument, the world size; "
            f"got {marker.args!r} and {marker.kwargs!r}, {usage}."
        )
    unknown = sorted(set(marker.kwargs) - set(OPTIONS))
    if unknown:
        raise MarkerError(
            f"@pytest.mark.{MARKER} got unknown option(s) {unknown}; it takes "
            f"{', '.join(OPTIONS)}, {usage}."
        )
    sizes = marker.args[0] if marker.args else marker.kwargs.get("world_size", DEFAULT_WORLD_SIZE)
    if isinstance(sizes, tuple):
        sizes = list(sizes)
    for size in sizes if isinstance(sizes, list) else [sizes]:
        value = size_of(size)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MarkerError(
                f"@pytest.mark.{MARKER}(world_size={sizes!r}): each size must be a positive int "
                "(or pytest.param of one), e.g. world_size=2 or "
                "world_size=[1, 2, pytest.param(4, marks=pytest.mark.slow)]."
            )
    timeout = marker.kwargs.get("timeout", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise MarkerError(
            f"@pytest.mark.{MARKER}(timeout={timeout!r}) must be a positive number of seconds, "
            "e.g. timeout=60."
        )
    flags = {name: marker.kwargs.get(name, name == "init") for name in ("isolated", "init")}
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise MarkerError(f"@pytest.mark.{MARKER}({name}={flag!r}) must be True or False.")
    return Options(sizes, float(timeout), flags["isolated"], flags["init"])


def size_of(entry: Any) -> Any:
    """The world size in a list entry: the int itself, or the one value of a ``pytest.param``."""
    values = getattr(entry, "values", None)
    if isinstance(values, tuple) and hasattr(entry, "marks"):
        return values[0] if len(values) == 1 else values
    return entry


def parameters(sizes: list[Any]) -> list[Any]:
    """``pytest.param`` per world size, id ``ws<N>`` unless the entry names its own."""
    params = []
    for entry in sizes:
        size = size_of(entry)
        marks = getattr(entry, "marks", ())
        own_id = getattr(entry, "id", None)
        params.append(pytest.param(size, marks=marks, id=own_id or f"ws{size}"))
    return params


#: Seconds pytest-timeout's timer is moved back for a test that starts ranks, on an idle
#: machine: time to collect every rank's stack and stop them (:func:`report_grace`).
REPORT_GRACE_S = 15.0
#: The most :data:`REPORT_GRACE_S` is stretched on a loaded machine.
MAX_GRACE_STRETCH = 6.0


def report_grace() -> float:
    """:data:`REPORT_GRACE_S`, stretched by the load per core now (1 to 6x).

    Stopping ranks ends in the kernel tearing down their processes, which on an
    oversubscribed machine took past 15 s (four busy loops and two test
    workers on 2 cores): pytest-timeout then fired while the plugin was
    stopping the ranks, and the failure showed the plugin's frames instead of
    the ranks' stacks. The ranks' own limit is not stretched; only the backstop.

    >>> REPORT_GRACE_S <= report_grace() <= REPORT_GRACE_S * MAX_GRACE_STRETCH
    True
    """
    load_per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return REPORT_GRACE_S * min(MAX_GRACE_STRETCH, max(1.0, load_per_core))
