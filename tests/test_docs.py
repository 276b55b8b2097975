"""The documentation's examples run, so they cannot rot.

Every ```python block of README.md and of every page under docs/ is executed
in a fresh process (blocks marked ```python no-run are illustrations of code to
avoid); a block followed at once by a ```text block must print that text, and
a block of pytest tests must pass under pytest. The documentation site builds
with ``mkdocs build --strict``, its API reference covers every public name and
shows users none of the maintainers' notes, and the README stays a front page.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

import ddpctx
from tests.helpers import REPO, build_site, child_env, run_torchrun

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)
PRINTS = re.compile(r"\n\n```text\n(.*?)^```$", re.DOTALL | re.MULTILINE)
GUIDES = [
    *sorted((REPO / "docs" / "guides").glob("*.md")),
    REPO / "docs" / "migrating-from-training-utils.md",
]


def name_of(document: Path) -> str:
    return document.relative_to(REPO).as_posix()


def python_blocks() -> list[tuple[str, str]]:
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        for number, match in enumerate(BLOCK.finditer(text), start=1):
            found.append((f"{name_of(document)}#{number}", match.group(1)))
    return found


def printed_outputs() -> dict[str, str]:
    """Each example followed at once by a ```text block: what it must print."""
    found = {}
    for document in DOCUMENTS:
        text = document.read_text()
        for number, match in enumerate(BLOCK.finditer(text), start=1):
            output = PRINTS.match(text, match.end())
            if output is not None:
                found[f"{name_of(document)}#{number}"] = output.group(1)
    return found


BLOCKS = python_blocks()
OUTPUTS = printed_outputs()


def is_a_test_file(code: str) -> bool:
    """A page's example of pytest tests: run by pytest, not as a script."""
    return "@pytest.mark.distributed" in code


#: How an example shows that it runs against a package of the integrations extra.
INTEGRATIONS = {
    "mlflow": re.compile(r"mlflow", re.IGNORECASE),  # MLflowLogger too
    "wandb": re.compile(r"wandb", re.IGNORECASE),  # WandbLogger too
    "tensorboard": re.compile(r"tensorboard", re.IGNORECASE),
    "ray": re.compile(r"^\s*(?:import|from) ray\b", re.MULTILINE),
    "datasets": re.compile(r"^\s*(?:import|from) datasets\b", re.MULTILINE),
}


def integrations_in(code: str) -> list[str]:
    """The packages of the integrations extra that an example runs against."""
    return [package for package, named in INTEGRATIONS.items() if named.search(code)]


def examples_where(chosen: Callable[[str, str], bool]) -> list[Any]:
    """The examples ``chosen(where, code)`` picks, as parameters: one that runs against a
    package of the integrations extra is marked ``@pytest.mark.integration`` for it."""
    picked: list[Any] = []
    for where, code in BLOCKS:
        if chosen(where, code):
            needed = integrations_in(code)
            marks = [pytest.mark.integration(*needed)] if needed else []
            picked.append(pytest.param(where, marks=marks))
    return picked


def test_the_documents_have_examples() -> None:
    assert len(BLOCKS) >= 7
    assert any(where.startswith("README") for where, _ in BLOCKS)
    assert len(OUTPUTS) >= 3


@pytest.mark.parametrize("document", DOCUMENTS, ids=name_of)
def test_every_python_fence_is_one_the_tests_run(document: Path) -> None:
    # An indented fence (inside a list) or another spelling (```py, ```pycon) would be
    # shown on the page and never run: the examples must be top-level ```python blocks.
    fences = re.findall(r"^([ \t]*)```[ \t]*(py\w*)(.*)$", document.read_text(), re.MULTILINE)
    unrun = [f"{i}```{lang}{rest}" for i, lang, rest in fences if (i, lang) != ("", "python")]
    unrun = [fence for fence in unrun if not fence.endswith("python no-run")]
    assert unrun == [], f"{name_of(document)}: examples the tests would not run: {unrun}"


def test_every_link_between_documents_works_in_the_repository_too() -> None:
    # The site rewrites links to the top-level documents (scripts/mkdocs_hooks.py); read
    # on the repository, each relative link must name a file that is there.
    broken = []
    for document in DOCUMENTS:
        for link in re.findall(r"\]\(([^)\s]+)\)", document.read_text()):
            elsewhere = re.match(r"^([a-z]+:|#)", link)  # another host, or this page
            if not elsewhere and not (document.parent / link.split("#")[0]).exists():
                broken.append(f"{name_of(document)}: {link}")
    assert broken == []


