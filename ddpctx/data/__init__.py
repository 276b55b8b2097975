"""Sharded data: which samples each rank reads, on which device, from where after a resume.

- :mod:`~ddpctx.data.sampling`: the shard of each epoch's order, and a resumable position.
- :mod:`~ddpctx.data.loader`: the DataLoader ``ctx.dataloader`` returns (device, position, seeds).
- :mod:`~ddpctx.data.dataloader`: building it; the epoch loop.
- :mod:`~ddpctx.data.book`: the context's loaders, held weakly, matched to saved positions.
- :mod:`~ddpctx.data.generators`: private random generators in a dataset, found and named.
- :mod:`~ddpctx.data.faces`: ``ctx.dataloader`` and ``ctx.epochs``.
- Streams (an ``IterableDataset``): :mod:`~ddpctx.data.streambuild` builds the
  loader, :mod:`~ddpctx.data.streamsplit` is what each worker reads (its share,
  batched, resumable), :mod:`~ddpctx.data.streamseeds` seeds each batch, and
  :mod:`~ddpctx.data.streamloader` merges the workers and ends every rank's
  epoch at the same step.

May import: :mod:`ddpctx.utils`.

The names of the module ``ddpctx.data`` this package replaced still import from it,
with a ``DeprecationWarning`` naming their new home.
"""

from __future__ import annotations

from ddpctx.utils.moved import moved_attributes, old_names

__getattr__ = moved_attributes(__name__)
__all__ = old_names(__name__)  # a star import still brings the old module's names
