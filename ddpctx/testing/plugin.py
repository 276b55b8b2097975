"""The pytest plugin: ``@pytest.mark.distributed``, ``dist_ctx``, ``run_distributed``.

Ranks come from warm pools of worker processes (:mod:`ddpctx.testing.pools`),
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
each pool's store listens on a free loopback port the OS picks, so no two
clash.

Every test runs in the pytest process's world at the moment the body would
run: its environment (fixtures' ``monkeypatch.setenv`` included) and working
directory travel to the ranks with the test, and each rank puts its own back
afterwards, with ``sys.path``, torch's global switches and generator states
(:mod:`ddpctx.launching.taskstate`). SIGTERM to pytest stops the ranks and what
they started (:mod:`ddpctx.testing.pools`). ``isolated=True`` gives a test fresh rank
processes; ``init=False`` gives it the rendezvous variables instead of a
group. With ``-s`` the ranks' output is streamed live, each line prefixed
``[rank N]``; with ``-rP`` it is shown for passing tests too.

This module imports neither torch nor ddpctx's torch-using modules at import
time: pytest loads it in every session.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from ddpctx.testing.options import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_WORLD_SIZE,
    MARKER,
    MarkerError,
    Options,
    parameters,
    read,
    report_grace,
)
from ddpctx.testing.pools import Pools
from ddpctx.testing.rankside import (
    CAPTURE_FIXTURES,
    RANK_CAPTURE,
    RANK_CONTEXT,
    call_test_body,
)

WORLD_SIZE_FIXTURE = "dist_world_size"


_pools_key = pytest.StashKey[Pools]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(world_size=2, timeout=60, isolated=False, init=True): run the test body on "
        "every rank inside ddpctx.distributed(); world_size may be a list (one test per size).",
    )
    config.stash[_pools_key] = Pools()


def pytest_unconfigure(config: pytest.Config) -> None:
    pools = config.stash.get(_pools_key, None)
    if pools is not None:
        pools.close()


def _marker_options(item: pytest.Item) -> Options | None:
    """The options of the item's marker; a bad marker fails this test, in one line."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return None
    try:
        return read(marker)
    except MarkerError as error:
        problem = str(error)
    pytest.fail(problem, pytrace=False)  # outside the except: no chained traceback


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None:
        return
    try:
        options = read(marker)
    except MarkerError:
        return  # reported on the test itself, by _marker_options
    if isinstance(options.world_sizes, list):
        if WORLD_SIZE_FIXTURE not in metafunc.fixturenames:
            metafunc.fixturenames.append(WORLD_SIZE_FIXTURE)
        metafunc.parametrize(WORLD_SIZE_FIXTURE, parameters(options.world_sizes))


@pytest.fixture
def dist_world_size(request: pytest.FixtureRequest) -> int:
    """The world size this test runs with, in a test marked ``@pytest.mark.distributed``.

    With a list of sizes, one value per generated test. Other fixtures can
    depend on it, e.g. to size data per rank::

        @pytest.fixture
        def shards(dist_world_size):
            return list(range(dist_world_size))

        @pytest.mark.distributed(world_size=[1, 2])
        def test_shards(dist_ctx, dist_world_size, shards):
            assert len(shards) == dist_world_size == dist_ctx.world_size
    """
    options = _marker_options(request.node)
    if options is None:
        raise pytest.UsageError(
            f"the {WORLD_SIZE_FIXTURE} fixture only works in tests marked "
            f"@pytest.mark.{MARKER}; add the marker."
        )
    assert isinstance(options.world_sizes, int)  # a list is parametrised instead
    return options.world_sizes


@pytest.fixture
def dist_ctx(request: pytest.FixtureRequest) -> Any:
    """The rank's :class:`~ddpctx.DistContext`, in a test marked ``@pytest.mark.distributed``.

    Each rank receives its own context (in the pytest process itself this is
    a placeholder). With ``init=False`` it is None: there is no context.
    Using it in a test without the marker is a usage error. Example::

        @pytest.mark.distributed(world_size=2)
        def test_ranks(dist_ctx):
            assert dist_ctx.all_gather(dist_ctx.rank) == [0, 1]
    """
    if request.node.get_closest_marker(MARKER) is None:
        raise pytest.UsageError(
            f"the dist_ctx fixture only works in tests marked @pytest.mark.{MARKER}; "
            "add the marker, or use the run_distributed fixture."
        )
    return RANK_CONTEXT