@pytest.mark.parametrize("guide", GUIDES, ids=name_of)
def test_every_guide_starts_from_a_runnable_example(guide: Path) -> None:
    # in its introduction or in its first section (a guide that names its files first)
    text = guide.read_text()
    opening = "\n## ".join(text.split("\n## ", 2)[:2])
    assert "```python\n" in opening, f"{name_of(guide)} opens with no example"


def site_hooks() -> Any:
    """scripts/mkdocs_hooks.py, which serves the top-level documents on the site."""
    pytest.importorskip("mkdocs", reason="pip install -r docs/requirements.txt")
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", REPO / "scripts/mkdocs_hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def code_lines(text: str, language: str) -> list[str]:
    """The lines of every ``language`` fence in Markdown ``text``, indented ones included."""
    found = []
    for indent, code in re.findall(
        rf"^([ \t]*)```{language}[^\n]*\n(.*?)^\1```$", text, re.DOTALL | re.MULTILINE
    ):
        found += [line[len(indent) :] for line in code.splitlines()]
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=name_of)
def test_code_fits_the_sites_column_without_scrolling(document: Path) -> None:
    # Material's text column shows 80 columns of code at 1280 px; a longer line scrolls
    # sideways (tests/test_site_browser.py sees it in a browser). Put a long comment on
    # the line above. Output (```text) wraps on the site instead (docs/stylesheets).
    hooks = site_hooks()
    text = document.read_text()
    lines = code_lines(text, "python") + code_lines(text, "bash")
    if document.name == "README.md":  # its one-line commands are wrapped on the site
        lines = [part for line in lines for part in hooks.wrap_command(line)]
    too_long = [line for line in lines if len(line) > hooks.CODE_COLUMNS]
    assert too_long == [], f"{name_of(document)}: code lines over {hooks.CODE_COLUMNS}: {too_long}"


PAGES_OF_THE_SITE = [*DOCUMENTS, REPO / "BENCHMARKS.md", REPO / "CHANGELOG.md"]


def title_of(page: Path) -> str:
    return next(line[2:] for line in page.read_text().splitlines() if line.startswith("# "))


@pytest.mark.parametrize("document", PAGES_OF_THE_SITE, ids=name_of)
def test_every_page_has_one_title(document: Path) -> None:
    outside_code = re.sub(r"^([ \t]*)```.*?^\1```$", "", document.read_text(), flags=re.M | re.S)
    titles = re.findall(r"^# .*", outside_code, re.MULTILINE)
    assert len(titles) == 1, f"{name_of(document)} has {len(titles)} top-level titles: {titles}"


def test_the_navigation_names_each_page_by_its_title_and_once() -> None:
    yaml = pytest.importorskip("yaml", reason="pip install -r docs/requirements.txt")

    def entries(items: list[Any]) -> list[tuple[str, str]]:
        found = []
        for item in items:
            for label, target in item.items():
                found += entries(target) if isinstance(target, list) else [(label, target)]
        return found

    config = (REPO / "mkdocs.yml").read_text()
    nav = entries(yaml.safe_load(config[config.index("\nnav:") :].split("\n\n", 1)[0])["nav"])
    labels = [label for label, _ in nav]
    assert len(labels) == len(set(labels)), f"a label twice in the navigation: {labels}"
    served = {"index.md": "README.md", "benchmarks.md": "BENCHMARKS.md"}
    served["changelog.md"] = "CHANGELOG.md"
    for label, target in nav:
        source = REPO / served[target] if target in served else REPO / "docs" / target
        if target != "index.md":  # the home page is "Home"
            assert label == title_of(source).replace("`", ""), (label, target)


@pytest.mark.parametrize("document", DOCUMENTS, ids=name_of)
def test_admonitions_keep_their_text_inside(document: Path) -> None:
    # An unindented line right after an admonition's indented text (no blank line) is
    # not the admonition's: it shows below the box, the box ending mid-sentence.
    lines = document.read_text().splitlines()
    inside = False
    for number, line in enumerate(lines, start=1):
        if line.startswith(("!!!", "???")):
            inside = True
        elif inside and line.strip() and not line.startswith("    "):
            assert not lines[number - 2].strip(), (
                f"{name_of(document)}:{number}: the admonition's text goes on unindented"
            )
            inside = False


