"""Sharded data: which samples each rank reads, on which device, from where after a resume.

- :mod:`~ddpctx.data.sampling`: the shard of each epoch's order, and a resumable position.
- :mod:`~ddpctx.data.loader`: the DataLoader ``ctx.dataloader`` returns (device, position, seeds).
- :mod:`~ddpctx.data.dataloader`: building it; the epoch loop.
- :mod:`~ddpctx.data.faces`: ``ctx.dataloader`` and ``ctx.epochs``.

May import: :mod:`ddpctx.utils`.
"""
