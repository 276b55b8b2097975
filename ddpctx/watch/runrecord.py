"""The run a tracker writes to, kept in ``log_dir`` so a restarted job finds it again.

Shared by the MLflow and W&B loggers (:mod:`ddpctx.watch.mlflow_logger`,
:mod:`ddpctx.watch.trackers`). Contract:

- :func:`require` refuses at once, on every rank, naming the extra to
  install, when a tracker's package is missing (it does not import it).
- :func:`record_path` is ``log_dir/<tracker>-run.json``; :func:`write_record`
  replaces it atomically (temporary file, fsync, rename) and
  :func:`read_record` gives None for a missing or unreadable one, never raises.
- :func:`flat_params` turns a nested config into the flat text params a
  tracker takes (nested names joined with ``/``).
- :func:`missing_record` says that a checkpoint's run record is gone, so a
  new run starts.

Example:
    >>> import tempfile
    >>> record_path(tempfile.gettempdir(), "mlflow").name
    'mlflow-run.json'
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpctx.utils.atomic import fsync_directory, temporary_name
from ddpctx.utils.warn import warn_user

#: A tracker's patience (``stuck_after_s``): importing mlflow or wandb alone took 9 s on a
#: loaded 2-core machine, and their servers answer over the network.
TRACKER_PATIENCE_S = 120.0


def require(package: str, logger: str) -> None:
    """Refuse at once, naming the extra, when ``package`` is not installed (it is not imported).

    Every rank builds its loggers; only rank 0 imports the package, when it
    first writes (``import mlflow`` takes seconds).

    >>> require("a_package_nobody_has", "mlflow")
    Traceback (most recent call last):
    ...
    ImportError: distributed(loggers=('mlflow',)) needs the a_package_nobody_has package, ...
    """
    if importlib.util.find_spec(package) is None:
        raise ImportError(
            f"distributed(loggers=({logger!r},)) needs the {package} package, which is not "
            f"installed. Install it with `pip install ddpctx[{logger}]` (from a checkout: "
            f'pip install -e ".[{logger}]"), or drop {logger!r} from loggers.'
        )


def record_path(log_dir: str | os.PathLike[str], tracker: str) -> Path:
    """Where rank 0 keeps the id of ``tracker``'s run: ``log_dir/<tracker>-run.json``."""
    return Path(log_dir) / f"{tracker}-run.json"


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Replace ``path`` with ``record`` as JSON at once (temporary file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(path)
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(record, file, indent=2, sort_keys=True)
        file.write("\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
    fsync_directory(path.parent)


def read_record(path: Path) -> dict[str, Any] | None:
    """The run record at ``path``, or None when there is none (or it is unreadable)."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("run_id"), str) else None


def flat_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"opt": {"lr": 0.1}, "name": "a"}`` -> ``{"opt/lr": "0.1", "name": "a"}``.

    >>> flat_params({"opt": {"lr": 0.1, "betas": [0.9, 0.99]}, "name": "a", "amp": True})
    {'opt/lr': '0.1', 'opt/betas': '[0.9, 0.99]', 'name': 'a', 'amp': 'true'}
    """
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_params(value, name + "/"))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return flat


def missing_record(tracker: str, path: Path, step: int) -> None:
    """Warn that the checkpoint at ``step`` has no run record at ``path``: a new run starts."""
    warn_user(
        f"{tracker}: the checkpoint was taken at step {step}, but {path} (the id of the run "
        "it belongs to) is missing or unreadable, so a new run is started; the steps up to "
        f"{step} stay in the earlier run. Keep {path.name} in log_dir across restarts to "
        "continue the same run.",
        RuntimeWarning,
    )
