"""The pytest plugin: ``@pytest.mark.distributed``, ``dist_ctx``, ``run_distributed``.

Ranks come from warm pools of worker processes (:class:`ddpctx.launcher.RankPool`),
one pool per world size, kept for the whole session; every test gets a fresh
process group. Workers are forked from the pytest process after collection,
with torch already imported, so they hold the same test modules -- with
pytest's rewritten asserts -- and the test function needs only to be named,
not re-imported. A pool that a failure or a hang may have spoiled is killed
and replaced by the next test that needs one.

A failing rank becomes one pytest failure: the original exception (so
``assert 1 == 0`` reads as pytest wrote it), caused by that rank's remote
traceback, with a note naming the rank, the other ranks' follow-on errors,
and each rank's captured output as report sections. A hang past the timeout
fails that test alone, with every rank's Python stack. ``pytest.skip`` inside
a rank skips the test. Under pytest-xdist each xdist worker has its own pools;
rendezvous goes through files, so there are no ports to clash.

This module imports neither torch nor ddpctx's torch-using modules at import
time: pytest loads it in every session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from ddpctx.launcher import RankPool

MARKER = "distributed"
_WORLD_SIZE_PARAM = "_ddpctx_world_size"
DEFAULT_WORLD_SIZE = 2
DEFAULT_TIMEOUT_S = 60.0


class _Pools:
    """One warm :class:`~ddpctx.launch.RankPool` per world size."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def run(
        self,
        world_size: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> list[Any]:
        import pickle

        import torch  # noqa: F401 -- imported before forking, so workers start warm

        from ddpctx.launcher import RankPool
        from ddpctx.worker import Task

        try:
            pickle.dumps((fn, args, kwargs))
        except Exception:  # a closure or lambda: fork fresh ranks with it in memory
            with RankPool(world_size, first=Task(fn, args, kwargs, None, timeout, "")) as pool:
                return pool.run(fn, args, kwargs, timeout=timeout)
        if world_size not in self._pools or not self._pools[world_size].healthy:
            self._pools[world_size] = RankPool(world_size)
        return self._pools[world_size].run(fn, args, kwargs, timeout=timeout)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


_pools_key = pytest.StashKey[_Pools]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(world_size=2, timeout=60): run the test body on every rank inside "
        "ddpctx.distributed(); world_size may be a list (one test per size).",
    )
    config.stash[_pools_key] = _Pools()


def pytest_unconfigure(config: pytest.Config) -> None:
    pools = config.stash.get(_pools_key, None)
    if pools is not None:
        pools.close()


def _options(marker: pytest.Mark) -> tuple[int | list[int], float]:
    if marker.args:
        raise pytest.UsageError(
            f"@pytest.mark.{MARKER} takes keywords only, e.g. "
            f"@pytest.mark.{MARKER}(world_size=2, timeout=60); got {marker.args!r}."
        )
    unknown = set(marker.kwargs) - {"world_size", "timeout"}
    if unknown:
        raise pytest.UsageError(
            f"@pytest.mark.{MARKER} got unknown option(s) {sorted(unknown)}; "
            "it takes world_size and timeout."
        )
    sizes = marker.kwargs.get("world_size", DEFAULT_WORLD_SIZE)
    timeout = marker.kwargs.get("timeout", DEFAULT_TIMEOUT_S)
    for size in sizes if isinstance(sizes, (list, tuple)) else [sizes]:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise pytest.UsageError(
                f"@pytest.mark.{MARKER}(world_size={sizes!r}): each size must be a positive "
                "int, e.g. world_size=2 or world_size=[1, 2, 4]."
            )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise pytest.UsageError(
            f"@pytest.mark.{MARKER}(timeout={timeout!r}) must be a positive number of seconds, "
            "e.g. timeout=60."
        )
    return (list(sizes) if isinstance(sizes, (list, tuple)) else sizes), float(timeout)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None:
        return
    sizes, _ = _options(marker)
    if isinstance(sizes, list):
        metafunc.fixturenames.append(_WORLD_SIZE_PARAM)
        metafunc.parametrize(_WORLD_SIZE_PARAM, sizes, ids=[f"ws{size}" for size in sizes])


