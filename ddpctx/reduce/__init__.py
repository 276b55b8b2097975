"""The reduction engine: nested metrics reduced in as few collectives as the dtypes allow.

- :mod:`~ddpctx.reduce.tree`: a metric result as a flat list of leaves, and back.
- :mod:`~ddpctx.reduce.wire`: one buffer and one collective for leaves that share an op.
- :mod:`~ddpctx.reduce.values`: one leaf's values on their way onto a wire and back.
- :mod:`~ddpctx.reduce.packing`: a result's plan: which leaves travel in which wire.
- :mod:`~ddpctx.reduce.collectives`: the protocol (agree on a structure once, then one
  payload collective per call), broadcast and gather of objects.
- :mod:`~ddpctx.reduce.fastpath`: a call site's steady state: the payload and its flag.
- :mod:`~ddpctx.reduce.transport`: a buffer reduced by torch's ``all_reduce`` or, small on
  2-rank gloo, by one ``all_gather``.
- :mod:`~ddpctx.reduce.objects`: any picklable object broadcast or gathered.
- :mod:`~ddpctx.reduce.handles`: the ``async_op=True`` handle; handles finish in issue order.
- :mod:`~ddpctx.reduce.guard`: refuses a collective no other rank could join (another
  thread, a DataLoader worker, rank-zero-only work).
- :mod:`~ddpctx.reduce.rollcall`: which rank left, after a collective lost its peer.
- :mod:`~ddpctx.reduce.faces`: ``ctx.all_reduce`` & co. on the context.

May import: :mod:`ddpctx.utils`. Knows nothing of the session.
"""
