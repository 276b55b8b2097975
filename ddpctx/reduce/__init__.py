"""The reduction engine: nested metrics reduced in as few collectives as the dtypes allow.

- :mod:`~ddpctx.reduce.tree`: a metric result as a flat list of leaves, and back.
- :mod:`~ddpctx.reduce.wire`: one buffer and one collective for leaves that share an op.
- :mod:`~ddpctx.reduce.packing`: a result's plan: which leaves travel in which wire.
- :mod:`~ddpctx.reduce.collectives`: the protocol (agree on a structure once, then one
  payload collective per call), broadcast and gather of objects.
- :mod:`~ddpctx.reduce.faces`: ``ctx.all_reduce`` & co. on the context.

May import: :mod:`ddpctx.utils`. Knows nothing of the session.
"""