@pytest.fixture
def _ddpctx_world_size(request: pytest.FixtureRequest) -> int:
    """The world size of a test marked with a list of sizes (set by parametrization)."""
    size: int = request.param
    return size


@pytest.fixture
def dist_ctx(request: pytest.FixtureRequest) -> Any:
    """The rank's :class:`~ddpctx.DistContext`, in a test marked ``@pytest.mark.distributed``.

    (In the pytest process itself this is a placeholder; each rank receives
    its own context.)
    """
    if request.node.get_closest_marker(MARKER) is None:
        raise pytest.UsageError(
            f"the dist_ctx fixture only works in tests marked @pytest.mark.{MARKER}; "
            "add the marker, or use the run_distributed fixture."
        )
    return _RANK_CONTEXT


_RANK_CONTEXT = "<the rank's DistContext>"


@pytest.fixture
def run_distributed(request: pytest.FixtureRequest) -> Callable[..., list[Any]]:
    """``run_distributed(fn, *args, world_size=2, timeout=60, **kwargs)`` -> per-rank results.

    ``fn`` runs on every rank inside ``distributed()``; a failure raises
    :class:`ddpctx.RankError` naming the rank, chained from its exception.
    """
    pools = request.config.stash[_pools_key]

    def run(
        fn: Callable[..., Any],
        *args: Any,
        world_size: int = DEFAULT_WORLD_SIZE,
        timeout: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> list[Any]:
        from ddpctx.launcher import RankError, RemoteTraceback

        try:
            return pools.run(world_size, fn, args, kwargs, timeout)
        except RankError as error:
            if error.original is not None:
                error.original.__cause__ = RemoteTraceback(error.remote_traceback)
                raise error from error.original
            raise

    return run


def _call_test_body(test: Callable[..., Any], funcargs: dict[str, Any], wants_ctx: bool) -> None:
    """Runs on each rank, inside distributed()."""
    from ddpctx.context import current

    if wants_ctx:
        funcargs = {**funcargs, "dist_ctx": current()}
    test(**funcargs)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker(MARKER)
    if marker is None:
        return None
    __tracebackhide__ = True  # reports show the rank's traceback, not this hook's frame
    sizes, timeout = _options(marker)
    world_size = pyfuncitem.callspec.params[_WORLD_SIZE_PARAM] if isinstance(sizes, list) else sizes
    assert isinstance(world_size, int)
    names = pyfuncitem._fixtureinfo.argnames  # the test's own parameters
    funcargs = {
        name: pyfuncitem.funcargs[name]
        for name in names
        if name not in ("dist_ctx", _WORLD_SIZE_PARAM)
    }
    wants_ctx = "dist_ctx" in names
    pools = pyfuncitem.config.stash[_pools_key]

    from ddpctx.launcher import RankError, RankSkipped, RankTimeoutError, RemoteTraceback, summary

    try:
        pools.run(world_size, _call_test_body, (pyfuncitem.obj, funcargs, wants_ctx), {}, timeout)
    except RankError as caught:
        error = caught
    else:
        return True
    for rank, (out, err) in enumerate(error.outputs):
        for text, stream in ((out, "stdout"), (err, "stderr")):
            if text:
                pyfuncitem.add_report_section("call", f"rank {rank} {stream}", text)
    if isinstance(error, RankSkipped):
        pytest.skip(f"rank {error.rank}: {error}")
    if isinstance(error, RankTimeoutError) or error.original is None:
        pytest.fail(str(error), pytrace=False)
    original = error.original
    where = f"raised on rank {error.rank} of {world_size}"
    if error.secondary:
        where += "; then: " + "; ".join(f"rank {r}: {summary(t)}" for r, t in error.secondary)
    if hasattr(original, "add_note"):
        original.add_note(f"({where})")
    raise original from RemoteTraceback(f"{where}\n\n{error.remote_traceback}")
