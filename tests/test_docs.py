"""The documentation's examples run, so they cannot rot.

Every ```python block of README.md and docs/*.md is executed in a fresh
process (blocks marked ```python no-run are illustrations of code to avoid).
The documentation site builds with ``mkdocs build --strict`` and its API
reference covers every public name.
"""

from __future__ import annotations

import importlib.util
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
    assert any("ddpctx.launch(" in code for where, code in BLOCKS if where.startswith("README"))


@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[where for where, _ in BLOCKS])
@pytest.mark.slow
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
    if where.startswith("README") and "ddpctx.launch(" in code:  # the launch example prints
        assert result.stdout == "[0, 10]\n"


@pytest.mark.slow
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


API_PAGES = sorted((REPO / "docs" / "api").glob("*.md"))


@pytest.mark.parametrize("name", [n for n in ddpctx.__all__ if n != "__version__"])
def test_every_public_name_is_in_the_api_reference(name: str) -> None:
    directives = "".join(page.read_text() for page in API_PAGES)
    home = getattr(ddpctx, name).__module__
    assert f"::: {home}.{name}\n" in directives or f"- {name}\n" in directives, (
        f"ddpctx.{name} ({home}) is on no page of docs/api/"
    )


@pytest.mark.slow
def test_the_documentation_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocstrings", reason='the docs extra: pip install -e ".[docs]"')
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank_zero_only" in (site / "api" / "decorators" / "index.html").read_text()
    assert "Quickstart" in (site / "index.html").read_text()  # the README is the home page


def test_stand_alone_doctests_become_code_blocks_on_the_site() -> None:
    pytest.importorskip("griffe", reason='the docs extra: pip install -e ".[docs]"')
    spec = importlib.util.spec_from_file_location(
        "griffe_docstrings", REPO / "scripts" / "griffe_docstrings.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prompt = ">" * 3  # not a doctest of this file
    text = f"Gathers.\n\n{prompt} gather()\n[4, 4, 2]\n\nSee :class:`~ddpctx.DistContext`."
    assert module.markdown_docstring(text).splitlines() == [
        "Gathers.",
        "",
        "```pycon",
        f"{prompt} gather()",
        "[4, 4, 2]",
        "```",
        "",
        "See `DistContext`.",
    ]
