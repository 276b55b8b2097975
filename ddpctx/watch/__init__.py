"""Watching a run: the metrics trail, per-rank step timings, the straggler report, the profiler.

- :mod:`~ddpctx.watch.loggers`: where ``ctx.log`` writes (``jsonl``, ``csv``,
  ``tensorboard``, or an object with ``log_metrics``: :class:`Logger`), and
  ``distributed()``'s check of ``log_dir``.
- :mod:`~ddpctx.watch.files`: the built-in files, live, append-only, never torn.
- :mod:`~ddpctx.watch.metrics`: what ``ctx.log`` accepts, and the values loggers get.
- :mod:`~ddpctx.watch.trail`: steps on every rank, rank 0's writer,
  exactly-once across a kill and a resume.
- :mod:`~ddpctx.watch.trackers`: ``mlflow`` and ``wandb``, the same run after a resume;
  :mod:`~ddpctx.watch.mlflow_logger` (over :mod:`~ddpctx.watch.mlflow_rest`) and
  :mod:`~ddpctx.watch.runrecord` (the run's id in ``log_dir``), the MLflow side.
- :mod:`~ddpctx.watch.servers`: a tracking server outside the job, waited on a bounded time.
- :mod:`~ddpctx.watch.lanes`: one thread per logger, so none holds up another.
- :mod:`~ddpctx.watch.clock`: data / compute / collective time of every step.
- :mod:`~ddpctx.watch.straggler`: who holds the others back (pure), and the report.
- :mod:`~ddpctx.watch.watcher`: the thread that publishes timings and prints the report.
- :mod:`~ddpctx.watch.profiling`: ``ctx.profile``.
- :mod:`~ddpctx.watch.faces`: ``ctx.log``, ``ctx.log_config``, ``ctx.timings``, ``ctx.profile``.

May import: :mod:`ddpctx.utils`, :mod:`ddpctx.reduce` (``ctx.log`` reduces with
its engine) and :mod:`ddpctx.hang` (the collective waits come from its tracker).
"""

from ddpctx.watch.loggers import Logger

__all__ = ["Logger"]
