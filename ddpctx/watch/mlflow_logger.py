"""MLflow as a ``ctx.log`` logger: one run across a kill and a resume; a server it never waits on.

:class:`MLflowLogger` (``distributed(loggers=("mlflow",))``, or built with
arguments) follows the :class:`~ddpctx.watch.loggers.Logger` protocol, called
on rank 0 only, from the trail's writer thread. Contract:

- ``resume(None)`` starts a new run and records its id in ``log_dir``
  (``mlflow-run.json``, :mod:`ddpctx.watch.runrecord`); ``resume(step)``
  continues the recorded run, tagged ``ddpctx.resumed_after_step``.
- MLflow cannot delete a metric point. The resumed attempt reads the run's
  points after ``step`` and does not send a point that is already there
  with the same value (a deterministic resume recomputes exactly those), so
  each step has its value once. A value that differs is sent too, with a
  warning naming the metric and steps: MLflow then shows both.
- ``log_hparams``: MLflow params (nested names joined with ``/``, values as
  text), once per run.
- ``flush()`` (at every checkpoint) sends what waits, for at most
  ``wait_s`` (:data:`~ddpctx.watch.servers.TRACKER_WAIT_S`); the run ends
  ``FINISHED``, ``FAILED`` or ``KILLED`` as the block did.
- A server reached over HTTP gets one request of at most
  :data:`~ddpctx.watch.servers.REQUEST_S` per batch, with no retry inside it;
  while it does not answer, points wait on rank 0 and go when it answers
  (:mod:`ddpctx.watch.servers`). :attr:`MLflowLogger.unsent` counts what it
  lacks, for the exact count at the end of the block, and
  :attr:`MLflowLogger.maybe_held` those of them sent without an answer in
  time (the server may hold them); once abandoned it sends nothing more.

Why one module: the run's life on the server (open, resume, dedupe, close)
and the count of what the server lacks change together at every send; its
REST wire and run record already live apart.
"""

from __future__ import annotations

import importlib
import math
import os
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

from ddpctx.utils.warn import warn_user
from ddpctx.watch.mlflow_rest import is_outage, metric_json, post
from ddpctx.watch.runrecord import (
    flat_params,
    missing_record,
    read_record,
    record_path,
    require,
    write_record,
)
from ddpctx.watch.servers import (
    BACKLOG,
    REQUEST_S,
    RemoteTracker,
    Server,
    is_http,
    unreachable,
)

#: The most metric points MLflow takes in one ``log_batch`` (its server's limit).
MLFLOW_BATCH = 1000
#: The most params MLflow takes in one ``log_batch``.
MLFLOW_PARAM_BATCH = 100


def _same(first: float, second: float) -> bool:
    return first == second or (math.isnan(first) and math.isnan(second))


class MLflowLogger(RemoteTracker):
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
        super().__init__()
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
        # Of the unsent points, those a request without an answer may have stored all the same:
        self._unanswered = 0  # at the front of _pending (sent, no reply in time)
        self._dropped_unanswered = 0  # among _dropped
        self._in_flight = 0  # the request being sent now
        self._abandoned = False  # ddpctx stopped waiting for it: send nothing more
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

    @property
    def maybe_held(self) -> int:
        """Of the :attr:`unsent` points, those its server may hold all the same.

        They went out in a request that got no answer in time (or is being
        sent now): the server may have stored them, or not.
        """
        front = max(self._unanswered, self._in_flight)
        return min(len(self._pending), front) + self._dropped_unanswered

    def abandon(self) -> None:
        """ddpctx stopped waiting for this logger: it sends nothing more once its request ends."""
        self._abandoned = True

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
            over = len(self._pending) - BACKLOG
            self._dropped += over
            moved = min(over, self._unanswered)
            self._dropped_unanswered += moved
            self._unanswered -= moved
            del self._pending[:over]
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
            if not is_outage(error):
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
            if not is_outage(error):
                raise
            self.server.failed(error, self.unsent)
            return False
        self._pending = self._unseen(self._pending)
        self._unanswered = min(self._unanswered, len(self._pending))
        self._send_params()
        return True

    def _start_run(self, step: int | None) -> None:
        client = self._connect()
        record = None if step is None else read_record(self.record)
        if step is not None and record is None:
            missing_record("MLflowLogger", self.record, step)
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
            if is_outage(error):
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
        while self._pending and not self._abandoned:
            left = end - time.monotonic()
            if left <= 0:
                return
            batch = self._pending[:MLFLOW_BATCH]
            body = {"run_id": self.run_id, "metrics": [metric_json(m) for m in batch]}
            self._in_flight = len(batch)
            try:
                self._post(
                    "runs/log-batch",
                    body,
                    partial(self._client.log_batch, self.run_id, metrics=batch, synchronous=True),
                    timeout=min(REQUEST_S, max(left, 0.5)),
                )
            except Exception as error:
                if not is_outage(error):
                    raise
                if getattr(error, "maybe_delivered", False):
                    self._unanswered = max(self._unanswered, len(batch))
                self.server.failed(error, self.unsent)
                return
            finally:
                self._in_flight = 0
            del self._pending[: len(batch)]
            self._unanswered = max(0, self._unanswered - len(batch))
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
        post(uri, path, body, timeout)

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
