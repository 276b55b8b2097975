"""MLflow and Weights & Biases as ``ctx.log`` loggers: after a kill and a resume, the same run.

``distributed(log_dir=..., loggers=("mlflow",))`` or ``("wandb",)`` builds
:class:`MLflowLogger` or :class:`WandbLogger` with the trackers' own
environment variables (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``;
``WANDB_PROJECT``, ``WANDB_MODE``, ...); an object built with arguments goes
in ``loggers=`` as it is. Both follow the :class:`~ddpctx.watch.loggers.Logger`
protocol, called on rank 0 only, from the trail's writer thread:

- Building one needs its package (``pip install ddpctx[mlflow]`` /
  ``ddpctx[wandb]``) and refuses at once, on every rank, naming the extra.
- ``resume(None)`` starts a new run and records its id in ``log_dir``
  (``mlflow-run.json`` / ``wandb-run.json``, replaced atomically).
  ``resume(step)`` (a checkpoint was loaded) continues the recorded run: the
  restarted job is the same run in the tracker, not a second one.
- The points the killed attempt logged after the checkpoint's ``step``:

  - W&B rewinds the run to ``step`` (``wandb.init(resume_from=f"{id}?_step={step}")``):
    its history after ``step`` is the resumed attempt's.
  - MLflow cannot delete a metric point. The resumed attempt reads the
    run's points after ``step`` and does not send a point that is already
    there with the same value (a deterministic resume recomputes exactly
    those), so each step has its value once. A value that differs is sent
    too, with a warning naming the metric and steps: MLflow then shows both.

- ``log_hparams``: MLflow params (nested names joined with ``/``, values as
  text) or the W&B config, once per run (a resumed run never logs them again).
- ``flush()`` (at every checkpoint): MLflow's points are sent and stored by
  the server; W&B has no public flush, so its service process writes them
  in its own time (see the watching guide for what a hard kill of rank 0
  loses there).

Example:
    >>> import tempfile
    >>> sorted(TRACKERS)
    ['mlflow', 'wandb']
    >>> record_path(tempfile.gettempdir(), "mlflow").name
    'mlflow-run.json'

Where: :class:`MLflowLogger` lives in :mod:`ddpctx.watch.mlflow_logger`,
the run record both share in :mod:`ddpctx.watch.runrecord` (both importable
from here too); this module holds :class:`WandbLogger` and :data:`TRACKERS`.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from ddpctx.watch.mlflow_logger import MLFLOW_BATCH, MLFLOW_PARAM_BATCH, MLflowLogger
from ddpctx.watch.runrecord import (
    TRACKER_PATIENCE_S,
    flat_params,
    missing_record,
    read_record,
    record_path,
    require,
    write_record,
)
from ddpctx.watch.servers import RemoteTracker

__all__ = [
    "MLFLOW_BATCH",
    "MLFLOW_PARAM_BATCH",
    "TRACKERS",
    "TRACKER_PATIENCE_S",
    "MLflowLogger",
    "WandbLogger",
    "flat_params",
    "read_record",
    "record_path",
    "require",
    "write_record",
]


class WandbLogger(RemoteTracker):
    """``ctx.log``'s points as the history of one W&B run (``pip install ddpctx[wandb]``).

    ``project``, ``entity``, ``name`` and ``mode`` go to ``wandb.init`` (None:
    W&B's own defaults and ``WANDB_*`` variables); ``dir`` defaults to
    ``WANDB_DIR``, then ``log_dir`` (offline runs land in ``log_dir/wandb``).
    ``init`` adds any other ``wandb.init`` argument. The run is W&B's
    ``reinit="create_new"`` kind: it leaves ``wandb.run`` alone; it is
    :attr:`run` here, on rank 0, between the first ``ctx.log`` and the end
    of the block.

    A resume asks W&B to rewind the run to the checkpoint's step
    (``resume_from``, a W&B server feature, in beta in wandb 0.31): a server
    that refuses makes ``wandb.init`` raise, and the trail then drops this
    logger with a warning that names the error (the other loggers go on).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        project: str | None = None,
        entity: str | None = None,
        name: str | None = None,
        mode: str | None = None,
        dir: str | os.PathLike[str] | None = None,  # wandb.init calls it so
        **init: Any,
    ) -> None:
        require("wandb", "wandb")
        super().__init__()
        taken = {"id", "resume", "resume_from", "fork_from", "reinit", "config"} & set(init)
        if taken:
            raise ValueError(
                f"WandbLogger(..., {', '.join(sorted(taken))}=...): the logger chooses the run "
                "(a new one, or the recorded one resumed at the checkpoint's step) and logs "
                "the config from ctx.log_config. Leave these out."
            )
        self.record = record_path(log_dir, "wandb")
        self.project = project
        self.entity = entity
        self.name = name
        self.mode = mode
        self.dir = dir if dir is not None else os.environ.get("WANDB_DIR") or log_dir
        self.init = init
        #: The W&B run (rank 0, while the block logs), or None.
        self.run: Any = None
        self._wandb: Any = None
        self._exit_code = 0

    def resume(self, step: int | None) -> None:
        self._finish()
        if self._wandb is None:
            self._wandb = importlib.import_module("wandb")
        record = None if step is None else read_record(self.record)
        if step is not None and record is None:
            missing_record("WandbLogger", self.record, step)
        Path(self.dir).mkdir(parents=True, exist_ok=True)
        fresh = step is None or record is None
        chosen: dict[str, Any] = {"project": self.project}  # a new run: W&B picks its id
        if not fresh:
            assert record is not None
            chosen = {
                "resume_from": f"{record['run_id']}?_step={step}",
                "project": self.project or record.get("project"),
            }
        self.run = self._wandb.init(
            entity=self.entity,
            name=self.name,
            mode=self.mode,
            dir=os.fspath(self.dir),
            reinit="create_new",
            **chosen,
            **self.init,
        )
        if fresh:
            write_record(
                self.record,
                {"run_id": self.run.id, "project": self.run.project, "entity": self.run.entity},
            )

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.run is None:
            self.resume(None)
        self.run.log(metrics, step=step)

    def log_hparams(self, params: dict[str, Any]) -> None:
        if self.run is None:
            self.resume(None)
        self.run.config.update(params, allow_val_change=True)

    def ended(self, how: str) -> None:
        """How the block ended: a failed or killed block finishes the run with exit code 1."""
        self._exit_code = 0 if how == "finished" else 1

    def close(self) -> None:
        self._finish()

    def _finish(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=self._exit_code)


#: The names ``distributed(loggers=...)`` accepts for these trackers, and what builds each.
TRACKERS: dict[str, Any] = {"mlflow": MLflowLogger, "wandb": WandbLogger}
