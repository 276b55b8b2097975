"""The equivalence matrix: the same script gives the same model every way it can run.

One small training script (tests/scripts/equivalence.py) runs as a float64
single-process reference without ddpctx, and with ddpctx as ``ctx.wrap`` and
``ctx.shard``, at every CPU ``precision=``, at 1 to 3 ranks, and with tensor
parallel at 2 x 2 ranks (``tp:32``: ``ctx.shard(tp_plan=, tp_size=2)``, whose
kill-and-resume test is in tests/test_tensor_parallel.py), uninterrupted and
SIGKILLed-and-resumed under ``torchrun --max-restarts=1`` (sync and async
saves, 0 and 2 loader workers). The global batch is fixed (12 samples split
over the ranks), so every world size reads the same batches in the same order.

What is asserted, cell by cell:

- **start**: right after ``ctx.wrap``/``ctx.shard`` every cell holds rank 0's
  initial weights (the reference's) bit for bit — in bfloat16 for
  ``"bf16-true"`` — whatever each rank built from its own seed;
- **final, against the float64 reference**: the largest absolute difference
  of any weight stays within :data:`TOLERANCE` for the precision (the
  weights are of order 0.4; float32 cells land within 1e-7 of the reference,
  bf16 autocast within 2e-3, bf16 weights within 1e-2);
- **resume**: a run killed after step 12 and resumed from its newest
  checkpoint ends bit-equal to the same cell run uninterrupted, and so does
  one with 2 loader workers (the data here has no randomness of its own, so
  workers change nothing);
- **exported weights**: ``ddpctx.load_weights`` of a cell's last checkpoint,
  in this plain process, equals the cell's final ``full_state_dict`` bit for
  bit, for ``ctx.wrap`` (a ``.pt``) and ``ctx.shard`` (a sharded ``.dcp``);
- **streams**: the ``:stream`` cells read the same samples from an
  ``IterableDataset``; they start and end as the map-style cells do, and a
  stream killed and resumed (0 and 2 workers, 2 and 3 ranks, ``ctx.wrap`` and
  ``ctx.shard``) ends bit-equal to the uninterrupted stream cell;
- **snapshots**: ``start`` is taken before training and must still hold the
  initial weights at the end, so a ``full_state_dict`` that returned a view
  of live parameters fails the start check;
- **watching**: every cell runs with the step timings and the straggler
  watcher on (the default); a killed-and-resumed run that also calls
  ``ctx.log`` every step ends bit-equal to the uninterrupted run without it,
  and its ``metrics.jsonl`` holds every step once;
- **real scripts**: the loops real scripts write (the script's ``--shapes``:
  a compiled model, the bare module to save/load, log-save-log at one step, its
  own batch function, a sample from the bare module in rank-zero work, the
  config logged after the resume, gradient accumulation with ``ctx.log`` at
  every micro-step), killed and resumed at 3 ranks, end
  bit-equal to the same loop uninterrupted, and every logger (jsonl, csv,
  TensorBoard) holds each step's metric once, with the uninterrupted values.

A new capability that changes how a script can run joins this matrix.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import REPO, child_env, patience, torchrun_command

SCRIPT = REPO / "tests" / "scripts" / "equivalence.py"
PRECISIONS = ("32", "bf16-mixed", "bf16-true")
MODES = ("wrap", "shard")
CELLS = [f"{mode}:{precision}" for mode in MODES for precision in PRECISIONS]
CELLS += [f"{mode}:32:stream" for mode in MODES]  # the same samples from an IterableDataset
WORLD_SIZES = (1, 2, 3)  # 3: DDP rebuilds its buckets differently from 3 ranks on
#: Tensor parallel (2 ranks per layer, FSDP2 over the other 2) runs at 4 ranks only: at 2
#: there is no data axis left, and 4 ranks on 2 cores cost ~12 s per run.
TP_RUNS = [("tp:32", 4)]
RUNS = [(cell, world_size) for cell in CELLS for world_size in WORLD_SIZES] + TP_RUNS
SAVE_EVERY = 5
KILL_AFTER = 12  # checkpoints every 5 steps, 24 steps in all: resumed from step 10 (or 5)

#: The largest absolute difference from the float64 reference each precision may show.
TOLERANCE = {"32": 1e-6, "bf16-mixed": 1e-2, "bf16-true": 4e-2}


def run_job(out: Path, *args: str, nproc: int, restarts: int = 0) -> None:
    """The script under torchrun (or a plain process for one rank), bounded in time."""
    if nproc == 1 and restarts == 0:
        command = [sys.executable, str(SCRIPT), str(out), *args]
    else:
        command = torchrun_command(
            SCRIPT,
            str(out),
            *args,
            nproc=nproc,
            launcher_args=("--standalone", f"--max-restarts={restarts}"),
        )
    result = subprocess.run(
        command,
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=patience(300),
    )
    assert result.returncode == 0, result.stderr[-4000:]


def result_of(out: Path, cell: str) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(out / cell.replace(":", "-") / "result.pt")
    return loaded


def largest_difference(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    assert sorted(state) == sorted(reference)
    return max((state[name].double() - reference[name]).abs().max().item() for name in reference)


def bit_equal(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> bool:
    return sorted(first) == sorted(second) and all(
        first[name].dtype == second[name].dtype and torch.equal(first[name], second[name])
        for name in first
    )


def every_cell(test: Callable[..., None]) -> Callable[..., None]:
    """One test per cell and world size (:data:`RUNS`), in the slow tier."""
    ids = [f"{cell}-{world_size}" for cell, world_size in RUNS]
    test = pytest.mark.parametrize(("cell", "world_size"), RUNS, ids=ids)(test)
    return pytest.mark.slow(test)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Every cell at every world size, uninterrupted; and the float64 reference."""
    root = tmp_path_factory.mktemp("matrix")
    run_job(root, "--reference", nproc=1)
    runs = {}
    for world_size in WORLD_SIZES:
        out = root / f"ws{world_size}"
        out.mkdir()
        run_job(out, "--cells", ",".join(CELLS), nproc=world_size)
        runs[world_size] = out
    for cell, world_size in TP_RUNS:
        out = root / f"ws{world_size}"
        out.mkdir(exist_ok=True)
        run_job(out, "--cells", cell, nproc=world_size)
        runs[world_size] = out
    runs[0] = root
    return runs


