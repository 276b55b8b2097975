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
from functools import partial
from pathlib import Path
from typing import Any

from ddpctx.utils.atomic import fsync_directory, temporary_name
from ddpctx.utils.warn import warn_user
from ddpctx.watch.servers import (
    BACKLOG,
    REQUEST_S,
    TRACKER_WAIT_S,
    Server,
    is_http,
    unreachable,
)

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
    checkpoint and the end of the block. The run ends ``FINISHED``,
    ``FAILED`` (the block raised) or ``KILLED`` (Ctrl-C, a signal).

    A server reached over HTTP is probed as the block starts (an unreachable
    one is said at once) and sent each batch in one request of at most
    :data:`~ddpctx.watch.servers.REQUEST_S`, with no retry inside it: while it
    does not answer, points wait on rank 0 and go when it answers
    (:mod:`ddpctx.watch.servers`). :attr:`unsent` counts what it lacks.
    """

    #: How long one call may take before the trail counts this logger as stuck and stops
    #: waiting for it: its first call imports the package and talks to the server.
    stuck_after_s = TRACKER_PATIENCE_S
    #: The most a checkpoint waits for this logger (the end of the block: three times this).
    wait_s = TRACKER_WAIT_S

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
        self.server = Server("MLflowLogger", tracking_uri)
        self._client: Any = None
        self._metric: Any = None  # mlflow.entities.Metric, once imported
        self._pending: list[Any] = []
        self._dropped = 0  # points beyond BACKLOG while the server did not answer
        self._sent_at = time.monotonic()
        self._earlier: dict[tuple[str, int], list[float]] = {}
        self._warned = False
        self._resume: tuple[int | None] | None = None  # asked, not yet done on the server
        self._status = "FINISHED"
        self._params: dict[str, Any] | None = None  # log_hparams before the run was open

    @property
    def unsent(self) -> int:
        """Points this logger was given that its server has not confirmed."""
        return len(self._pending) + self._dropped

    def connect(self) -> None:
        """As the block starts: say at once when an HTTP tracking server does not answer."""
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.server.uri = uri
        why = unreachable(uri) if uri is not None and is_http(uri) else None
        if why is not None:
            self.server.failed(why, 0, at_start=True)

    def resume(self, step: int | None) -> None:
        if self.run_id is not None:
            self._send(self.wait_s)
        self._resume = (step,)
        self.run_id = None
        self._earlier = {}
        self._warned = False
        self._open()

    def write_points(self, points: list[tuple[int, dict[str, float]]]) -> None:
        """A batch of points, sent at most once (every ``send_every_s``)."""
        if self._resume is None and self.run_id is None:
            self.resume(None)
        if self._metric is None:
            self._metric = importlib.import_module("mlflow.entities").Metric
        now_ms = int(time.time() * 1000)
        new = [
            self._metric(k, v, now_ms, step) for step, metrics in points for k, v in metrics.items()
        ]
        # Before the run is open, its points are checked against the killed attempt's at _open.
        self._pending += self._unseen(new) if self.run_id is not None else new
        if len(self._pending) > BACKLOG:
            self._dropped += len(self._pending) - BACKLOG
            del self._pending[: len(self._pending) - BACKLOG]
        if len(self._pending) >= MLFLOW_BATCH or (
            time.monotonic() - self._sent_at >= self.send_every_s
        ):
            self._send(REQUEST_S)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.write_points([(step, metrics)])

    def tick(self) -> None:
        """While idle: send what waits when its time has come (a server that came back)."""
        if self._pending and time.monotonic() - self._sent_at >= self.send_every_s:
            self._send(REQUEST_S)

    def log_hparams(self, params: dict[str, Any]) -> None:
        if self._resume is None and self.run_id is None:
            self.resume(None)
        self._params = params
        if self.run_id is not None:  # else sent when the server answers (_open)
            self._send_params()

    def _send_params(self) -> None:
        params, self._params = self._params, None
        if params is None:
            return
        param = importlib.import_module("mlflow.entities").Param
        items = [param(key, value) for key, value in flat_params(params).items()]
        for start in range(0, len(items), MLFLOW_PARAM_BATCH):
            self._client.log_batch(
                self.run_id, params=items[start : start + MLFLOW_PARAM_BATCH], synchronous=True
            )

    def flush(self) -> None:
        self._send(self.wait_s)

    def ended(self, how: str) -> None:
        """How the block ended (``finished``, ``failed``, ``killed``): the run's final status."""
        self._status = {"failed": "FAILED", "killed": "KILLED"}.get(how, "FINISHED")

    def close(self) -> None:
        self._send(self.wait_s)
        run_id, self.run_id, self._resume = self.run_id, None, None
        if run_id is None:
            return
        try:
            if not self.server.ready():
                raise OSError("it did not answer")
            self._post(
                "runs/update",
                {"run_id": run_id, "status": self._status, "end_time": int(time.time() * 1000)},
                lambda: self._client.set_terminated(run_id, self._status),
            )
        except Exception as error:
            if not _outage(error):
                raise
            warn_user(
                f"MLflowLogger: the MLflow run {run_id} on {self.server.uri} could not be marked "
                f"{self._status} ({error}): the server shows it RUNNING until it is. Once the "
                f'server answers, run: python -c "from mlflow.tracking import MlflowClient; '
                f"MlflowClient('{self.server.uri}').set_terminated('{run_id}', "
                f"'{self._status}')\"",
                RuntimeWarning,
            )

    def _open(self) -> bool:
        """Start or resume the run on the server, if it answers (False: not yet)."""
        if self.run_id is not None:
            return True
        if self._resume is None or not self.server.ready():
            return False
        uri = self.server.uri
        why = unreachable(uri) if uri is not None and is_http(uri) else None
        if why is not None:  # MlflowClient's own calls retry for minutes: never into a dead one
            self.server.failed(why, self.unsent)
            return False
        try:
            self._start_run(self._resume[0])
        except Exception as error:
            if not _outage(error):
                raise
            self.server.failed(error, self.unsent)
            return False
        self._pending = self._unseen(self._pending)
        self._send_params()
        return True

    def _start_run(self, step: int | None) -> None:
        client = self._connect()
        record = None if step is None else read_record(self.record)
        if step is not None and record is None:
            _missing_record("MLflowLogger", self.record, step)
        if step is None or record is None:
            run = client.create_run(
                self._experiment_id(client), run_name=self.run_name, tags=self.tags
            )
            write_record(
                self.record,
                {
                    "run_id": run.info.run_id,
                    "experiment_id": run.info.experiment_id,
                    "tracking_uri": client.tracking_uri,
                },
            )
            self.run_id = run.info.run_id
            return
        run_id = record["run_id"]
        try:
            run = client.get_run(run_id)
        except Exception as error:
            if _outage(error):
                raise
            raise RuntimeError(
                f"MLflowLogger: {self.record} names the run {run_id}, which the tracking server "
                f"{client.tracking_uri} cannot give ({error}). Point tracking_uri at the server "
                f"that holds it (the file says {record.get('tracking_uri')!r}), or delete "
                f"{self.record} to start a new run."
            ) from error
        client.update_run(run_id, status="RUNNING")
        client.set_tag(run_id, "ddpctx.resumed_after_step", str(step))
        earlier: dict[tuple[str, int], list[float]] = {}
        for key in run.data.metrics:
            for point in client.get_metric_history(run_id, key):
                if point.step > step:
                    earlier.setdefault((key, point.step), []).append(point.value)
        self._earlier = earlier
        self.run_id = run_id

    def _unseen(self, points: list[Any]) -> list[Any]:
        """``points`` less those the killed attempt already sent (warned once if values differ)."""
        if not self._earlier:
            return points
        kept, differing = [], []
        for point in points:
            earlier = self._earlier.get((point.key, point.step))
            if earlier:
                same = next((i for i, old in enumerate(earlier) if _same(old, point.value)), None)
                if same is not None:
                    del earlier[same]  # the killed attempt sent this very point: once is enough
                    continue
                differing.append(point)
            kept.append(point)
        if differing and not self._warned:
            self._warned = True
            step = differing[0].step
            shown = ", ".join(
                f"{p.key!r} ({self._earlier[(p.key, p.step)][0]!r}, now {p.value!r})"
                for p in differing
                if p.step == step
            )
            warn_user(
                f"MLflowLogger: at step {step} the resumed run logs other values than the "
                f"attempt that was killed had already sent to MLflow run {self.run_id}: {shown}. "
                "MLflow cannot delete a metric point, so it shows both at such steps (the later "
                "one is this attempt's). A deterministic resume logs the same values and they "
                "appear once. This warning is given once per resume.",
                RuntimeWarning,
            )
        return kept

    def _send(self, within: float) -> None:
        """Send what waits, for at most about ``within`` seconds; an outage keeps it waiting."""
        self._sent_at = time.monotonic()
        end = self._sent_at + within
        if not self._pending or not self._open():
            return
        waited = self.server.down_since is not None
        count = len(self._pending)
        while self._pending:
            left = end - time.monotonic()
            if left <= 0:
                return
            batch = self._pending[:MLFLOW_BATCH]
            body = {"run_id": self.run_id, "metrics": [_metric_json(m) for m in batch]}
            try:
                self._post(
                    "runs/log-batch",
                    body,
                    partial(self._client.log_batch, self.run_id, metrics=batch, synchronous=True),
                    timeout=min(REQUEST_S, max(left, 0.5)),
                )
            except Exception as error:
                if not _outage(error):
                    raise
                self.server.failed(error, self.unsent)
                return
            del self._pending[: len(batch)]
        if waited:
            self.server.answered(count)

    def _post(
        self, path: str, body: dict[str, Any], local: Any, timeout: float = REQUEST_S
    ) -> None:
        """One request to an HTTP server (``timeout``, no retry); ``local()`` for a local store."""
        uri = self.server.uri
        if uri is None or not is_http(uri):
            local()
            return
        rest = importlib.import_module("mlflow.utils.rest_utils")
        creds = importlib.import_module("mlflow.utils.credentials").get_default_host_creds(uri)
        endpoint = f"/api/2.0/mlflow/{path}"
        try:
            response = rest.http_request(
                creds,
                endpoint,
                "POST",
                max_retries=0,
                backoff_factor=0,
                timeout=timeout,
                raise_on_status=False,
                json=body,
            )
        except Exception as error:
            raise _Outage(str(error)) from error
        if response.status_code >= 500 or response.status_code == 429:
            raise _Outage(f"HTTP {response.status_code} from {endpoint}")
        rest.verify_rest_response(response, endpoint)

    def _connect(self) -> Any:
        if self._client is None:
            self._metric = importlib.import_module("mlflow.entities").Metric
            tracking = importlib.import_module("mlflow.tracking")
            self._client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
            self.server.uri = self._client.tracking_uri
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


class _Outage(Exception):
    """The tracking server did not answer one request (down, too slow, or a 5xx)."""


def _outage(error: BaseException) -> bool:
    """Whether ``error`` says the server did not answer (not that it refused the request)."""
    if isinstance(error, (_Outage, OSError)):
        return True
    status = getattr(error, "get_http_status_code", None)
    if type(error).__name__ == "RestException" and callable(status):
        return int(status()) >= 500
    return type(error).__name__ == "MlflowException" and "API request to" in str(error)


def _metric_json(metric: Any) -> dict[str, Any]:
    value = float(metric.value)
    shown: Any = (
        value
        if math.isfinite(value)
        else ("NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity"))
    )
    return {"key": metric.key, "value": shown, "timestamp": metric.timestamp, "step": metric.step}


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
    #: The most a checkpoint waits for this logger (the end of the block: three times this).
    wait_s = TRACKER_WAIT_S

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
        self._exit_code = 0

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
