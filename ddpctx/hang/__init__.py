"""The hang doctor: which collective each rank waits in, and one report when the job stops moving.

- :mod:`~ddpctx.hang.inflight`: what the main thread waits in, tracked live.
- :mod:`~ddpctx.hang.peers`: who a wait involves (a subgroup's members, a recv's peer).
- :mod:`~ddpctx.hang.lockstep`: debug mode, ranks in different collectives of a group fail at once.
- :mod:`~ddpctx.hang.report`: each rank's state and stack over the job's store; the diagnosis.
- :mod:`~ddpctx.hang.settings`: ``hang_timeout``, ``on_hang`` and ``debug``, checked and resolved.
- :mod:`~ddpctx.hang.watchdog`: the thread per rank that notices, reports, or raises.

May import: :mod:`ddpctx.utils`. The watchdog never uses the process group for its own
traffic; debug mode's check is one collective on the group it checks.
"""
