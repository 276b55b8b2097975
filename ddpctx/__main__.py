"""``python -m ddpctx``: see :mod:`ddpctx.cli`."""

from ddpctx.cli import console

console()
