"""Moved to :mod:`ddpctx.session.context`.

This old path still imports, with a ``DeprecationWarning``.

Import these names from the package instead (``from ddpctx import distributed``),
which does not change when modules move.
"""

from __future__ import annotations

import warnings

from ddpctx.session.context import DistributedSession, current, distributed
from ddpctx.session.distcontext import DistContext

__all__ = ["DistContext", "DistributedSession", "current", "distributed"]

warnings.warn(
    "ddpctx.context moved to ddpctx.session.context; "
    "import DistContext, DistributedSession, current, distributed from ddpctx itself "
    "(e.g. `from ddpctx import distributed`).",
    DeprecationWarning,
    stacklevel=2,
)
