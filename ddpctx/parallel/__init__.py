"""How the model is made parallel: DDP or FSDP2, precision, accumulation, clipping.

- :mod:`~ddpctx.parallel.wrapping`: the bare module inside DDP / ``torch.compile`` wrappers.
- :mod:`~ddpctx.parallel.sharding`: telling sharded models apart; FSDP2 ``fully_shard`` per block.
- :mod:`~ddpctx.parallel.shardstart`: a sharded model starts from rank 0's weights, as under DDP.
- :mod:`~ddpctx.parallel.tensorparallel`: tensor parallel plans on a ``("dp", "tp")`` mesh.
- :mod:`~ddpctx.parallel.precision`: the one ``precision=`` switch, autocast and the scaler.
- :mod:`~ddpctx.parallel.accumulate`: skip DDP's all-reduce on all but the last micro-batch.
- :mod:`~ddpctx.parallel.clipping`: clipping by the whole model's norm, DDP or sharded.
- :mod:`~ddpctx.parallel.buckets`: DDP's gradient-bucket layout, saved and given back on resume.
- :mod:`~ddpctx.parallel.compiling`: ``compile=``, ``torch.compile`` in place, in torch's order.
- :mod:`~ddpctx.parallel.guards`: the session's guards: collectives, and a forward or DDP clip
  in rank-zero work.
- :mod:`~ddpctx.parallel.faces`: ``ctx.wrap``, ``ctx.shard``, ``ctx.unwrap``, ``ctx.no_sync``,
  ``ctx.accumulate``, ``ctx.precision``, ``ctx.autocast``, ``ctx.scaler``,
  ``ctx.clip_grad_norm_``, ``ctx.full_state_dict``, ``ctx.mesh``, ``ctx.parallel_mesh``.

May import: :mod:`ddpctx.utils`, :mod:`ddpctx.data` (a loader's position drives accumulation).
"""
