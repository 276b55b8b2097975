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

Why one module: the two loggers share the run record in ``log_dir``, the
package check and the flattening of a config; each alone is about 150 lines.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpctx.utils.atomic import fsync_directory, temporary_name
from ddpctx.utils.warn import warn_user

#: The most metric points MLflow takes in one ``log_batch`` (its server's limit).
MLFLOW_BATCH = 1000
#: The most params MLflow takes in one ``log_batch``.
MLFLOW_PARAM_BATCH = 100


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


def _missing_record(tracker: str, path: Path, step: int) -> None:
    warn_user(
        f"{tracker}: the checkpoint was taken at step {step}, but {path} (the id of the run "
        "it belongs to) is missing or unreadable, so a new run is started; the steps up to "
        f"{step} stay in the earlier run. Keep {path.name} in log_dir across restarts to "
        "continue the same run.",
        RuntimeWarning,
    )


def _same(first: float, second: float) -> bool:
    return first == second or (math.isnan(first) and math.isnan(second))


class MLflowLogger:
    """``ctx.log``'s points as metrics of one MLflow run (``pip install ddpctx[mlflow]``).

    ``tracking_uri`` defaults to MLflow's own choice (``MLFLOW_TRACKING_URI``),
    ``experiment`` to ``MLFLOW_EXPERIMENT_NAME`` (created when missing), then
    MLflow's default experiment. Points are sent in batches from rank 0's
    writer thread at most every ``send_every_s`` seconds, and at every
    checkpoint and the end of the block. The run ends ``FINISHED`` with the
    block (a failed block too: the protocol does not say why it ends).
    """

    #: How long one call may take before the trail counts this logger as stuck and stops
    #: waiting for it: its first call imports the package and talks to the server.
    stuck_after_s = TRACKER_PATIENCE_S

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
        send_every_s: float = 1.0,
    ) -> None:
        require("mlflow", "mlflow")
        if not isinstance(send_every_s, (int, float)) or send_every_s < 0:
            raise ValueError(
                f"MLflowLogger(send_every_s={send_every_s!r}): pass seconds >= 0 "
                "(0 sends every ctx.log at once)."
            )
        self.record = record_path(log_dir, "mlflow")
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.send_every_s = float(send_every_s)
        #: The MLflow run this trail writes to (None until rank 0 starts or resumes it).
        self.run_id: str | None = None
        self._client: Any = None
        self._metric: Any = None  # mlflow.entities.Metric, once imported
        self._pending: list[Any] = []
        self._sent_at = time.monotonic()
        self._earlier: dict[tuple[str, int], list[float]] = {}
        self._warned = False

    def resume(self, step: int | None) -> None:
        self._send()
        client = self._connect()
        record = None if step is None else read_record(self.record)
        if step is not None and record is None:
            _missing_record("MLflowLogger", self.record, step)
        self._earlier = {}
        self._warned = False
        if step is None or record is None:
            run = client.create_run(
                self._experiment_id(client), run_name=self.run_name, tags=self.tags
            )
            self.run_id = run.info.run_id
            write_record(
                self.record,
                {
                    "run_id": self.run_id,
                    "experiment_id": run.info.experiment_id,
                    "tracking_uri": client.tracking_uri,
                },
            )
            return
        assert record is not None
        run_id = record["run_id"]
        try:
            run = client.get_run(run_id)
        except Exception as error:
            raise RuntimeError(
                f"MLflowLogger: {self.record} names the run {run_id}, which the tracking server "
                f"{client.tracking_uri} cannot give ({error}). Point tracking_uri at the server "
                f"that holds it (the file says {record.get('tracking_uri')!r}), or delete "
                f"{self.record} to start a new run."
            ) from error
        self.run_id = run_id
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, "ddpctx.resumed_after_step", str(step))
        for key in run.data.metrics:
            for point in client.get_metric_history(run_id, key):
                if point.step > step:
                    self._earlier.setdefault((key, point.step), []).append(point.value)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.run_id is None:
            self.resume(None)
        now_ms = int(time.time() * 1000)
        differing = []
        for name, value in metrics.items():
            earlier = self._earlier.get((name, step))
            if earlier:
                same = next((i for i, old in enumerate(earlier) if _same(old, value)), None)
                if same is not None:
                    del earlier[same]  # the killed attempt sent this very point: once is enough
                    continue
                differing.append((name, earlier[0], value))
            self._pending.append(self._metric(name, value, now_ms, step))
        if differing and not self._warned:
            self._warned = True
            shown = ", ".join(f"{name!r} ({old!r}, now {new!r})" for name, old, new in differing)
            warn_user(
                f"MLflowLogger: at step {step} the resumed run logs other values than the "
                f"attempt that was killed had already sent to MLflow run {self.run_id}: {shown}. "
                "MLflow cannot delete a metric point, so it shows both at such steps (the later "
                "one is this attempt's). A deterministic resume logs the same values and they "
                "appear once. This warning is given once per resume.",
                RuntimeWarning,
            )
        if len(self._pending) >= MLFLOW_BATCH or (
            time.monotonic() - self._sent_at >= self.send_every_s
        ):
            self._send()

    def log_hparams(self, params: dict[str, Any]) -> None:
        if self.run_id is None:
            self.resume(None)
        param = importlib.import_module("mlflow.entities").Param
        items = [param(key, value) for key, value in flat_params(params).items()]
        for start in range(0, len(items), MLFLOW_PARAM_BATCH):
            self._client.log_batch(
                self.run_id, params=items[start : start + MLFLOW_PARAM_BATCH], synchronous=True
            )

    def flush(self) -> None:
        self._send()

    def close(self) -> None:
        self._send()
        if self.run_id is not None:
            self._client.set_terminated(self.run_id, "FINISHED")
            self.run_id = None

    def _send(self) -> None:
        self._sent_at = time.monotonic()
        while self._pending:
            batch = self._pending[:MLFLOW_BATCH]
            self._client.log_batch(self.run_id, metrics=batch, synchronous=True)
            del self._pending[: len(batch)]

    def _connect(self) -> Any:
        if self._client is None:
            self._metric = importlib.import_module("mlflow.entities").Metric
            tracking = importlib.import_module("mlflow.tracking")
            self._client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _experiment_id(self, client: Any) -> str:
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"  # MLflow's "Default"
        found = client.get_experiment_by_name(name)
        if found is None:
            try:
                return str(client.create_experiment(name))
            except Exception:  # created meanwhile by another job
                found = client.get_experiment_by_name(name)
                if found is None:
                    raise
        return str(found.experiment_id)


class WandbLogger:
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

    #: How long one call may take before the trail counts this logger as stuck and stops
    #: waiting for it: its first call imports the package and talks to the server.
    stuck_after_s = TRACKER_PATIENCE_S

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

    def resume(self, step: int | None) -> None:
        self._finish()
        if self._wandb is None:
            self._wandb = importlib.import_module("wandb")
        record = None if step is None else read_record(self.record)
        if step is not None and record is None:
            _missing_record("WandbLogger", self.record, step)
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

    def close(self) -> None:
        self._finish()

    def _finish(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()


#: The names ``distributed(loggers=...)`` accepts for these trackers, and what builds each.
TRACKERS: dict[str, Any] = {"mlflow": MLflowLogger, "wandb": WandbLogger}
