"""Rank-zero work: run something on rank 0 without ever leaving the others hanging.

- :mod:`~ddpctx.rankzero.outcome`: the protocol -- rank 0 sends every rank an ``Outcome``
  (its result or its exception), never a bare barrier.
- :mod:`~ddpctx.rankzero.decorators`: ``@rank_zero_only``, ``@all_reduced``, ``rank_zero_first``.
- :mod:`~ddpctx.rankzero.blocks`: ``with ctx.rank_zero() as main:`` and ``ctx.atomic_dir``.
- :mod:`~ddpctx.rankzero.report`: progress bars and logging once per job.
- :mod:`~ddpctx.rankzero.faces`: those blocks on the context.

May import: :mod:`ddpctx.utils`, :mod:`ddpctx.reduce`.

The names of the module ``ddpctx.rankzero`` this package replaced still import from it,
with a ``DeprecationWarning`` naming their new home.
"""

from __future__ import annotations

from ddpctx.utils.moved import moved_attributes, old_names

__getattr__ = moved_attributes(__name__)
__all__ = old_names(__name__)  # a star import still brings the old module's names
