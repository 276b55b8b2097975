"""MLflow's REST API, one request at a time: a limit on each, no retry inside it.

MLflow's own client retries a server that does not answer for about two
minutes; the MLflow logger (:mod:`ddpctx.watch.mlflow_logger`) must never
wait that long, so its sends go through :func:`post`. Contract:

- :func:`post` sends one ``POST /api/2.0/mlflow/<path>`` with ``timeout``
  seconds and no retry. A server that does not answer (refused, timed out,
  a 5xx or 429) is :class:`Outage`; a request it refuses is MLflow's own
  error, as its client raises it.
- An :class:`Outage` says whether the request may have reached the server
  all the same (``maybe_delivered``: sent, no reply in time), so a count of
  lost points can say which of them the server may hold.
- :func:`is_outage` tells an outage (the points wait and are sent again)
  from a refusal (the logger is dropped with a warning), for errors of
  :func:`post` and of MLflow's client alike.
- :func:`metric_json` is one metric point as the REST API takes it
  (non-finite values spelt as MLflow's JSON spells them).

Example:
    >>> from types import SimpleNamespace
    >>> metric_json(SimpleNamespace(key="loss", value=float("nan"), timestamp=1, step=2))
    {'key': 'loss', 'value': 'NaN', 'timestamp': 1, 'step': 2}
    >>> is_outage(Outage("timed out")), is_outage(ValueError("bad"))
    (True, False)
"""

from __future__ import annotations

import importlib
import math
from typing import Any


def post(uri: str, path: str, body: dict[str, Any], timeout: float) -> None:
    """One request to the MLflow server at ``uri`` (``timeout`` seconds, no retry)."""
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
        raise Outage(str(error), maybe_delivered=not _never_connected(error)) from error
    if response.status_code >= 500 or response.status_code == 429:
        raise Outage(f"HTTP {response.status_code} from {endpoint}", maybe_delivered=False)
    rest.verify_rest_response(response, endpoint)


class Outage(Exception):
    """The tracking server did not answer one request (down, too slow, or a 5xx).

    ``maybe_delivered``: the request may have reached the server all the same
    (sent, and no reply in time); False when no connection was made or the
    server answered that it failed.
    """

    def __init__(self, message: str, *, maybe_delivered: bool = True) -> None:
        super().__init__(message)
        self.maybe_delivered = maybe_delivered


def _never_connected(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) says no connection to the server was made."""
    seen: BaseException | None = error
    for _ in range(8):  # requests wraps urllib3's error, which wraps the socket's
        if seen is None:
            return False
        if isinstance(seen, (ConnectionRefusedError, ConnectionAbortedError)):
            return True
        if type(seen).__name__ in ("NewConnectionError", "NameResolutionError"):
            return True
        if "Failed to establish a new connection" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def is_outage(error: BaseException) -> bool:
    """Whether ``error`` says the server did not answer (not that it refused the request)."""
    if isinstance(error, (Outage, OSError)):
        return True
    status = getattr(error, "get_http_status_code", None)
    if type(error).__name__ == "RestException" and callable(status):
        return int(status()) >= 500
    return type(error).__name__ == "MlflowException" and "API request to" in str(error)


def metric_json(metric: Any) -> dict[str, Any]:
    """One metric point as MLflow's REST API takes it."""
    value = float(metric.value)
    shown: Any = (
        value
        if math.isfinite(value)
        else ("NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity"))
    )
    return {"key": metric.key, "value": shown, "timestamp": metric.timestamp, "step": metric.step}
