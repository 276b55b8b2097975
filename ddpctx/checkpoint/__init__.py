"""Checkpoints: a whole run saved atomically and resumed exactly.

- :mod:`~ddpctx.checkpoint.files`: checkpoint file names, which is newest, pruning, probing.
- :mod:`~ddpctx.checkpoint.meta`: meta that round-trips through ``weights_only`` loading.
- :mod:`~ddpctx.checkpoint.resume`: save and load a run (state, RNGs, loader positions).
- :mod:`~ddpctx.checkpoint.perrank`: ``rank_state=``, one state per rank.
- :mod:`~ddpctx.checkpoint.schedules`: step-counted schedulers across world sizes.
- :mod:`~ddpctx.checkpoint.sharded`: the same for sharded (FSDP2) models, through DCP.
- :mod:`~ddpctx.checkpoint.shardload`: a sharded checkpoint loaded, each rank verifying its reads.
- :mod:`~ddpctx.checkpoint.shardfiles`: sharded checkpoint directories: names, newest, pruning.
- :mod:`~ddpctx.checkpoint.dcpread`: DCP's files read as data, never as code, verified as read.
- :mod:`~ddpctx.checkpoint.mapped`: shard files mapped, read by ``torch.load`` with one copy.
- :mod:`~ddpctx.checkpoint.entries`: a shard's entry to its value, a tensor built on its bytes.
- :mod:`~ddpctx.checkpoint.together`: each rank verifies what it reads; one small vote decides.
- :mod:`~ddpctx.checkpoint.pending`: ``async_save=True``, a sharded save written while training.
- :mod:`~ddpctx.checkpoint.shardwriter`: DCP's file writer, keeping a failed write's ``errno``.
- :mod:`~ddpctx.checkpoint.writefailures`: a failed sharded write as an ``OSError`` naming the path.
- :mod:`~ddpctx.checkpoint.claims`: what a pickle claims, weighed against its file's size first.
- :mod:`~ddpctx.checkpoint.opwalk`: a pickle's opcodes followed on a model of its stack, linearly.
- :mod:`~ddpctx.checkpoint.shape`: what an unpickled value expands to, and how deep it nests.
- :mod:`~ddpctx.checkpoint.sums`: checksums, recorded at save, verified by each rank as it reads.
- :mod:`~ddpctx.checkpoint.listed`: every file a manifest lists must be there; who must hold it.
- :mod:`~ddpctx.checkpoint.regular`: a checkpoint's files are regular files; a FIFO is never opened.
- :mod:`~ddpctx.checkpoint.writerlock`: one writing job per checkpoint directory, enforced.
- :mod:`~ddpctx.checkpoint.faces`: ``ctx.save``/``load``/``save_checkpoint``/``load_checkpoint``.
- :mod:`~ddpctx.checkpoint.choice`: the checkpoint a reader in one process reads, read once.
- :mod:`~ddpctx.checkpoint.weights`: ``checkpoint_meta`` and ``load_weights``, in one plain process.
- :mod:`~ddpctx.checkpoint.export`: a checkpoint as a plain ``.pt`` or ``.safetensors`` file.

May import: :mod:`ddpctx.utils`, :mod:`ddpctx.reduce`, :mod:`ddpctx.rankzero`,
:mod:`ddpctx.data`, :mod:`ddpctx.parallel`.

The names of the module ``ddpctx.checkpoint`` this package replaced still import from it,
with a ``DeprecationWarning`` naming their new home.
"""

from __future__ import annotations

from ddpctx.utils.moved import moved_attributes, old_names

__getattr__ = moved_attributes(__name__)
__all__ = old_names(__name__)  # a star import still brings the old module's names
