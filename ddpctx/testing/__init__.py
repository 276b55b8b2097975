"""pytest support for distributed code: test it on a laptop, with real ranks and real gloo.

Installing ddpctx registers the plugin (:mod:`ddpctx.testing.plugin`) through
the ``pytest11`` entry point; nothing needs to be configured. It gives:

- ``@pytest.mark.distributed(world_size=2, timeout=60)``: the test body runs on
  every rank inside ``distributed()``; the ``dist_ctx`` fixture is the
  rank's :class:`~ddpctx.DistContext`. ``world_size=[1, 2, 4]`` makes one
  test per size (ids ``[ws1]``, ``[ws2]``, ``[ws4]``).
- the ``run_distributed(fn, *args, world_size=2, timeout=60, **kwargs)``
  fixture, returning the per-rank results.

Example (a test file)::

    import pytest, torch, torch.distributed as dist

    @pytest.mark.distributed(world_size=2)
    def test_all_reduce_sums(dist_ctx):
        value = torch.tensor([float(dist_ctx.rank)])
        dist.all_reduce(value)
        assert value.item() == 1.0

May import: :mod:`ddpctx.utils`, :mod:`ddpctx.session`, :mod:`ddpctx.launching`
(and nothing at all at import time: pytest loads the plugin in every run,
so importing it must not import torch).
"""