def test_the_readme_is_a_front_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "move the detail into a guide under docs/guides/"
    for guide in GUIDES:  # every guide is reachable from the front page
        assert f"]({name_of(guide)}" in readme, f"the README does not link {name_of(guide)}"


def test_the_readme_keeps_the_quickstart_commands_ci_runs() -> None:
    readme = (REPO / "README.md").read_text().splitlines()
    demo = 'python -m pip install torch==2.13.0 && python -m pip install -e ".[progress]" && '
    demo += "torchrun --standalone --nproc_per_node=2 examples/train_forecaster.py --epochs 4 "
    demo += "--out runs/forecaster"
    tests = 'python -m pip install torch==2.13.0 && python -m pip install -e ".[test]" && '
    tests += "python -m pytest -n 3 --dist loadscope"
    assert demo in readme
    assert tests in readme


def test_the_readme_says_how_long_the_tests_take_and_offers_the_quick_tier_first() -> None:
    readme = (REPO / "README.md").read_text()
    quickstart = readme[
        readme.index("## Quickstart") : readme.index("\n## ", readme.index("## Quickstart") + 3)
    ]
    full_suite = quickstart.index("python -m pytest -n 3 --dist loadscope")
    assert 'python -m pytest -m "not slow"' in quickstart[:full_suite]
    prose = " ".join(quickstart.split())  # as it reads, whatever the line breaks
    assert "90 s" in prose
    assert re.search(r"(about|\d+ to) \d+ minutes", prose), "the whole suite's time, measured"


def test_the_readme_says_which_tests_need_the_docs_extra_and_how_to_run_all() -> None:
    readme = (REPO / "README.md").read_text()
    assert "Without the `docs` extra" in readme
    assert 'python -m pip install -e ".[test,integrations,docs]" && python -m pytest' in readme


