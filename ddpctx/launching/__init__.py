"""Launching: run a function on N local ranks -- warm worker processes, fail-fast, stack dumps.

(Named ``launching`` so that it never shadows the function ``ddpctx.launch``.)

- :mod:`~ddpctx.launching.launcher`: ``launch()``, the engine's contract.
- :mod:`~ddpctx.launching.pool`: the parent side: a pool of warm ranks, fail-fast, clean-up.
- :mod:`~ddpctx.launching.poolstore`: the pool's loopback store, a key prefix per task.
- :mod:`~ddpctx.launching.failures`: what a failed or hung task raises, and its hints.
- :mod:`~ddpctx.launching.echo`: the ranks' output streamed as it comes (``pytest -s``).
- :mod:`~ddpctx.launching.descendants`: what a rank started, also in a session of its own.
- :mod:`~ddpctx.launching.preflight`: what is checked before any rank is forked.
- :mod:`~ddpctx.launching.worker`: a forked rank's side: output capture, tasks.
- :mod:`~ddpctx.launching.taskstate`: what one task changed in a reused rank, undone.

May import: :mod:`ddpctx.utils`, :mod:`ddpctx.session`.
"""
