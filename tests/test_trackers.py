"""MLflow and W&B loggers: one run across a kill and a resume, each step in it once.

MLflow is checked against a real tracking server (``mlflow server`` on a
loopback port with a SQLite store, started here and always stopped), read
back with ``MlflowClient.get_metric_history``. W&B runs in offline mode with
the real ``wandb`` library; its ``.wandb`` files are read back record by
record with W&B's own protobuf definitions (``wandb.proto``), as ``wandb
sync`` would upload them. Nothing reaches the network: W&B is offline,
MLflow's tracking URI is loopback, both trackers' telemetry is off, and a
proxy that answers nothing stands in for every other host.

The kill tests run ``tests/scripts/log_resume.py`` under ``torchrun
--max-restarts=1`` at 2 ranks, as the file loggers' test does: rank 1 is
SIGKILLed five steps after the checkpoint at step 19, and the restart logs on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpctx import distributed
from ddpctx.watch.loggers import make_loggers
from ddpctx.watch.trackers import (
    MLflowLogger,
    WandbLogger,
    flat_params,
    read_record,
    record_path,
)
from tests.helpers import REPO, child_env, patience, require_integration, torchrun_command

#: No network: offline W&B, no telemetry, and a dead proxy for any host but this one.
QUIET = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_ERROR_REPORTING": "false",
    "WANDB_PROJECT": "ddpctx-tests",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "http_proxy": "http://127.0.0.1:9",
    "https_proxy": "http://127.0.0.1:9",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
STEPS = 30  # log_resume.py: a checkpoint every 10 steps, rank 1 killed at step 24
CHECKPOINT_STEP = 19


@pytest.fixture(autouse=True)
def quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in QUIET.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def serving_mlflow(folder: Path, port: int) -> Iterator[str]:
    """``mlflow server`` on ``127.0.0.1:port`` over ``folder``'s SQLite store; always stopped.

    ``folder`` may be served again (a restarted server keeps its runs); its log is appended to.
    """
    uri = f"http://127.0.0.1:{port}"
    command = [
        *(sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)),
        *("--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}"),
        *("--default-artifact-root", str(folder / "artifacts"), "--workers", "1"),
    ]
    with open(folder / "server.log", "a") as log:
        server = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(**QUIET),
            cwd=folder,
            start_new_session=True,  # its workers in its group: stopped with it
        )
    try:
        deadline = time.monotonic() + patience(240)  # 20-90 s on a busy 2-core machine
        while not answers(uri + "/health"):
            assert server.poll() is None, (folder / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not answer in time"
            time.sleep(0.5)
        yield uri
    finally:
        stop_group(server)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real MLflow tracking server on a loopback port; its URI. Always stopped."""
    require_integration("mlflow")
    with serving_mlflow(tmp_path_factory.mktemp("mlflow"), free_port()) as uri:
        yield uri


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def stop_group(process: subprocess.Popen[Any]) -> None:
    """SIGTERM the group ``process`` leads, SIGKILL it after 5 s: nothing of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        os.killpg(process.pid, signal.SIGKILL)  # its workers too, if the leader went first
    process.wait(timeout=30)


def mlflow_points(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    history = MlflowClient(uri).get_metric_history(run_id, key)
    return sorted((point.step, point.value) for point in history)


def kill_and_restart(tmp_path: Path, loggers: str, **env: str) -> Path:
    """``log_resume.py`` under ``torchrun --max-restarts=1``; rank 1 is SIGKILLed once."""
    log_dir = tmp_path / "log"
    command = torchrun_command(
        REPO / "tests" / "scripts" / "log_resume.py",
        str(log_dir),
        str(tmp_path / "checkpoints"),
        str(STEPS),
        launcher_args=("--standalone", "--max-restarts=1"),
    )
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=patience(300),
        # Exactly once across the kill holds for what the checkpoint waited for: on a busy CI
        # runner a tracker's first send (its import, the run's creation) can take longer than
        # the default 5 s bound, which tests/test_tracker_outages.py checks on its own.
        env=child_env(LOGGERS=loggers, DDPCTX_TRACKER_WAIT=str(patience(60)), **QUIET, **env),
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exitcode: -9" in done.stderr  # the first attempt really was killed
    return log_dir


# -- MLflow ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.integration("mlflow")
def test_mlflow_keeps_one_run_with_every_step_once_after_a_sigkill_and_a_restart(
    tmp_path: Path, mlflow_server: str
) -> None:
    from mlflow.tracking import MlflowClient

    log_dir = kill_and_restart(
        tmp_path, "mlflow", MLFLOW_TRACKING_URI=mlflow_server, MLFLOW_EXPERIMENT_NAME="sigkill"
    )
    record = read_record(record_path(log_dir, "mlflow"))
    assert record is not None
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("sigkill")
    runs = client.search_runs([experiment.experiment_id])
    assert [run.info.run_id for run in runs] == [record["run_id"]]  # resumed, not a second run
    (run,) = runs
    assert mlflow_points(mlflow_server, run.info.run_id, "value") == [
        (step, step + 0.5) for step in range(STEPS)
    ]
    assert run.data.params == {"lr": "0.1", "steps": "30"}  # logged once, by the first attempt
    assert run.data.tags["ddpctx.resumed_after_step"] == str(CHECKPOINT_STEP)
    assert run.info.status == "FINISHED"


@pytest.mark.slow
@pytest.mark.distributed(world_size=1, init=False, isolated=True, timeout=240)
@pytest.mark.integration("mlflow")
def test_mlflow_resumed_blocks_skip_what_the_killed_attempt_sent_and_warn_about_other_values(
    tmp_path: Path, mlflow_server: str
) -> None:
    model = torch.nn.Linear(2, 1)
    log_dir, checkpoints = tmp_path / "log", tmp_path / "checkpoints"

    def logger() -> MLflowLogger:
        return MLflowLogger(log_dir, tracking_uri=mlflow_server, experiment="blocks", run_name="a")

    with distributed(log_dir=log_dir, loggers=(logger(),)) as ctx:
        wrapped = ctx.wrap(model)
        ctx.log_config({"optimizer": {"lr": 0.5, "betas": [0.9, 0.99]}})
        for step in range(6):
            ctx.log({"loss": float(step)})
            if step == 2:
                ctx.save_checkpoint(checkpoints, model=wrapped, step=step)
    first = read_record(record_path(log_dir, "mlflow"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distributed(log_dir=log_dir, loggers=(logger(),)) as ctx:
            wrapped = ctx.wrap(model)
            ctx.log_config({"optimizer": {"lr": 0.25}})  # a resumed run keeps the first config
            assert ctx.load_checkpoint(checkpoints, model=wrapped) == {"step": 2}
            ctx.log({"loss": 3.0})  # what the killed attempt sent: not sent again
            ctx.log({"loss": 40.0})  # another value: MLflow keeps both, and says so
            ctx.log({"loss": 5.0, "extra": 1.0})
            ctx.log({"loss": 66.0}, step=6)
            ctx.log({"loss": 7.0})  # past the killed attempt's steps: no more warnings
    # Only the resume's own warning: a tracker may also say the server was slow (a
    # checkpoint's bounded wait on a loaded machine), which names MLflowLogger too.
    said = [str(w.message) for w in caught if "the resumed run logs other values" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert re.search(r"at step 4 .*'loss' \(4\.0, now 40\.0\).*shows both", said[0])
    assert read_record(record_path(log_dir, "mlflow")) == first
    run_id = first["run_id"] if first else ""
    assert mlflow_points(mlflow_server, run_id, "loss") == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
        (4, 40.0),
        (5, 5.0),
        (6, 66.0),
        (7, 7.0),
    ]
    from mlflow.tracking import MlflowClient

    run = MlflowClient(mlflow_server).get_run(run_id)
    assert run.info.run_name == "a"
    assert run.data.params == {"optimizer/lr": "0.5", "optimizer/betas": "[0.9, 0.99]"}


@pytest.mark.slow
@pytest.mark.integration("mlflow")
def test_mlflow_without_its_run_record_starts_a_new_run_and_says_why(
    tmp_path: Path, mlflow_server: str
) -> None:
    log_dir = tmp_path / "log"
    logger = MLflowLogger(log_dir, tracking_uri=mlflow_server, experiment="lost", send_every_s=0)
    logger.resume(None)
    logger.log_metrics({"loss": 1.0}, step=0)
    first = logger.run_id
    record_path(log_dir, "mlflow").unlink()
    with pytest.warns(RuntimeWarning, match=r"checkpoint was taken at step 0, but .*mlflow-run"):
        logger.resume(0)
    logger.log_metrics({"loss": 2.0}, step=1)
    second = logger.run_id
    logger.close()
    assert first != second
    record = read_record(record_path(log_dir, "mlflow"))
    assert record is not None
    assert (record["run_id"], record["tracking_uri"]) == (second, mlflow_server)
    assert mlflow_points(mlflow_server, second or "", "loss") == [(1, 2.0)]


# -- W&B ------------------------------------------------------------------------------------


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of one ``.wandb`` file, as W&B's own protobuf messages.

    The file is W&B's transaction log: a 7-byte header (``:W&B``, magic 0xBEE1,
    version), then LevelDB-log framing in 32 KiB blocks -- each chunk a 7-byte
    header (CRC-32, length, type: full, first, middle or last) and its bytes.
    A chunk cut short by a kill ends the reading.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a .wandb file"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        if kind == 0 or len(chunk) < length:
            return
        position += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            yield record
        else:  # first, middle
            pending += chunk


def item_name(item: Any) -> str:
    """A history or config item's name: ``key``, or (wandb 0.31) its one-part ``nested_key``."""
    return str(item.key or "/".join(item.nested_key))


