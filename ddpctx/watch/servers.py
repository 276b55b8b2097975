"""A tracking server outside the job: how long rank 0 waits for it, and how an outage is said.

A tracker (MLflow's server, W&B's) is reached over the network from rank 0's
writer thread. Whatever it does -- down at the start, killed mid-run, slow --
training and checkpoints wait for it a bounded time only. Contract:

- :data:`TRACKER_WAIT_S`: a checkpoint waits at most this long for a
  tracker's flush (``wait_s`` on the logger; :mod:`ddpctx.watch.lanes`
  enforces it), the end of the block at most three times as long (send
  the rest, mark the run), then goes on; a step never waits for it.
  ``DDPCTX_TRACKER_WAIT`` (seconds) sets another bound: points a checkpoint
  did not wait for are lost if the job is killed before the server got them.
- One request to the server, and a probe of its health, is given
  :data:`REQUEST_S`, with no retry inside it: a slow server that answers
  within it is up. A failed send leaves its points waiting, and they are
  sent again once the server answers (a probe of its ``/health`` every
  :data:`RETRY_S`, never a resend into a server that does not answer).
- :class:`Server` says each outage once (naming the URI and the fix) and
  its end; at the start of the block an unreachable server is said at once.

The points a tracker never confirmed are counted by the logger
(``unsent``); the lane adds the points it never handed over, so the count
at the end of the block is what the server lacks.

Example:
    >>> is_http("http://127.0.0.1:5000"), is_http("sqlite:///mlflow.db"), is_http(None)
    (True, False, False)
    >>> outcome(None), outcome(ValueError("x")), outcome(KeyboardInterrupt())
    ('finished', 'failed', 'killed')
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request

from ddpctx.utils.warn import warn_user
from ddpctx.watch.runrecord import TRACKER_PATIENCE_S

#: The most a checkpoint waits for a tracker (the end of the block: three times this).
TRACKER_WAIT_S = 5.0
#: One request's limit; a request that takes longer counts as failed and is sent again later.
REQUEST_S = 5.0
#: A probe of a server's health: its limit, one request's (a server that answers its
#: requests slowly is up; a shorter probe called a 2 s server down and sent it nothing).
PROBE_S = REQUEST_S
#: Seconds a checkpoint waits for a tracker instead of :data:`TRACKER_WAIT_S`.
WAIT_VARIABLE = "DDPCTX_TRACKER_WAIT"


def tracker_wait_s() -> float:
    """The most a checkpoint waits for a tracker: ``$DDPCTX_TRACKER_WAIT``, else the default.

    A longer wait trades checkpoint latency for completeness: a point a
    checkpoint did not wait for is lost if the job is then killed before the
    server got it (a resumed run logs only the steps after the checkpoint).
    """
    value = os.environ.get(WAIT_VARIABLE)
    if value is None or value == "":
        return TRACKER_WAIT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(
            f"{WAIT_VARIABLE}={value!r} is not a positive number of seconds. Set it to how long "
            f"a checkpoint may wait for a tracking server (e.g. {WAIT_VARIABLE}=30), or unset "
            f"it for the default {TRACKER_WAIT_S:g} s."
        )
    return seconds


class RemoteTracker:
    """What the MLflow and W&B loggers share: how long the trail waits for one of them."""

    #: How long one call may take before the trail counts this logger as stuck and stops
    #: waiting for it: its first call imports the package and talks to the server.
    stuck_after_s = TRACKER_PATIENCE_S
    #: The most a checkpoint waits for this logger (the end of the block: three times this).
    wait_s = TRACKER_WAIT_S

    def __init__(self) -> None:
        self.wait_s = tracker_wait_s()  # DDPCTX_TRACKER_WAIT, read when the logger is made


#: How often a server that does not answer is probed again.
RETRY_S = 5.0
#: Points a logger keeps for a server that does not answer; older ones beyond it are counted.
BACKLOG = 100_000


def is_http(uri: str | None) -> bool:
    """Whether ``uri`` is a server reached over HTTP (not a local store)."""
    return uri is not None and uri.lower().startswith(("http://", "https://"))


def unreachable(uri: str) -> str | None:
    """Why the server at ``uri`` does not answer its ``/health`` (None: it answers)."""
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=PROBE_S) as response:
            status = int(response.status)
    except urllib.error.HTTPError as error:
        status = int(error.code)
    except (OSError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None if status < 500 else f"HTTP {status}"


def outcome(error: BaseException | None) -> str:
    """How a block ended: ``finished``, ``failed`` (it raised) or ``killed`` (Ctrl-C, a signal)."""
    if error is None or (isinstance(error, SystemExit) and error.code in (None, 0)):
        return "finished"
    return "failed" if isinstance(error, Exception) else "killed"


class Server:
    """One tracking server as a logger sees it: up, or down since when (said once per outage)."""

    def __init__(self, name: str, uri: str | None) -> None:
        self.name = name
        self.uri = uri
        self.down_since: float | None = None
        self._retry_at = 0.0

    def ready(self) -> bool:
        """May a request go now? While down, only when a probe (every :data:`RETRY_S`) answers."""
        if self.down_since is None:
            return True
        now = time.monotonic()
        if now < self._retry_at:
            return False
        why = unreachable(self.uri) if self.uri is not None and is_http(self.uri) else None
        if why is not None:
            self._retry_at = time.monotonic() + RETRY_S
            return False
        return True

    def failed(self, why: object, waiting: int, at_start: bool = False) -> None:
        """A request failed (or the probe at the start): the server is down; said once."""
        self._retry_at = time.monotonic() + RETRY_S
        if self.down_since is not None:
            return
        self.down_since = time.monotonic()
        when = "at the start of the block" if at_start else "now"
        warn_user(
            f"{self.name}: the tracking server {self.uri} does not serve {when} (it does not "
            f"answer, or answers with a server error: {why}). "
            f"Training goes on: its points wait on rank 0 ({waiting} so far, up to {BACKLOG}) "
            f"and are sent when it answers (tried every {RETRY_S:g} s); checkpoints wait for "
            f"it at most {tracker_wait_s():g} s. Start the server, or point tracking_uri= / "
            "MLFLOW_TRACKING_URI at one that runs.",
            RuntimeWarning,
        )

    def answered(self, sent: int) -> None:
        """A request went through: an outage, if any, is over (said)."""
        if self.down_since is None:
            return
        seconds = time.monotonic() - self.down_since
        self.down_since = None
        warn_user(
            f"{self.name}: the tracking server {self.uri} answers again after {seconds:.0f} s; "
            f"the {sent} points that waited for it are sent.",
            RuntimeWarning,
        )
