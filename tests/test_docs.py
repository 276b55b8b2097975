"""The documentation's examples run, so they cannot rot.

Every ```python block of README.md and docs/*.md is executed in a fresh
process (blocks marked ```python no-run are illustrations of code to avoid).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import ddpctx
from tests.helpers import REPO, child_env, run_torchrun

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def python_blocks() -> list[tuple[str, str]]:
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        for number, match in enumerate(BLOCK.finditer(text), start=1):
            found.append((f"{document.name}#{number}", match.group(1)))
    return found


BLOCKS = python_blocks()


def test_the_documents_have_examples() -> None:
    assert len(BLOCKS) >= 7


@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[where for where, _ in BLOCKS])
def test_example_runs(where: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, f"{where} failed:\n{result.stderr[-3000:]}"


def test_the_first_readme_example_runs_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[0][1])
    result = run_torchrun(script, nproc=2, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("'count': 128") == 1  # reduced over both ranks, printed once


@pytest.mark.parametrize("name", [n for n in ddpctx.__all__ if n != "__version__"])
def test_every_public_name_has_a_docstring_with_an_example(name: str) -> None:
    documentation = getattr(ddpctx, name).__doc__ or ""
    assert ">>>" in documentation or "Example" in documentation, f"ddpctx.{name} has no example"