@pytest.fixture
def run_distributed(request: pytest.FixtureRequest) -> Callable[..., list[Any]]:
    """``run_distributed(fn, *args, world_size=2, timeout=60, **kwargs)`` -> per-rank results.

    ``fn(*args, **kwargs)`` runs on every rank inside ``distributed()``, on
    the session's warm rank pool; the results come back in rank order.
    ``world_size`` is the number of ranks, ``timeout`` the seconds before the
    ranks' stacks are reported and the call fails. ``fn`` may be a lambda or
    a closure. A failure raises :class:`ddpctx.RankError` naming the rank,
    chained from its exception. Example::

        import ddpctx


        def test_each_rank_returns(run_distributed):
            ranks = run_distributed(lambda: ddpctx.current().rank, world_size=3)
            assert ranks == [0, 1, 2]
    """
    pools = request.config.stash[_pools_key]

    def run(
        fn: Callable[..., Any],
        *args: Any,
        world_size: int = DEFAULT_WORLD_SIZE,
        timeout: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> list[Any]:
        from ddpctx.launching.failures import RankError, RemoteTraceback

        try:
            return pools.run(world_size, fn, args, kwargs, _rank_timeout(request.node, timeout))[0]
        except RankError as error:
            if error.original is not None:
                error.original.__cause__ = RemoteTraceback(error.remote_traceback)
                raise error from error.original
            raise

    return run


def pytest_runtest_setup(item: pytest.Item) -> None:
    _marker_options(item)  # a bad marker fails here, before any fixture runs


def _rank_timeout(item: pytest.Item, timeout: float) -> float:
    """The ranks' timeout: the marker's (or the call's), or pytest-timeout's if shorter.

    pytest-timeout's own timer for the test is moved back by
    :func:`~ddpctx.testing.options.report_grace` (:func:`pytest_timeout_set_timer`), so the ranks
    stop at the shorter limit and the report with every rank's stack comes
    first; pytest-timeout stays the backstop.
    """
    marker = item.get_closest_marker("timeout")
    outer: Any = None
    if marker is not None:
        outer = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    if outer is None:
        outer = item.config.getoption("timeout", None)
    if outer is None:
        try:
            outer = item.config.getini("timeout")  # pytest-timeout's ini setting
        except ValueError:  # pytest-timeout is not installed
            outer = None
    try:
        outer = float(outer)
    except (TypeError, ValueError):
        return timeout
    if outer <= 0:
        return timeout
    return float(min(timeout, outer))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """pytest-timeout's hook: for a test that starts ranks, its timer fires later.

    It fires :func:`report_grace` later, while the ranks stop at the shorter
    limit (:func:`_rank_timeout`). Without it a short ``--timeout`` (6 s or
    less) interrupted this process while the ranks' stacks were being
    collected, and the failure showed the plugin's frames instead of the ranks'.
    """
    uses_ranks = item.get_closest_marker(MARKER) is not None or "run_distributed" in getattr(
        item, "fixturenames", ()
    )
    timeout_plugin = item.config.pluginmanager.getplugin("timeout")
    default = getattr(timeout_plugin, "pytest_timeout_set_timer", None)
    if not uses_ranks or default is None or not hasattr(settings, "_replace"):
        return None
    result: bool | None = default(
        item=item, settings=settings._replace(timeout=settings.timeout + report_grace())
    )
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    options = _marker_options(pyfuncitem)
    if options is None:
        return None
    __tracebackhide__ = True  # reports show the rank's traceback, not this hook's frame
    if isinstance(options.world_sizes, list):
        world_size = pyfuncitem.callspec.params[WORLD_SIZE_FIXTURE]
    else:
        world_size = options.world_sizes
    assert isinstance(world_size, int)
    test = pyfuncitem.obj
    if inspect.isasyncgenfunction(test):
        pytest.fail(
            f"{pyfuncitem.name} is an async generator function; a distributed test must be a "
            "function or an `async def` coroutine function.",
            pytrace=False,
        )
    funcargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    if "dist_ctx" in funcargs:
        funcargs["dist_ctx"] = RANK_CONTEXT
    for name in CAPTURE_FIXTURES:
        if name in funcargs:
            funcargs[name] = RANK_CAPTURE
    pools = pyfuncitem.config.stash[_pools_key]
    echo = pyfuncitem.config.getoption("capture", "fd") == "no"

    from ddpctx.launching.failures import (
        RankError,
        RankSkipped,
        RankTimeoutError,
        RemoteTraceback,
        summary,
    )

    try:
        _, outputs = pools.run(
            world_size,
            call_test_body,
            (test, funcargs),
            {},
            _rank_timeout(pyfuncitem, options.timeout),
            isolated=options.isolated,
            init=options.init,
            echo=echo,
        )
    except RankError as caught:
        error = caught
    else:
        if not echo:
            _add_output_sections(pyfuncitem, outputs)
        return True
    if not echo:
        _add_output_sections(pyfuncitem, error.outputs)
    if isinstance(error, RankSkipped):
        raise pytest.skip.Exception(f"rank {error.rank}: {error}", _use_item_location=True)
    if isinstance(error, RankTimeoutError) or error.original is None:
        pytest.fail(str(error), pytrace=False)
    original = error.original
    # The user's traceback comes first; the other ranks' follow-on errors (often
    # gloo's "Connection closed by peer") last, one summarised line each.
    where = f"raised on rank {error.rank} of {world_size}"
    if error.secondary:
        where += "; then, as a consequence: " + "; ".join(
            f"rank {r}: {summary(t)}" for r, t in error.secondary
        )
    if error.hint:
        where += f". {error.hint}"
    if hasattr(original, "add_note"):
        original.add_note(f"({where})")
    raise original from RemoteTraceback(f"{error.remote_traceback.rstrip()}\n\n({where})")


def _add_output_sections(item: pytest.Item, outputs: list[tuple[str, str]]) -> None:
    """Each rank's output as report sections (shown on failure, and with ``-rP``)."""
    for rank, (out, err) in enumerate(outputs):
        for text, stream in ((out, "stdout"), (err, "stderr")):
            if text:
                item.add_report_section("call", f"rank {rank} {stream}", text)
