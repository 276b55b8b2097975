"""Old import paths that keep working for a release, served from one table.

When the flat modules moved into subpackages, every name that could be imported
from an old path (``from ddpctx.env import detect_launch``) kept working, with a
``DeprecationWarning`` per name saying where to import it from now: ``ddpctx``
itself for the public API (``from ddpctx import RankZeroError``), else the
module that defines it.

:data:`OLD_PATHS` is the whole story: ``{old module: {new home: "names"}}``,
paths below ``ddpctx.``. Two mechanisms serve it, both reading that table:

- an old path with no module of its own (``ddpctx.wire``) is made on import by
  :class:`OldPathFinder`, which :func:`serve_old_paths` puts at the end of
  ``sys.meta_path`` (so a real module of that name always wins);
- a package that replaced an old module of the same name (``ddpctx.rankzero``,
  ``ddpctx.data``, ``ddpctx.checkpoint``) gets the old module's names through a
  module ``__getattr__`` from :func:`moved_attributes`, and lists them in its
  ``__all__`` (:func:`old_names`), so a star import still brings them.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     from ddpctx.rankzero import RankZeroError
>>> print(caught[0].message)  # doctest: +NORMALIZE_WHITESPACE
ddpctx.rankzero.RankZeroError moved to ddpctx.rankzero.outcome;
import it from ddpctx itself (e.g. `from ddpctx import RankZeroError`).

This module imports nothing of ddpctx: the names are imported from their homes
only when asked for, so ``import ddpctx.testing`` still imports no torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

#: Every old module path (below ``ddpctx.``), each new home (below ``ddpctx.``)
#: and the names of the old path that live there now, space-separated.
OLD_PATHS: dict[str, dict[str, str]] = {
    "accumulate": {
        "parallel.accumulate": "Accumulation no_sync",
    },
    "atomic": {
        "utils.atomic": (
            "ABANDONED_AFTER_S atomic_save fsync_directory is_abandoned "
            "no_space_error remove_abandoned replace_dir temporary_name"
        ),
    },
    "blocks": {
        "rankzero.blocks": "atomic_dir rank_zero_block",
    },
    "checkpoint": {
        "checkpoint.files": (
            "FORMAT RefusedCheckpoint bare check_world_size checkpoint_paths "
            "load_file newest_checkpoint next_checkpoint_path probe prune "
            "training_state"
        ),
        "parallel.wrapping": "unwrap_model",
        "utils.atomic": "atomic_save",
    },
    "collectives": {
        "reduce.collectives": (
            "Reduction ReductionError Site all_reduce_tree check_op comm_device "
            "failed_reduction group_size report_failure"
        ),
        "reduce.objects": "all_gather_objects broadcast_object",
    },
    "context": {
        "session.context": "DistributedSession current distributed",
        "session.distcontext": "DistContext",
    },
    "data": {
        "data.dataloader": "SeedWorkers epochs make_dataloader",
        "data.sampling": "ShardSampler",
    },
    "decorators": {
        "rankzero.decorators": "all_reduced rank_zero_first rank_zero_only",
    },
    "env": {
        "utils.env": (
            "DEFAULT_TIMEOUT KNOWN_BACKENDS LAUNCHER_VARIABLE LaunchInfo Launcher "
            "MAX_TIMEOUT_S MIN_TIMEOUT_S check_timeout detect_launch "
            "resolve_backend resolve_device_index resolve_timeout slurm_port"
        ),
        "utils.hostlist": "parse_nodelist parse_tasks_per_node",
    },
    "errors": {
        "utils.errors": "PEER_FAILED PEER_GONE describe is_follow_on",
    },
    "formation": {
        "session.formation": "FORMATION_ATTEMPTS form_group is_mesh_race",
    },
    "group": {
        "session.group": (
            "DESTROY_TIMEOUT_S TCPStore destroy_group_bounded formation_store "
            "host_store init_group init_kwargs loopback_gloo tcp_url"
        ),
        "utils.errors": "is_follow_on_exit record_for_torchrun should_record",
    },
    "hangreport": {
        "hang.report": (
            "Exchange PREFIX RankState diagnose folded_stack format_report "
            "main_thread_frame snapshot"
        ),
    },
    "identity": {
        "utils.identity": "Placed occupant occupy whoami",
    },
    "inflight": {
        "hang.inflight": (
            "DDP_BACKWARD HangError TRACKED TrackedWork Tracker install "
            "is_library_file short_path user_site"
        ),
        "hang.peers": "ranks_text",
    },
    "launcher": {
        "launching.failures": "RankError RankSkipped RankTimeoutError RemoteTraceback summary",
        "launching.pool": "FINALLY_GRACE_S FOLLOW_ON_GRACE_S RankPool STACK_DUMP_WAIT_S",
        "launching.echo": "ECHO_INTERVAL_S",
        "launching.launcher": "launch",
    },
    "loader": {
        "data.loader": "SeededBatches SeededIndices ShardLoader to_device",
    },
    "meta": {
        "checkpoint.meta": "plain_meta",
    },
    "packing": {
        "reduce.packing": "OPS OpSpec Plan SMALL leaf_ops plan_key",
    },
    "rankstate": {
        "launching.taskstate": "RankState capture replace_environ restore task_state",
    },
    "rankzero": {
        "rankzero.outcome": (
            "Outcome RankZeroError inside_rank_zero_work on_rank_zero running_alone "
            "share zero_first"
        ),
        "utils.identity": "Place",
    },
    "report": {
        "rankzero.report": "RankFilter bar_on_main get_logger progress",
    },
    "resume": {
        "checkpoint.resume": "Gather derived_seed load save",
    },
    "sampling": {
        "data.sampling": "Position ShardSampler deal deal_length done_mask",
    },
    "seeding": {
        "utils.seeding": (
            "MAX_SEED enable_deterministic rng_state seed_everything seed_worker "
            "set_rng_state validate_seed worker_seed"
        ),
    },
    "signals": {
        "session.signals": "GRACE_S exit_on_sigterm",
        "utils.errors": "SIGTERM_STATUS",
    },
    "tree": {
        "reduce.tree": "Leaf describe flatten signature",
    },
    "watchdog": {
        "hang.watchdog": "ANSWER_WAIT_S Doctor RAISE_GRACE_S STOP_WAIT_S TICK_S Watchdog",
        "hang.settings": "HangSettings MAX_DEFAULT_HANG_TIMEOUT_S ON_HANG resolve_hang_settings",
    },
    "wire": {
        "reduce.wire": "Slot Wire leaf_of",
    },
    "worker": {
        "launching.worker": "Outcome Task read_from worker_main",
    },
}


def moved_names(old: str) -> dict[str, str]:
    """``{name: full new home}`` for the old module path ``old`` (a full name).

    >>> moved_names("ddpctx.accumulate")
    {'Accumulation': 'ddpctx.parallel.accumulate', 'no_sync': 'ddpctx.parallel.accumulate'}
    """
    homes = OLD_PATHS[old.removeprefix("ddpctx.")]
    return {name: f"ddpctx.{home}" for home, names in homes.items() for name in names.split()}


def old_names(package: str) -> list[str]:
    """The names ``from package import *`` gives: the old module's, each warning when taken.

    >>> old_names("ddpctx.rankzero")[:3]
    ['Outcome', 'Place', 'RankZeroError']
    """
    return sorted(moved_names(package))


def _public(name: str) -> bool:
    """Whether ``from ddpctx import name`` works (read from the loaded package, never imported)."""
    return name in getattr(sys.modules.get("ddpctx"), "__all__", ())


def moved_attributes(package: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving the old names of ``package``, each with a warning.

    Unknown names raise ``AttributeError`` as usual, so submodule imports and
    ``hasattr`` behave as without it.
    """
    homes = moved_names(package)

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if sys._getframe(1).f_code.co_filename.startswith("<frozen importlib"):
            # ``from package import name`` asks ``hasattr`` first, then takes the name:
            # the taking warns, so the one import warns once.
            return getattr(importlib.import_module(home), name)
        source = f"ddpctx itself (e.g. `from ddpctx import {name}`)" if _public(name) else "there"
        warnings.warn(
            f"{package}.{name} moved to {home}; import it from {source}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), name)

    return __getattr__


class OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes the module at an old path that has no file of its own any more."""

    def __repr__(self) -> str:
        return "<the old import paths of ddpctx.utils.moved>"

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("ddpctx.") or fullname.removeprefix("ddpctx.") not in OLD_PATHS:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        names = moved_names(module.__name__)
        homes = sorted(set(names.values()))
        module.__doc__ = f"Moved to {', '.join(homes)}: each name warns where it lives now."
        module.__all__ = sorted(names)  # type: ignore[attr-defined]
        module.__getattr__ = moved_attributes(module.__name__)  # type: ignore[method-assign]
        module.__dir__ = lambda: sorted(names)  # type: ignore[method-assign]


def serve_old_paths() -> None:
    """Serve every old path from :data:`OLD_PATHS` (once, however often it is called)."""
    if not any(isinstance(finder, OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.append(OldPathFinder())
