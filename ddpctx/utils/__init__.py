"""Pure helpers: the bottom layer, which every subsystem may use.

- :mod:`~ddpctx.utils.env`: read and validate the launcher's environment (no I/O).
- :mod:`~ddpctx.utils.raytrain`: a Ray Train worker's place, from Ray's context (never
  imports ray).
- :mod:`~ddpctx.utils.hostlist`: SLURM's compact host and tasks-per-node lists, expanded.
- :mod:`~ddpctx.utils.conflicts`: two launchers' variables that disagree, named.
- :mod:`~ddpctx.utils.seeding`: seeds, worker seeds, RNG state capture and restore.
- :mod:`~ddpctx.utils.forking`: forked children that never collect their parent's torch objects.
- :mod:`~ddpctx.utils.atomic`: files and directories that appear whole or not at all.
- :mod:`~ddpctx.utils.digest`: running checksums of checkpoint bytes (XXH3-64, or CRC-32).
- :mod:`~ddpctx.utils.errors`: a rank's own failure vs. the errors it causes on others;
  torchrun's error file.
- :mod:`~ddpctx.utils.identity`: who this process is (the one "current context" slot).
- :mod:`~ddpctx.utils.issuing`: the ``@all_reduced`` site being reduced (for debug mode).
- :mod:`~ddpctx.utils.warn`: warnings that name the user's line, not ddpctx's.
- :mod:`~ddpctx.utils.moved`: old import paths that still work, with a deprecation warning.

May import: nothing else of ddpctx.
"""