@pytest.fixture(scope="module")
def reference(matrix: dict[int, Path]) -> dict[str, dict[str, torch.Tensor]]:
    loaded: dict[str, dict[str, torch.Tensor]] = torch.load(matrix[0] / "reference.pt")
    return loaded


@every_cell
def test_every_way_of_running_starts_from_rank_0s_weights(
    matrix: dict[int, Path],
    reference: dict[str, dict[str, torch.Tensor]],
    cell: str,
    world_size: int,
) -> None:
    result = result_of(matrix[world_size], cell)
    assert result["world_size"] == world_size
    dtype = torch.bfloat16 if cell.endswith("bf16-true") else torch.float32
    expected = {name: value.to(dtype) for name, value in reference["start"].items()}
    differing = [
        name for name, value in expected.items() if not torch.equal(result["start"][name], value)
    ]
    assert not differing, f"{cell} at {world_size} ranks starts from other weights: {differing}"


@every_cell
def test_every_way_of_running_ends_near_the_float64_reference(
    matrix: dict[int, Path],
    reference: dict[str, dict[str, torch.Tensor]],
    cell: str,
    world_size: int,
) -> None:
    result = result_of(matrix[world_size], cell)
    assert result["steps"] == 24
    precision = cell.split(":")[1]
    difference = largest_difference(result["final"], reference["final"])
    assert difference <= TOLERANCE[precision], (
        f"{cell} at {world_size} ranks ends {difference:.3g} from the float64 reference "
        f"(tolerance {TOLERANCE[precision]})"
    )