def wandb_attempts(log_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """Each offline attempt of run ``run_id`` under ``log_dir/wandb``, oldest first."""
    attempts = []
    for folder in sorted((log_dir / "wandb").glob(f"offline-run-*-{run_id}")):
        attempt: dict[str, Any] = {"runs": [], "rows": [], "config": {}}
        for record in wandb_records(folder / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                attempt["runs"].append(record.run)
            elif kind == "config":
                for item in record.config.update:
                    attempt["config"][item_name(item)] = json.loads(item.value_json)
            elif kind == "history":
                row = {item_name(i): json.loads(i.value_json) for i in record.history.item}
                attempt["rows"].append(row)
        attempts.append(attempt)
    return attempts


def as_wandb_shows(attempts: list[dict[str, Any]], metric: str) -> list[tuple[int, float]]:
    """The run's history once synced: each attempt rewound to its branch point, then extended."""
    shown: list[dict[str, Any]] = []
    for attempt in attempts:
        (run,) = attempt["runs"]
        if run.HasField("branch_point"):
            shown = [row for row in shown if row["_step"] <= run.branch_point.value]
        shown += attempt["rows"]
    return [(row["_step"], row[metric]) for row in shown if metric in row]


@pytest.mark.slow
@pytest.mark.integration("wandb")
def test_wandb_keeps_one_run_rewound_to_the_checkpoint_after_a_sigkill_and_a_restart(
    tmp_path: Path,
) -> None:
    log_dir = kill_and_restart(tmp_path, "wandb")
    record = read_record(record_path(log_dir, "wandb"))
    assert record is not None
    killed, resumed = wandb_attempts(log_dir, record["run_id"])  # one run id, two attempts
    (resumed_run,) = resumed["runs"]
    assert resumed_run.run_id == record["run_id"]
    assert resumed_run.branch_point.run == record["run_id"]
    assert (resumed_run.branch_point.metric, resumed_run.branch_point.value) == (
        "_step",
        CHECKPOINT_STEP,
    )
    assert as_wandb_shows([killed, resumed], "value") == [
        (step, step + 0.5) for step in range(STEPS)
    ]
    assert [row["_step"] for row in resumed["rows"]] == list(range(CHECKPOINT_STEP + 1, STEPS))
    assert {k: v for k, v in killed["config"].items() if k != "_wandb"} == {"lr": 0.1, "steps": 30}
    assert set(resumed["config"]) <= {"_wandb"}  # the config is never logged again


# In a rank process of its own: wandb's service threads outlive a run, and a later fork of
# this pytest worker (launch(), in a doctest) hung with them (CI).
@pytest.mark.slow
@pytest.mark.distributed(world_size=1, init=False, isolated=True, timeout=240)
@pytest.mark.integration("wandb")
def test_wandb_resumed_blocks_continue_the_run_from_the_checkpoint(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    log_dir, checkpoints = tmp_path / "log", tmp_path / "checkpoints"
    with distributed(log_dir=log_dir, loggers=("wandb",)) as ctx:
        wrapped = ctx.wrap(model)
        ctx.log_config({"lr": 0.5, "model": {"width": 8}})
        for step in range(6):
            ctx.log({"loss": float(step), "val": {"acc": step / 10}})
            if step == 2:
                ctx.save_checkpoint(checkpoints, model=wrapped, step=step)
    logger = WandbLogger(log_dir, name="resumed")
    with distributed(log_dir=log_dir, loggers=(logger,)) as ctx:
        wrapped = ctx.wrap(model)
        ctx.log_config({"lr": 0.25})
        assert ctx.load_checkpoint(checkpoints, model=wrapped) == {"step": 2}
        for step in range(3, 5):
            ctx.log({"loss": step * 10.0})
    record = read_record(record_path(log_dir, "wandb"))
    assert record is not None
    attempts = wandb_attempts(log_dir, record["run_id"])
    assert len(attempts) == 2
    assert as_wandb_shows(attempts, "loss") == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert as_wandb_shows(attempts, "val/acc") == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert attempts[0]["config"]["model"] == {"width": 8}
    assert "lr" not in attempts[1]["config"]


@pytest.mark.integration("wandb")
def test_wandb_refuses_the_arguments_it_chooses_itself(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"id=\.\.\..*the logger chooses the run"):
        WandbLogger(tmp_path, id="abc")


# -- both -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_a_missing_tracker_package_is_refused_before_the_block_starts_naming_the_extra(
    tracker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, tracker, None)  # as if it were not installed
    with pytest.raises(ImportError, match=rf"pip install ddpctx\[{tracker}\]"):
        make_loggers((tracker,), tmp_path)
    with (
        pytest.raises(ImportError, match=rf'pip install -e "\.\[{tracker}\]"'),
        distributed(log_dir=tmp_path, loggers=(tracker,)),
    ):
        pytest.fail("the block started without its logger's package")
    with pytest.raises(ValueError, match=r"no log_dir was given"):
        make_loggers((tracker,), None)


@settings(max_examples=40, deadline=None)
@given(
    st.recursive(
        st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.text(max_size=5)),
        lambda inner: st.dictionaries(st.text("abc", min_size=1, max_size=3), inner, max_size=3),
        max_leaves=10,
    )
)
def test_flat_params_keep_every_leaf_under_its_path_as_text(config: Any) -> None:
    nested = {"root": config}
    flat = flat_params(nested)

    def leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
        if isinstance(value, dict):
            for key, inner in value.items():
                yield from leaves(inner, f"{path}/{key}")
        else:
            yield path, value

    expected = dict(leaves(config, "root"))
    assert set(flat) == set(expected)
    for name, text in flat.items():
        value = expected[name]
        assert (text if isinstance(value, str) else json.loads(text)) == value
