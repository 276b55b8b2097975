"""Launching: run a function on N local ranks -- warm worker processes, fail-fast, stack dumps.

(Named ``launching`` so that it never shadows the function ``ddpctx.launch``.)

- :mod:`~ddpctx.launching.launcher`: the parent side: pools of ranks, ``launch()``, errors.
- :mod:`~ddpctx.launching.preflight`: what is checked before any rank is forked.
- :mod:`~ddpctx.launching.worker`: a forked rank's side: output capture, tasks.
- :mod:`~ddpctx.launching.taskstate`: what one task changed in a reused rank, undone.

May import: :mod:`ddpctx.utils`, :mod:`ddpctx.session`.
"""