@every_cell
def test_load_weights_of_every_cells_last_checkpoint_is_its_full_state_dict(
    matrix: dict[int, Path], cell: str, world_size: int
) -> None:
    from ddpctx import load_weights

    folder = matrix[world_size] / cell.replace(":", "-") / "checkpoints"
    weights = load_weights(folder)
    assert bit_equal(weights, result_of(matrix[world_size], cell)["final"]), (
        f"load_weights of {cell} at {world_size} ranks differs from its full_state_dict"
    )


# The 2-rank sync cells without workers (wrap:32, shard:32) are killed and resumed by
# test_logging_every_step_changes_nothing_and_survives_the_kill, which asserts the same and more.
KILLED = [
    pytest.param("wrap:32", 3, 2, False, id="wrap-3ranks-2workers"),
    pytest.param("wrap:bf16-mixed", 2, 0, False, id="wrap-bf16mixed-2ranks"),
    pytest.param("shard:32", 2, 2, True, id="shard-2ranks-async-2workers"),
    pytest.param("shard:bf16-mixed", 3, 0, True, id="shard-bf16mixed-3ranks-async"),
    pytest.param("wrap:32:stream", 2, 0, False, id="stream-wrap-2ranks"),
    pytest.param("wrap:32:stream", 3, 2, False, id="stream-wrap-3ranks-2workers"),
    pytest.param("shard:32:stream", 2, 2, False, id="stream-shard-2ranks-2workers"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("cell", "world_size", "workers", "async_save"), KILLED)
def test_a_killed_and_resumed_run_ends_bit_equal_to_an_uninterrupted_one(
    matrix: dict[int, Path],
    tmp_path: Path,
    cell: str,
    world_size: int,
    workers: int,
    async_save: bool,
) -> None:
    args = ["--cells", cell, "--workers", str(workers), "--kill-after", str(KILL_AFTER)]
    if async_save:
        args.append("--async-save")
    run_job(tmp_path, *args, nproc=world_size, restarts=1)
    resumed = result_of(tmp_path, cell)
    assert resumed["restart_count"] == 1, "the run was not killed and restarted"
    assert 0 < resumed["resumed_step"] <= KILL_AFTER, "the restarted run did not resume"
    whole = result_of(matrix[world_size], cell)
    uninterrupted = {name: value.double() for name, value in whole["final"].items()}
    assert bit_equal(resumed["final"], whole["final"]), (
        f"{cell} at {world_size} ranks, resumed from step {resumed['resumed_step']}, ends "
        f"{largest_difference(resumed['final'], uninterrupted):.3g} from the uninterrupted run"
    )


@pytest.mark.slow
@pytest.mark.parametrize("cell", ["wrap:32", "shard:32"])
def test_logging_every_step_changes_nothing_and_survives_the_kill(
    matrix: dict[int, Path], tmp_path: Path, cell: str
) -> None:
    args = ["--cells", cell, "--kill-after", str(KILL_AFTER), "--metrics"]
    run_job(tmp_path, *args, nproc=2, restarts=1)
    resumed = result_of(tmp_path, cell)
    assert resumed["restart_count"] == 1, "the run was not killed and restarted"
    assert bit_equal(resumed["final"], result_of(matrix[2], cell)["final"]), (
        f"{cell} with ctx.log every step ends away from the same run without it"
    )
    log = tmp_path / cell.replace(":", "-") / "log" / "metrics.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 25))
    # each attempt's first log comes before its first step is over: no timing yet, so
    # none is written (not 0 ms); every later line has one
    untimed = [line["step"] for line in lines if "timings/step_ms" not in line]
    assert len(untimed) <= 2, untimed
    assert all(line["timings/step_ms"] > 0 for line in lines if line["step"] not in untimed)


#: Real scripts' loops, killed after step 12 and resumed at 3 ranks: nanoGPT's shape (a
#: compiled model, the bare module to save/load, its own batch function, an eval logged
#: before the checkpoint and the train loss after it, the config logged after the load)
#: trains the very model of the matrix's ``wrap:32`` cell; accumulation trains another,
#: run whole for comparison.
REAL_SHAPES = [
    pytest.param("raw,ownbatch,logsavelog,config,compile,rankzero", id="nanogpt-shaped"),
    pytest.param("accum", id="accumulation-logging-every-micro-step"),
]


def trail_of(log_dir: Path) -> dict[str, list[tuple[int, str, float]]]:
    """Every (step, metric, value) each logger holds, as its reader sees it; timings left out.

    TensorBoard is read as TensorBoard shows it: a resumed writer's purge of the
    killed attempt's later steps applies.
    """
    jsonl = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    with (log_dir / "metrics.csv").open(newline="") as rows:
        table = list(csv.DictReader(rows))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    board = [
        (event.step, tag, float(make_ndarray(event.tensor_proto)))
        for tag in tags["tensors"]
        if tag != "config/text_summary" and not tag.startswith("timings/")
        for event in events.Tensors(tag)
    ] + [
        (event.step, tag, event.value)
        for tag in tags["scalars"]
        if not tag.startswith("timings/")
        for event in events.Scalars(tag)
    ]
    configs = (
        events.Tensors("config/text_summary") if "config/text_summary" in tags["tensors"] else []
    )
    return {
        "jsonl": sorted(
            (line["step"], key, value)
            for line in jsonl
            for key, value in line.items()
            if key != "step" and not key.startswith("timings/")
        ),
        "csv": sorted(
            (int(row["step"]), key, float(value))
            for row in table
            for key, value in row.items()
            if key != "step" and value != "" and not key.startswith("timings/")
        ),
        "tensorboard": sorted(board),
        "tensorboard config": [(event.step, "config", 0.0) for event in configs],
    }


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The accumulation loop at 3 ranks, uninterrupted (it trains another model)."""
    out = tmp_path_factory.mktemp("accumulated")
    run_job(out, "--cells", "wrap:32", "--shapes", "accum", nproc=3)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("shapes", REAL_SHAPES)
@pytest.mark.integration("tensorboard")  # its logging shapes write and read event files
def test_a_real_scripts_loop_killed_and_resumed_ends_as_it_would_have_and_logs_once(
    matrix: dict[int, Path], request: pytest.FixtureRequest, tmp_path: Path, shapes: str
) -> None:
    args = ["--cells", "wrap:32", "--shapes", shapes, "--kill-after", str(KILL_AFTER)]
    run_job(tmp_path, *args, nproc=3, restarts=1)
    resumed = result_of(tmp_path, "wrap:32")
    assert resumed["restart_count"] == 1, "the run was not killed and restarted"
    assert 0 < resumed["resumed_step"] <= KILL_AFTER, "the restarted run did not resume"
    whole = request.getfixturevalue("accumulated") if "accum" in shapes else matrix[3]
    expected = result_of(whole, "wrap:32")
    uninterrupted = {name: value.double() for name, value in expected["final"].items()}
    assert bit_equal(resumed["final"], expected["final"]), (
        f"--shapes {shapes} at 3 ranks, resumed from step {resumed['resumed_step']}, ends "
        f"{largest_difference(resumed['final'], uninterrupted):.3g} from the uninterrupted run"
    )
    if "accum" in shapes:
        assert trail_of(tmp_path / "wrap-32" / "log") == trail_of(whole / "wrap-32" / "log")
    if "logsavelog" not in shapes:
        return
    trail = trail_of(tmp_path / "wrap-32" / "log")
    expected_points = sorted(
        [(step, "loss") for step in range(1, 25)]
        + [(step, "eval/loss") for step in range(SAVE_EVERY, 25, SAVE_EVERY)]
    )
    for logger in ("jsonl", "csv", "tensorboard"):
        points = [(step, name) for step, name, _ in trail[logger]]
        assert points == expected_points, f"{logger} after the resume: {points}"
    assert len(trail["tensorboard config"]) == 1, trail["tensorboard config"]
    config = json.loads((tmp_path / "wrap-32" / "log" / "ddpctx-config.json").read_text())
    assert config["shapes"] == ["compile", "config", "logsavelog", "ownbatch", "rankzero", "raw"]