def run_example(source: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """``python example.py`` in ``folder``, with ``source`` as the script, bounded in time."""
    folder.mkdir(exist_ok=True)
    (folder / "example.py").write_text(source)
    return subprocess.run(
        [sys.executable, "example.py"],
        cwd=folder,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """``examples(where)``: that block's run in a fresh folder, once per session.

    The README's resumable example is run by :func:`test_example_runs` and, whole,
    as the reference of the stopped-and-resumed run: one run serves both.
    """
    code_of = dict(BLOCKS)

    @functools.cache
    def run_code(code: str) -> subprocess.CompletedProcess[str]:
        return run_example(code, tmp_path_factory.mktemp("example"))

    def run(where: str) -> subprocess.CompletedProcess[str]:
        return run_code(code_of[where])  # the same example on two pages runs once

    return run


#: Examples a test of their own runs, checking what they print: not run twice.
RUN_BY_THEIR_OWN_TESTS = {
    # train, resume, sample and export, in that order
    **{
        f"docs/guides/checkpoints-beyond-the-run.md#{n}": "tests/test_weights.py" for n in (1, 2, 3)
    },
    "docs/guides/streaming-data.md#1": "tests/test_streams.py",
    # its training function, in the same TorchTrainer run as the test's (one Ray session)
    "docs/guides/launching.md#2": "tests/test_ray.py",
}


def test_the_examples_run_elsewhere_are_still_on_their_pages() -> None:
    assert set(RUN_BY_THEIR_OWN_TESTS) <= set(dict(BLOCKS))


@pytest.mark.parametrize(
    "where",
    examples_where(
        lambda where, code: not is_a_test_file(code) and where not in RUN_BY_THEIR_OWN_TESTS
    ),
)
@pytest.mark.slow
def test_example_runs(where: str, examples: Callable[[str], Any]) -> None:
    result = examples(where)
    assert result.returncode == 0, f"{where} failed:\n{result.stderr[-3000:]}"
    code = dict(BLOCKS)[where]
    if "ddpctx.launch(lambda: ddpctx.current().rank * 10" in code:  # the launch example
        assert result.stdout == "[0, 10]\n"
    if where in OUTPUTS:
        assert result.stdout == OUTPUTS[where], f"{where} printed:\n{result.stdout}"


@pytest.mark.slow
@pytest.mark.parametrize("where", examples_where(lambda where, code: is_a_test_file(code)))
def test_example_test_files_pass_under_pytest(where: str, tmp_path: Path) -> None:
    (tmp_path / "example.py").write_text(dict(BLOCKS)[where])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "example.py", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert re.search(r"\b\d+ passed\b", result.stdout)
    assert "skipped" not in result.stdout


@pytest.mark.slow
def test_the_readme_example_stopped_mid_epoch_logs_the_same_steps_once_resumed(
    tmp_path: Path, examples: Callable[[str], Any]
) -> None:
    ((where, code),) = [
        (where, code) for where, code in BLOCKS if 'ctx.load_checkpoint("runs/together"' in code
    ]
    save = '                )\n        log(f"epoch {epoch}: validation'
    assert code.count(save) == 1
    stop = "                )\n                if step == 20:\n                    os._exit(3)\n"
    killed = "import os\n" + code.replace(save, stop + save[18:])

    whole = examples(where)
    first = run_example(killed, tmp_path / "resumed")
    second = run_example(code, tmp_path / "resumed")
    assert (whole.returncode, first.returncode, second.returncode) == (0, 3, 0), second.stderr
    lines = whole.stdout.splitlines()
    assert first.stdout.splitlines() == lines[:6]  # stopped after epoch 1, batch 4
    assert second.stdout.splitlines() == ["resuming at epoch 1, batch 5 of 16", *lines[6:]]


@pytest.mark.slow
def test_the_readme_example_stopped_after_an_epochs_last_batch_names_the_next_batch_read(
    tmp_path: Path, examples: Callable[[str], Any]
) -> None:
    # A mid-epoch checkpoint at the loader's end (step 16 of 16): the log said "resuming at
    # epoch 0, batch 17 of 16"; the next batch read is epoch 1's first.
    ((where, code),) = [
        (where, code) for where, code in BLOCKS if 'ctx.load_checkpoint("runs/together"' in code
    ]
    save = '                )\n        log(f"epoch {epoch}: validation'
    stop = "                )\n                if step == 16:\n                    os._exit(3)\n"
    killed = "import os\n" + code.replace(save, stop + save[18:])

    whole = examples(where)
    first = run_example(killed, tmp_path / "resumed")
    second = run_example(code, tmp_path / "resumed")
    assert (whole.returncode, first.returncode, second.returncode) == (0, 3, 0), second.stderr
    lines = whole.stdout.splitlines()
    assert first.stdout.splitlines() == lines[:4]  # stopped after epoch 0's last batch
    assert second.stdout.splitlines() == ["resuming at epoch 1, batch 1 of 16", *lines[4:]]


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


def extras() -> dict[str, list[str]]:
    """setup.cfg's extras, each a list of requirement lines."""
    import configparser

    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    section = parser["options.extras_require"]
    return {name: [r for r in section[name].splitlines() if r.strip()] for name in section}


def test_the_plugin_reference_says_how_a_pools_ranks_meet() -> None:
    # Found by the outside attack: it said rendezvous went through files, with no ports,
    # after the pools' ranks had moved to a store on a loopback port.
    import ddpctx.testing

    doc = ddpctx.testing.__doc__ or ""
    assert "127.0.0.1" in doc
    assert "through files" not in doc


def test_the_docs_extra_installs_what_docs_requirements_txt_does() -> None:
    lines = (REPO / "docs" / "requirements.txt").read_text().splitlines()
    required = [line for line in lines if line.strip() and not line.startswith("#")]
    assert sorted(extras()["docs"]) == sorted(required)
    assert not any(line.startswith("torch") for line in required)  # the build reads source only


def test_the_extras_table_lists_every_extra() -> None:
    installing = (REPO / "docs" / "installing.md").read_text()
    listed = re.findall(r"^\| `([\w-]+)` \|", installing, re.MULTILINE)
    assert sorted(listed) == sorted(extras())


@pytest.mark.parametrize("document", DOCUMENTS, ids=name_of)
def test_install_commands_work_from_a_checkout(document: Path) -> None:
    # ddpctx is on no package index: `pip install ddpctx[x]` finds nothing. From a
    # checkout: pip install -e ".[x]"; from elsewhere, a path or "ddpctx[x] @ git+...".
    text = document.read_text()
    from_an_index = re.findall(r"pip install\s+['\"]?ddpctx\[[^\]]*\]['\"]?(?!\s*@)", text)
    assert from_an_index == [], f"{name_of(document)}: {from_an_index}"


def packages_of(extra: str) -> set[str]:
    """The package names an extra of setup.cfg installs, without versions or extras."""
    return {re.split(r"[<>=\[ ]", r)[0].lower() for r in extras()[extra]}


def test_the_test_extra_is_quick_and_the_integrations_have_their_own() -> None:
    # A newcomer's `pip install -e ".[test]"` took 6 min 11 s when it also pulled Ray
    # (79 MB), pyarrow (55 MB), MLflow, W&B and datasets: those are the integrations extra.
    integrations = packages_of("integrations")
    assert not integrations & packages_of("test"), integrations & packages_of("test")
    for tracker in ("stream", "tensorboard", "mlflow", "wandb", "ray"):
        assert packages_of(tracker) <= integrations, tracker
    readme = " ".join((REPO / "README.md").read_text().split())
    assert 'python -m pip install -e ".[test,integrations]"' in readme


def test_the_notebooks_extra_can_open_and_execute_the_notebooks() -> None:
    names = packages_of("notebooks")
    assert {"jupyterlab", "nbconvert", "ipykernel", "matplotlib"} <= names, names
    # the test suite re-runs them with nbclient and needs no JupyterLab
    assert "jupyterlab" not in " ".join(extras()["test"])


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documentation site, built with ``--strict`` in a process that cannot import torch."""
    for package in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(package, reason="pip install -r docs/requirements.txt")
    folder = tmp_path_factory.mktemp("site")
    result = build_site(folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "html"


class Page(HTMLParser):
    """One built page as a reader meets it: its text, where each piece of text sits, its ids."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.ids: set[str] = set()
        self.assets: list[str] = []  # what the browser fetches: scripts, styles, images, fonts
        self.links: list[str] = []  # where the reader can click to
        self.prompts: list[tuple[bool, bool]] = []  # per ">>>": (in a highlighted block, styled)
        self.signatures: list[str] = []
        self.tables: list[list[list[str]]] = []
        self._open: list[tuple[str, str]] = []  # (tag, class) of the enclosing elements
        self._signature: list[str] | None = None
        self.feed(path.read_text())

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {name: value or "" for name, value in attrs}
        if "id" in found:
            self.ids.add(found["id"])
        if tag in ("script", "img", "iframe", "source", "video", "audio") and found.get("src"):
            self.assets.append(found["src"])
        if tag == "a" and found.get("href"):
            self.links.append(found["href"])
        rel = found.get("rel", "")
        if tag == "link" and rel in ("stylesheet", "preload", "icon", "manifest", "preconnect"):
            self.assets.append(found.get("href", ""))
        classes = found.get("class", "")
        if tag == "div" and "doc-signature" in classes.split():
            self._signature = []
        if tag == "table":
            self.tables.append([])
        if tag == "tr" and self.tables:
            self.tables[-1].append([])
        if tag == "td" and self.tables and self.tables[-1]:
            self.tables[-1][-1].append("")
        if tag not in ("br", "hr", "img", "input", "link", "meta", "source"):
            self._open.append((tag, classes))

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            opened, _ = self._open.pop()
            if opened == tag:
                break
        if tag == "div" and self._signature is not None and not self._inside("doc-signature"):
            self.signatures.append("".join(self._signature))
            self._signature = None

    def _inside(self, css_class: str, tag: str = "div") -> bool:
        return any(t == tag and css_class in c.split() for t, c in self._open)

    def handle_data(self, data: str) -> None:
        if self._signature is not None:
            self._signature.append(data)
        in_cell = any(tag == "td" for tag, _ in self._open)
        if in_cell and self.tables and self.tables[-1] and self.tables[-1][-1]:
            self.tables[-1][-1][-1] += data
        for _ in range(data.count(">>>")):
            styled = bool(self._open) and "gp" in self._open[-1][1].split()
            self.prompts.append((self._inside("highlight"), styled))


def pages(site: Path) -> list[Page]:
    return [Page(path) for path in sorted(site.rglob("*.html")) if path.name != "404.html"]


@pytest.fixture(scope="module")
def site_pages(site: Path) -> list[Page]:
    """Every built page, parsed once for the tests that read them all."""
    return pages(site)


@pytest.mark.slow  # builds the site: ~6 s alone, more under load
def test_the_site_builds_strictly_without_torch_and_has_its_pages(site: Path) -> None:
    assert "rank_zero_only" in (site / "api" / "decorators.html").read_text()
    assert "Quickstart" in (site / "index.html").read_text()  # the README is the home page


@pytest.mark.slow  # builds the site: ~6 s alone, more under load
def test_every_doctest_example_is_a_highlighted_code_block(site: Path) -> None:
    api = [page for page in pages(site) if "api" in page.path.parts]
    prompts = [(page.path, where) for page in api for where in page.prompts]
    assert len(prompts) >= 15, "the API pages are expected to show the docstrings' examples"
    misplaced = [str(path) for path, (in_block, styled) in prompts if not (in_block and styled)]
    assert misplaced == [], f"'>>>' outside a highlighted code block on {sorted(set(misplaced))}"
    for page in api:
        assert "<blockquote>" not in page.path.read_text(), page.path


@pytest.mark.slow  # builds the site: ~6 s alone, more under load
def test_nothing_is_loaded_from_another_host(site: Path) -> None:
    external = re.compile(r"^(https?:)?//", re.IGNORECASE)
    for page in pages(site):
        assert [a for a in page.assets if external.match(a)] == [], page.path
        assert 'class="mermaid"' not in page.path.read_text()  # Material fetches mermaid.js
    for sheet in site.rglob("*.css"):
        text = sheet.read_text()
        assert not re.search(r"(url\(|@import)\s*['\"]?(https?:)?//", text), sheet


@pytest.mark.slow  # builds the site: ~6 s alone, more under load
def test_the_built_site_reads_from_disk_every_link_is_a_file(site_pages: list[Page]) -> None:
    """Opened as file:// (no server), a link to a folder shows a listing, not the page."""
    broken = []
    for page in site_pages:
        for link in page.links:
            if re.match(r"^([a-z]+:|#)", link):  # another host, mailto:, or this page
                continue
            target = (page.path.parent / link.split("#")[0]).resolve()
            if not target.is_file():
                broken.append(f"{page.path.name}: {link}")
    assert broken == [], broken[:10]


@pytest.mark.slow  # builds the site: ~6 s alone, more under load
def test_signatures_are_wrapped_and_overloads_not_repeated(site: Path) -> None:
    signatures = [s for page in pages(site) for s in page.signatures]
    assert signatures
    too_long = [line for s in signatures for line in s.splitlines() if len(line) > 90]
    assert too_long == []
    decorators = Page(site / "api" / "decorators.html")
    assert sum(s.startswith("rank_zero_only(") for s in decorators.signatures) == 1


@pytest.mark.slow  # builds the site: ~6 s alone, more under load
def test_the_distcontext_attribute_table_has_one_attribute_per_row(site: Path) -> None:
    context = Page(site / "api" / "context.html")
    names = {row[0].strip() for table in context.tables for row in table if row}
    expected = {"rank", "world_size", "local_rank", "local_world_size", "node_rank", "device"}
    expected |= {"backend", "launcher", "seed", "is_main", "is_local_main", "restart_count"}
    assert expected <= names, sorted(names)


@pytest.mark.slow  # builds the site: ~6 s alone, more under load
@pytest.mark.parametrize("name", [n for n in ddpctx.__all__ if n != "__version__"])
def test_every_public_name_has_its_own_entry_on_the_site(site_pages: list[Page], name: str) -> None:
    ids = {i for page in site_pages if "api" in page.path.parts for i in page.ids}
    assert any(i.endswith(f".{name}") for i in ids), f"ddpctx.{name} has no entry on the site"


@pytest.mark.slow  # builds the site: ~6 s alone, more under load
def test_the_plugin_page_documents_every_option_fixture_and_command_line_option(
    site: Path,
) -> None:
    from ddpctx.testing import options, plugin

    page = Page(site / "api" / "testing.html")
    text = (site / "api" / "testing.html").read_text()
    for option in options.OPTIONS:
        assert f"<code>{option}</code>" in text, f"marker option {option} is not documented"
    for fixture in fixtures_of(Path(plugin.__file__)):
        assert f"ddpctx.testing.plugin.{fixture}" in page.ids, f"fixture {fixture}"
    for flag in [*command_line_options(plugin), "-s", "-rP", "--timeout", "-n"]:
        assert f"<code>{flag}" in text, f"command-line option {flag} is not documented"


def fixtures_of(source: Path) -> list[str]:
    """Functions decorated with ``@pytest.fixture`` in a module, read statically."""
    found = []
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if ast.unparse(target) in ("pytest.fixture", "fixture"):
                    found.append(node.name)
    assert found, f"no fixtures found in {source}"
    return found


def command_line_options(plugin: object) -> list[str]:
    """The options the plugin's ``pytest_addoption`` adds (none today)."""
    added: list[str] = []

    class Recorder:
        def addoption(self, *names: str, **_: object) -> None:
            added.extend(names)

        def getgroup(self, *_: object, **__: object) -> Recorder:
            return self

        def addini(self, name: str, *_: object, **__: object) -> None:
            added.append(name)

    hook = getattr(plugin, "pytest_addoption", None)
    if hook is not None:
        hook(Recorder())
    return added


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


def test_literal_blocks_and_example_sections_become_code_on_the_site() -> None:
    pytest.importorskip("griffe", reason="pip install -r docs/requirements.txt")
    spec = importlib.util.spec_from_file_location(
        "griffe_docstrings", REPO / "scripts" / "griffe_docstrings.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    literal = "Use it in a test::\n\n    def test_x(dist_ctx):\n        pass\n\n"
    text = literal + "Example:\n    >>> 1\n    1"
    assert module.markdown_docstring(text).splitlines() == [
        "Use it in a test:",
        "",
        "```python",
        "def test_x(dist_ctx):",
        "    pass",
        "```",
        "",
        "Examples:",  # Google style's name: Griffe renders its doctests as code
        "    >>> 1",
        "    1",
    ]


def article_text(page: Path) -> str:
    """What a reader sees in a built page's main column (no navigation), as text."""
    import html

    text = page.read_text()
    article = text[text.index("<article") : text.index("</article>")]
    return html.unescape(re.sub(r"<[^>]+>", "", article))


def example_code(page: Path) -> list[str]:
    """The code of every highlighted example on a built page, prompts removed."""
    import html

    blocks = re.findall(
        r'<div class="language-(?:pycon|python) highlight">(.*?)</div>', page.read_text(), re.DOTALL
    )
    found = []
    for block in blocks:
        text = html.unescape(re.sub(r"<[^>]+>", "", block))
        lines = text.splitlines()
        if any(line.startswith(">>>") for line in lines):  # keep the input lines only
            lines = [line[4:] for line in lines if line.startswith((">>>", "..."))]
        found.append("\n".join(lines))
    return found


def names_used_but_not_defined(code: str) -> set[str]:
    """Names an example reads that it neither imports nor assigns (nor are builtins)."""
    import builtins

    tree = ast.parse(code)
    defined = set(dir(builtins)) | {
        node.name for node in ast.walk(tree) if isinstance(node, ast.ExceptHandler) and node.name
    }
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else defined).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    return used - defined


MAINTAINERS_NOTES = ("DESIGN", "Layering:", "May import", "For maintainers")
INTERNAL = [
    p.parent.name for p in (REPO / "ddpctx").glob("*/__init__.py") if p.parent.name != "testing"
]


@pytest.mark.slow  # builds the site: ~6 s alone, more under load
def test_no_api_page_shows_maintainers_notes_or_private_helpers(site: Path) -> None:
    import builtins

    public = set(ddpctx.__all__)
    assert sum(len(example_code(page)) for page in (site / "api").glob("*.html")) >= 15
    for page in sorted((site / "api").glob("*.html")):
        text = article_text(page)
        shown = [note for note in MAINTAINERS_NOTES if note in text]
        assert shown == [], f"{page.name} shows maintainers' notes: {shown}"
        modules = re.findall(rf"ddpctx\.(?:{'|'.join(INTERNAL)})\.\w+", text)
        assert modules == [], f"{page.name} points readers at internal modules: {modules}"
        bases = re.findall(r"Bases:\s*([\w, .]+)", text)
        named = [name.strip() for listed in bases for name in listed.split(",")]
        internal = [name for name in named if name not in public and name not in dir(builtins)]
        assert internal == [], f"{page.name} names internal base classes: {internal}"
        documented_here = {i.rsplit(".", 1)[-1] for i in Page(page).ids}  # its own entries
        for code in example_code(page):
            too_long = [line for line in code.splitlines() if len(line) > 100]
            assert too_long == [], f"{page.name}: example lines over 100 characters: {too_long}"
            try:
                ast.parse(code)
            except SyntaxError:  # an error message or a report shown as a block, not code
                continue
            assert not re.search(r"from ddpctx\.\w+\.\w+ import|\b_[a-z]\w*\(", code), (
                f"{page.name}: an example reaches into ddpctx's internals:\n{code}"
            )
            unknown = names_used_but_not_defined(code) - public - documented_here
            unknown -= {"ctx", "pytest", "torch"}
            assert not unknown, f"{page.name}: an example uses {sorted(unknown)}:\n{code}"


def distcontext_members() -> list[str]:
    from ddpctx.session.distcontext import DistContext

    return sorted(name for name in dir(DistContext) if not name.startswith("_"))


@pytest.mark.slow  # builds the site: ~6 s alone, more under load
def test_distcontext_is_one_class_with_every_member_under_a_topic(site: Path) -> None:
    page = Page(site / "api" / "context.html")
    text = article_text(site / "api" / "context.html")
    assert "Bases:" not in text
    attributes = {row[0].strip() for table in page.tables for row in table if row}
    prefix = "ddpctx.session.distcontext.DistContext."
    missing = [
        name
        for name in distcontext_members()
        if prefix + name not in page.ids and name not in attributes
    ]
    assert missing == [], (
        f"ctx.{missing[0]} is not on the DistContext page: add "
        f"'::: {prefix}{missing[0]}' under its topic in docs/api/context.md"
    )
    source = (REPO / "docs" / "api" / "context.md").read_text()
    assert "inherited_members" not in source  # the faces are not the reader's business


def test_the_layout_page_maps_every_ctx_member_to_its_module() -> None:
    from ddpctx.session.distcontext import DistContext

    layout = (REPO / "docs" / "maintainers" / "layout.md").read_text()
    for name in distcontext_members():
        home = next(k for k in DistContext.__mro__ if name in vars(k)).__module__
        if home == DistContext.__module__:
            continue  # a fact of the run, listed on the API page
        row = f"| `ctx.{name}` | `{home.replace('.', '/')}.py` |"
        assert row in layout, f"docs/maintainers/layout.md has no row {row}"


def test_the_layout_page_states_the_import_layers_the_tests_enforce() -> None:
    from tests.test_layers import MAY_IMPORT

    layout = (REPO / "docs" / "maintainers" / "layout.md").read_text()
    for package, allowed in MAY_IMPORT.items():
        rows = [line for line in layout.splitlines() if line.startswith(f"| `ddpctx/{package}/`")]
        assert rows, f"docs/maintainers/layout.md has no row for ddpctx/{package}/"
        listed = rows[0].rstrip(" |").rsplit("|", 1)[1].strip()
        assert set(listed.split(", ")) - {"nothing"} == allowed, (package, listed)


@pytest.mark.parametrize(
    "package", sorted(p.parent.name for p in (REPO / "ddpctx").glob("*/__init__.py"))
)
def test_each_package_docstring_lists_its_modules(package: str) -> None:
    folder = REPO / "ddpctx" / package
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    unlisted = [
        m.stem
        for m in sorted(folder.glob("*.py"))
        if m.stem != "__init__" and f"ddpctx.{package}.{m.stem}`" not in doc
    ]
    assert unlisted == [], f"ddpctx/{package}/__init__.py does not list {unlisted}"


def test_maintainers_notes_are_left_out_of_the_reference_and_kept_in_the_source() -> None:
    pytest.importorskip("griffe", reason="pip install -r docs/requirements.txt")
    spec = importlib.util.spec_from_file_location(
        "griffe_docstrings", REPO / "scripts" / "griffe_docstrings.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import ddpctx.hang.watchdog
    import ddpctx.testing

    for source in (ddpctx.testing.__doc__ or "", ddpctx.hang.watchdog.__doc__ or ""):
        assert "May import:" in source or "Layering:" in source
        rendered = module.markdown_docstring(source)
        assert not any(note in rendered for note in MAINTAINERS_NOTES), rendered[-500:]
    assert "dist_ctx" in module.markdown_docstring(ddpctx.testing.__doc__ or "")
