"""How the model is made parallel: DDP wrapping and gradient accumulation.

- :mod:`~ddpctx.parallel.wrapping`: the bare module inside DDP / ``torch.compile`` wrappers.
- :mod:`~ddpctx.parallel.accumulate`: skip DDP's all-reduce on all but the last micro-batch.
- :mod:`~ddpctx.parallel.faces`: ``ctx.wrap``, ``ctx.unwrap``, ``ctx.no_sync``, ``ctx.accumulate``.

May import: :mod:`ddpctx.utils`, :mod:`ddpctx.data` (a loader's position drives accumulation).
"""
