"""``@rank_zero_only``, ``@all_reduced`` and ``rank_zero_first``.

Both decorators work bare or with options, keep the wrapped function's name,
docstring, ``__wrapped__`` and (through ``ParamSpec``) its signature for type
checkers, and work in three situations: inside ``distributed()``, under a
process group someone else initialised, and with no process group at all
(then the rank comes from ``RANK``, else 0, and the world size is 1).

The guarantees that make them safe to use around collectives:

- ``@rank_zero_only(barrier=True)`` / ``(broadcast=True)`` and
  ``rank_zero_first``: if rank 0 raises, every rank raises (rank 0 its own
  exception, the others :class:`~ddpctx.RankZeroError` with rank 0's
  traceback) instead of waiting at a barrier until the timeout.
- ``@all_reduced``: one collective for all mean/sum leaves; different
  structures on different ranks, or an exception on one rank, become an
  error on every rank, never wrong numbers and never a hang.

Example:
    >>> @rank_zero_only
    ... def log(message: str) -> None:
    ...     print(message)
    >>> log("only rank 0 prints this")
    only rank 0 prints this
    >>> @all_reduced(weight="count")
    ... def evaluate() -> dict[str, float]:
    ...     return {"loss": 0.25, "count": 8}
    >>> evaluate()
    {'loss': 0.25, 'count': 8}
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, Literal, ParamSpec, TypeVar, overload

from ddpctx.rankzero.outcome import on_rank_zero, zero_first
from ddpctx.reduce.collectives import (
    Site,
    all_reduce_tree,
    check_op,
    failed_reduction,
    report_failure,
)
from ddpctx.reduce.guard import check_caller, running_alone
from ddpctx.reduce.handles import Reduction
from ddpctx.reduce.packing import OpSpec
from ddpctx.utils.identity import whoami

P = ParamSpec("P")
R = TypeVar("R")
D = TypeVar("D")


@overload
def rank_zero_only(fn: Callable[P, R], /) -> Callable[P, R | None]: ...


@overload
def rank_zero_only(
    *,
    default: None = None,
    barrier: bool = False,
    broadcast: Literal[False] = False,
    local: bool = False,
) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...


@overload
def rank_zero_only(
    *,
    default: D,
    barrier: bool = False,
    broadcast: Literal[False] = False,
    local: bool = False,
) -> Callable[[Callable[P, R]], Callable[P, R | D]]: ...


@overload
def rank_zero_only(
    *,
    default: Any = None,
    barrier: bool = False,
    broadcast: Literal[True],
    local: bool = False,
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


def rank_zero_only(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    default: Any = None,
    barrier: bool = False,
    broadcast: bool = False,
    local: bool = False,
) -> Any:
    """Run the function on rank 0 only; the other ranks get ``default``.

    Args:
        default: what the other ranks return.
        barrier: every rank waits until rank 0 is done (e.g. a checkpoint write).
        broadcast: every rank returns rank 0's result (implies the wait).
        local: "rank 0" means local rank 0 of each node (per-node caches).

    With ``barrier`` or ``broadcast``, an exception on rank 0 is raised on
    every rank: rank 0 re-raises its own, the others raise
    :class:`~ddpctx.RankZeroError` carrying rank 0's traceback. A generator or
    ``async`` function cannot take ``barrier`` or ``broadcast`` (a ``TypeError`` when
    decorating): its body would run when consumed, after the others stopped waiting.
    Collectives inside the function are refused (only rank 0 runs it).

    Example:
        >>> @rank_zero_only(broadcast=True)
        ... def pick_run_name() -> str:
        ...     return "run-42"
        >>> pick_run_name()
        'run-42'
    """

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        what = f"rank_zero_only function {getattr(func, '__qualname__', func)!r}"
        option = "broadcast=True" if broadcast else "barrier=True"
        if barrier or broadcast:
            _refuse_lazy_bodies(func, option, _lazy_kind(func))

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            place = whoami()
            mine = place.is_zero(local)
            if not (barrier or broadcast):
                if not mine:
                    return default
                with running_alone("function", what):  # no collective may start in here
                    return func(*args, **kwargs)
            ran, value = on_rank_zero(
                place,
                lambda: _finished(func(*args, **kwargs), func, option),
                broadcast=broadcast,
                local=local,
                what=what,
            )
            return value if ran or broadcast else default

        return wrapper

    return decorate(fn) if fn is not None else decorate


def _lazy_kind(func: Any) -> str | None:
    """What kind of lazy body ``func`` has, if it is a generator or coroutine function."""
    if inspect.isasyncgenfunction(func):
        return "an async generator function"
    if inspect.isgeneratorfunction(func):
        return "a generator function"
    if inspect.iscoroutinefunction(func):
        return "an async function"
    return None


def _finished(value: Any, func: Callable[..., Any], option: str) -> Any:
    """Rank 0's result, refused if it is a body still to run (a function that returns a
    generator or coroutine without being one: a callable object, another decorator)."""
    kind = (
        "an async generator"
        if inspect.isasyncgen(value)
        else "a generator"
        if inspect.isgenerator(value)
        else "a coroutine"
        if inspect.iscoroutine(value)
        else None
    )
    if kind is not None:
        value.close()  # never run: no "coroutine was never awaited" warning
        _refuse_lazy_bodies(func, option, f"a function that returned {kind}")
    return value


def _refuse_lazy_bodies(func: Callable[..., Any], option: str, kind: str | None) -> None:
    """A generator or coroutine function's body runs after the call returns, when it is
    consumed: the others would stop waiting before rank 0's body ran, and its exception
    would reach rank 0 only. Refused when decorating (or, for a callable that only returns
    one, at rank 0's call, which reaches every rank), before any rank can be misled."""
    if kind is None:
        return
    name = getattr(func, "__qualname__", repr(func))
    fix = (
        "`return list(...)` of what it yields"
        if "generator" in kind and "async" not in kind
        else "`asyncio.run(...)` of it (or run it to completion in your event loop first)"
    )
    raise TypeError(
        f"rank_zero_only({option}) cannot wrap {name}: it is {kind}, whose body runs "
        "only when the result is consumed -- after the other ranks stopped waiting, and "
        "an exception there would reach rank 0 alone. Decorate a plain function that "
        f"finishes the work instead, e.g. one that does {fix}."
    )


@overload
def all_reduced(fn: Callable[P, R], /) -> Callable[P, R]: ...


@overload
def all_reduced(
    *, op: OpSpec = "mean", weight: str | None = None, async_op: Literal[False] = False
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


@overload
def all_reduced(
    *, op: OpSpec = "mean", weight: str | None = None, async_op: Literal[True]
) -> Callable[[Callable[P, R]], Callable[P, Reduction[R]]]: ...


def all_reduced(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    op: OpSpec = "mean",
    weight: str | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce the function's result across ranks; every rank gets the reduced value.

    The result may be a number, a tensor, a NumPy scalar or array, or a nested
    dict / list / tuple / namedtuple of them; it comes back in the same
    structure with the same leaf kinds (an int under "mean" becomes a float,
    a tensor stays a tensor on its device).

    Args:
        op: "mean" (default), "sum", "max", "min", "prod", or a dict mapping
            result keys to ops (unnamed leaves use "mean").
        weight: the name of a count leaf (e.g. ``"count"``): counts are
            summed and each "mean" leaf becomes the count-weighted mean over
            ranks; a rank whose count is 0 contributes nothing (not the NaN
            of its empty batch's mean); a total count of 0 gives NaN, never
            0; a negative one is an error on every rank.

        async_op: return a :class:`~ddpctx.reduce.handles.Reduction` handle at once;
            ``.result()`` gives the value (or raises what the synchronous call
            would have raised), so logging can overlap the next step.

    Large float32/float64 leaves travel in their own dtype, other floats as float64,
    integers exactly (see :mod:`ddpctx.reduce.packing`): one collective for a dict of
    floats and counts,
    one more per further float dtype and per "max"/"min"/"prod". With a
    per-key ``op``, the innermost named key wins: ``op={"val": "max",
    "loss": "mean"}`` makes ``val.loss`` a mean and ``val.peak`` a max.

    Example:
        >>> @all_reduced(op={"loss": "mean", "peak_mb": "max"})
        ... def step_stats() -> dict[str, float]:
        ...     return {"loss": 1.5, "peak_mb": 812.0}
        >>> step_stats()
        {'loss': 1.5, 'peak_mb': 812.0}
    """
    check_op(op)
    if weight is not None and not isinstance(weight, str):
        raise ValueError(f"weight={weight!r} must be the name of a leaf, e.g. weight='count'.")

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        name = f"all_reduced({func.__module__}.{func.__qualname__})"
        site = Site(name, label=name)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            check_caller(name)  # before the body: a worker or a thread must not run it
            try:
                result = func(*args, **kwargs)
            except BaseException as error:  # Ctrl-C and sys.exit() too
                if async_op and isinstance(error, Exception):  # raised at .result()
                    return failed_reduction(error, site)
                report_failure(error, site)  # the other ranks raise instead of waiting
                raise
            return all_reduce_tree(result, op, weight, site=site, async_op=async_op)

        return wrapper

    return decorate(fn) if fn is not None else decorate


@contextlib.contextmanager
def rank_zero_first(local: bool = False) -> Iterator[None]:
    """Rank 0 (each node's local rank 0 with ``local=True``) runs the block first, then the rest.

    For downloads and caches: the first rank fills the cache, the others then
    read it. If rank 0 raises in the block, every other rank raises
    :class:`~ddpctx.RankZeroError` instead of waiting.

    Example:
        >>> with rank_zero_first():
        ...     print("preparing the dataset")
        preparing the dataset
    """
    with zero_first(whoami(), local):
        yield
