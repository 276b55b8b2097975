"""Checkpoints: a whole run saved atomically and resumed exactly.

- :mod:`~ddpctx.checkpoint.files`: checkpoint file names, which is newest, pruning, probing.
- :mod:`~ddpctx.checkpoint.meta`: meta that round-trips through ``weights_only`` loading.
- :mod:`~ddpctx.checkpoint.resume`: save and load a run (state, RNGs, loader positions).
- :mod:`~ddpctx.checkpoint.perrank`: ``rank_state=``, one state per rank.
- :mod:`~ddpctx.checkpoint.schedules`: step-counted schedulers across world sizes.
- :mod:`~ddpctx.checkpoint.sharded`: the same for sharded (FSDP2) models, through DCP.
- :mod:`~ddpctx.checkpoint.shardfiles`: sharded checkpoint directories: names, newest, pruning.
- :mod:`~ddpctx.checkpoint.pending`: ``async_save=True``, a sharded save written while training.
- :mod:`~ddpctx.checkpoint.faces`: ``ctx.save``/``load``/``save_checkpoint``/``load_checkpoint``.

May import: :mod:`ddpctx.utils`, :mod:`ddpctx.reduce`, :mod:`ddpctx.rankzero`,
:mod:`ddpctx.data`, :mod:`ddpctx.parallel`.
"""
