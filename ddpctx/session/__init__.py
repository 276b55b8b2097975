"""The session: ``distributed()`` and everything it sets up and always tears down.

- :mod:`~ddpctx.session.context`: ``distributed()``, its enter/exit, ``current()``.
- :mod:`~ddpctx.session.distcontext`: ``DistContext``, joined from each subsystem's face.
- :mod:`~ddpctx.session.adoption`: a group someone else formed (Ray Train's too), adopted.
- :mod:`~ddpctx.session.group`: forming the process group and tearing it down in bounded time.
- :mod:`~ddpctx.session.formation`: formation on a store ddpctx owns, retried on gloo's race.
- :mod:`~ddpctx.session.signals`: SIGTERM from a launcher leaves the block at once.
- :mod:`~ddpctx.session.quiesce`: gloo's worker threads finish before the group is left.
- :mod:`~ddpctx.session.watching`: ``distributed()``'s watching options, wired into the block.
- :mod:`~ddpctx.session.departures`: which ranks have left ``distributed()``; a lost peer explained.

May import: every subsystem below it (:mod:`ddpctx.utils`, :mod:`ddpctx.reduce`,
:mod:`ddpctx.rankzero`, :mod:`ddpctx.data`, :mod:`ddpctx.parallel`,
:mod:`ddpctx.checkpoint`, :mod:`ddpctx.hang`, :mod:`ddpctx.watch`); nothing above
(launching, testing, cli).
"""
