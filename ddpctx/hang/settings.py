"""The hang doctor's options: ``hang_timeout``, ``on_hang`` and ``debug``, checked and resolved.

Pure: reads the values passed and the environment (``DDPCTX_HANG_TIMEOUT``,
``DDPCTX_DEBUG``), touches nothing else. A bad value is a ``ValueError`` that
names it and suggests a value that is accepted.

Layering: below :mod:`ddpctx.hang.watchdog`, which runs what these settings
describe, and :mod:`ddpctx.session.context`, which resolves them on entering
``distributed()``.

Example:
    >>> settings = resolve_hang_settings(None, "report", False, 600.0, {})
    >>> settings.hang_timeout, settings.on_hang, settings.debug
    (120.0, 'report', False)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: The longest default ``hang_timeout``, in seconds.
MAX_DEFAULT_HANG_TIMEOUT_S = 300.0
#: The shortest ``hang_timeout`` accepted (0 turns the doctor off): one watchdog tick.
MIN_HANG_TIMEOUT_S = 1.0
ON_HANG = ("report", "raise")


@dataclass(frozen=True)
class HangSettings:
    """The resolved options: ``hang_timeout`` seconds (0: off), ``on_hang``, ``debug``."""

    hang_timeout: float
    on_hang: str
    debug: bool

    @property
    def active(self) -> bool:
        return self.hang_timeout > 0 or self.debug


def resolve_hang_settings(
    hang_timeout: object,
    on_hang: object,
    debug: object,
    collective_timeout_s: float,
    environ: Mapping[str, str],
) -> HangSettings:
    """Check and resolve the hang doctor's options; no side effects.

    >>> environ = {"DDPCTX_HANG_TIMEOUT": "5"}
    >>> resolve_hang_settings(None, "raise", False, 600.0, environ).hang_timeout
    5.0
    >>> resolve_hang_settings(None, "report", False, 3600.0, {}).hang_timeout
    300.0
    """
    if on_hang not in ON_HANG:
        raise ValueError(
            f"on_hang={on_hang!r} is not an option; pass on_hang='report' (print the report, "
            "keep waiting) or on_hang='raise' (every rank raises HangError)."
        )
    if not isinstance(debug, bool):
        raise ValueError(f"debug={debug!r} must be True or False.")
    seconds, name = _hang_seconds(hang_timeout, collective_timeout_s, environ)
    if 0 < seconds < MIN_HANG_TIMEOUT_S:
        raise ValueError(
            f"{name}={seconds:g} s is below the hang doctor's floor of "
            f"{MIN_HANG_TIMEOUT_S:g} s (its thread wakes once a second, so a shorter wait "
            f"cannot be told from healthy work). {_fix(name, collective_timeout_s)}"
        )
    if seconds >= collective_timeout_s:
        raise ValueError(
            f"{name}={seconds:g} s is not below the collective timeout of "
            f"{collective_timeout_s:g} s, so the report would come after the job failed. "
            f"{_fix(name, collective_timeout_s)}"
        )
    return HangSettings(seconds, str(on_hang), debug or _debug_from_env(environ))


def _fix(name: str, collective_timeout_s: float) -> str:
    """What to set instead of a refused hang timeout: only values that are accepted."""
    suggestion = _default_hang_seconds(collective_timeout_s)
    if suggestion:
        return (
            f"Set {name}={suggestion:g} (from {MIN_HANG_TIMEOUT_S:g} s up to below the "
            f"collective timeout of {collective_timeout_s:g} s), or {name}=0 to turn the "
            "hang doctor off."
        )
    return (
        f"The collective timeout of {collective_timeout_s:g} s leaves no room above the floor "
        f"of {MIN_HANG_TIMEOUT_S:g} s: set {name}=0 to turn the hang doctor off, or a "
        f"timeout above {MIN_HANG_TIMEOUT_S:g} s."
    )


def _default_hang_seconds(collective_timeout_s: float) -> float:
    """A fifth of the collective timeout, at most 300 s, never below the floor.

    A collective timeout too short for even the floor (``launch(timeout=1)``)
    leaves the doctor off by default: its report could not come before the
    job fails.

    >>> _default_hang_seconds(2.0), _default_hang_seconds(1.0), _default_hang_seconds(60.0)
    (1.0, 0.0, 12.0)
    """
    seconds = min(collective_timeout_s / 5, MAX_DEFAULT_HANG_TIMEOUT_S)
    if seconds >= MIN_HANG_TIMEOUT_S:
        return seconds
    return MIN_HANG_TIMEOUT_S if collective_timeout_s > MIN_HANG_TIMEOUT_S else 0.0


def _hang_seconds(
    value: object, collective_timeout_s: float, environ: Mapping[str, str]
) -> tuple[float, str]:
    """``(seconds, the name it came from)``: ``hang_timeout`` or ``DDPCTX_HANG_TIMEOUT``."""
    if value is None:
        raw = environ.get("DDPCTX_HANG_TIMEOUT", "").strip()
        if raw == "":
            return _default_hang_seconds(collective_timeout_s), "hang_timeout"
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if not 0 <= seconds < float("inf"):
            raise ValueError(
                f"DDPCTX_HANG_TIMEOUT={raw!r} is not a number of seconds >= 0. "
                f"{_fix('DDPCTX_HANG_TIMEOUT', collective_timeout_s)} Or unset it for the default."
            )
        return seconds, "DDPCTX_HANG_TIMEOUT"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(
            f"hang_timeout={value!r} must be a number of seconds >= 0. "
            f"{_fix('hang_timeout', collective_timeout_s)}"
        )
    return float(value), "hang_timeout"


def _debug_from_env(environ: Mapping[str, str]) -> bool:
    raw = environ.get("DDPCTX_DEBUG", "").strip()
    if raw in ("", "0"):
        return False
    if raw == "collectives":
        return True
    raise ValueError(
        f"DDPCTX_DEBUG={raw!r} is not a debug mode; set DDPCTX_DEBUG=collectives, or unset it."
    )
