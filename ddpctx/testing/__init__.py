"""pytest support for distributed code: test it on a laptop, with real ranks and real gloo.

Installing ddpctx registers the plugin (:mod:`ddpctx.testing.plugin`) through
the ``pytest11`` entry point; nothing needs to be configured (it needs pytest
itself: ``pip install "ddpctx[pytest]"``). It gives a marker, three fixtures
(``dist_ctx``, ``dist_world_size``, ``run_distributed``, below) and works with
pytest's own command-line options.

Example (a test file)::

    import pytest, torch, torch.distributed as dist

    @pytest.mark.distributed(world_size=2)
    def test_all_reduce_sums(dist_ctx):
        value = torch.tensor([float(dist_ctx.rank)])
        dist.all_reduce(value)
        assert value.item() == 1.0

    def test_ranks(run_distributed):
        assert run_distributed(lambda: 1, world_size=3) == [1, 1, 1]

The marker, ``@pytest.mark.distributed(world_size=2, timeout=60, isolated=False,
init=True)``, runs the test body on every rank inside ``distributed()``; the
world size may also be given positionally (``@pytest.mark.distributed(4)``), and
on a class the marker applies to each of its tests. Its options:

- ``world_size``: an int, or a list of ints and ``pytest.param`` entries, e.g.
  ``[1, 2, pytest.param(4, marks=pytest.mark.slow)]``: one test per entry,
  ids ``[ws1]``, ``[ws2]``, ... unless the ``pytest.param`` gives its own.
- ``timeout``: seconds, 60 by default. Past it the test fails with every
  rank's Python stack and the session goes on. Under pytest-timeout a
  shorter ``@pytest.mark.timeout`` or ``--timeout`` wins, and the ranks'
  stacks are still reported.
- ``isolated``: ``True`` gives the test fresh rank processes instead of the
  warm pool, for tests that change what a warm rank cannot restore (module
  globals, imported modules, threads, other torch settings).
- ``init``: ``False`` forms no process group and enters no ``distributed()``:
  each rank gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``,
  so the code under test forms its own group; ``dist_ctx`` is then None.

Each test runs in the pytest process's world as the test starts: fixtures'
values (pickled; a test using one that does not pickle, such as ``request``,
gets freshly forked ranks), the environment (``monkeypatch.setenv`` included)
and the working directory travel to the ranks. A warm rank restores
``os.environ``, the working directory, ``sys.path``, torch's global switches
(default dtype and device, grad mode, anomaly detection, thread count, matmul
precision, the deterministic, cuDNN and TF32 flags) and the states of
``random``, NumPy and torch after every test. ``capsys`` / ``capfd`` record what that rank prints;
``pytest.skip`` in a rank skips the test; ``async def`` tests run on a new
event loop in each rank.

A failure is one pytest failure: the failing rank's own traceback first, then
pytest's rewritten assertion message with the rank named, the other ranks'
follow-on errors summarised, and every rank's output as a report section
(for ranks still running when another failed: what they had printed by then).

Command-line options: the plugin adds none of its own; pytest's apply.

- ``-s``: each rank's output is streamed live, every line prefixed ``[rank N]``.
- ``-rP``: each rank's output is shown for passing tests too (failing tests
  always show it).
- ``--timeout N`` (pytest-timeout): bounds the marker's ``timeout``, see above.
- ``-n N`` (pytest-xdist): each xdist worker keeps its own rank pools; a
  pool's ranks meet through a store on a port of 127.0.0.1 that the system
  picks for it, so pools never clash.

For maintainers: the plugin's modules.

- :mod:`~ddpctx.testing.plugin`: the hooks, the marker's test call and the fixtures.
- :mod:`~ddpctx.testing.options`: reading ``@pytest.mark.distributed(...)``.
- :mod:`~ddpctx.testing.pools`: the warm rank pools, stopped when pytest is told to stop.
- :mod:`~ddpctx.testing.rankside`: what runs inside each rank: the body, its coroutine, capsys.

May import: :mod:`ddpctx.utils`, :mod:`ddpctx.session`, :mod:`ddpctx.launching`
(and nothing at all at import time: pytest loads the plugin in every run,
so importing it must not import torch).
"""
