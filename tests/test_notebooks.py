"""The notebooks run top to bottom (nbclient, a real kernel) and show what they promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env

# Starts its own processes (torchrun jobs, scripts, notebooks): the full tier only.
pytestmark = pytest.mark.slow

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")


def execute(name: str, tmp_path: Path) -> str:
    notebook = nbformat.read(REPO / "notebooks" / name, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            assert output["output_type"] != "error", (
                f"{name}: {output.get('ename')}: {output.get('evalue')}"
            )
            texts.append(output.get("text", "") + str(output.get("data", {}).get("text/plain", "")))
    return "\n".join(texts)


@pytest.mark.timeout(600)
def test_quickstart_trains_two_ranks_and_plots(tmp_path: Path) -> None:
    text = execute("quickstart.ipynb", tmp_path)
    assert "launcher: single | backend: gloo | device: cpu" in text
    assert "overlap between shards: 0 | samples covered: 2048" in text
    assert "RankError -> rank 1 failed: ValueError: corrupt shard on rank 1" in text
    notebook = nbformat.read(REPO / "notebooks" / "quickstart.ipynb", as_version=4)
    images = [
        o for c in notebook.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})
    ]
    assert images, "the committed notebook must carry its plots"


@pytest.mark.timeout(600)
def test_testing_notebook_shows_pass_fail_and_hang(tmp_path: Path) -> None:
    text = execute("testing.ipynb", tmp_path)
    assert "3 passed" in text
    assert "E   assert 1 == 0" in text
    assert "raised on rank 1 of 2" in text
    assert "did not finish within 3 s" in text
    assert "--- rank 0 ---" in text
    assert "1 failed, 1 passed" in text  # the session went on after the hang


def test_testing_notebook_without_pytest_stops_at_its_first_code_cell() -> None:
    notebook = nbformat.read(REPO / "notebooks" / "testing.ipynb", as_version=4)
    first = next(cell for cell in notebook.cells if cell.cell_type == "code")
    hide_pytest = "import sys\nsys.modules['pytest'] = None  # as if it were not installed\n"
    result = subprocess.run(
        [sys.executable, "-c", hide_pytest + first.source],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert result.returncode != 0
    assert "ModuleNotFoundError: testing.ipynb needs pytest" in result.stderr
    assert "pip install 'ddpctx[pytest]'" in result.stderr
