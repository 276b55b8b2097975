"""ddpctx's benchmarks: what the plumbing costs, measured against what users would otherwise write.

Contract: every module here is a subject, and importing one runs nothing (it
starts no process and forms no group). ``python benchmarks/run.py`` runs the
sections of ``BENCHMARKS.md`` (see its docstring) and regenerates the page with
``--write``; each ``bench_*.py``, ``accuracy.py``, ``blame.py`` and
``stress_plugin.py`` is a script of its own, run as ``python benchmarks/<name>.py``
(or ``python -m benchmarks.<name>`` from the repository), with the options its
docstring gives.

By subject:

- ``reduction``: sections 1 and 6, a metrics dict reduced (and ``bench_reduce``,
  the same under torchrun); ``training``: section 2, a training step's overhead;
  ``bench_call``: section 2b and where one call's microseconds go;
  ``startup``: sections 3 and 4; ``bench_harness``: section 5, the test plugin's
  per-test cost (and ``stress_plugin``, its group formation under load);
- ``bench_doctor`` and ``bench_watch``: watching a run (the hang doctor; timings,
  the straggler watcher and ``ctx.log``);
- ``bench_checksums`` and ``bench_weights``: checkpoints; ``bench_shard`` and
  ``bench_memory``: sharded training; ``bench_stream`` and ``bench_loader``:
  data loading; ``accuracy`` and ``blame``: correctness, not cost;
- shared by them: ``stats`` (round orders, paired ratios, intervals, verdicts,
  cells), ``processes`` (torchrun jobs, scripts, fresh interpreters),
  ``workload`` (the small model and training step) and ``report`` (the page).
"""
