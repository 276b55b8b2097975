"""The built documentation site in a real browser, at a laptop's and a phone's size.

Reading the HTML (tests/test_docs.py) cannot see what a reader sees: a code
block that scrolls sideways, a page wider than a phone, an error in the
console. This test builds the site, serves it on a loopback port and has a
headless Chromium open every page at 1280x900 and 390x844
(tests/browser/check_site.mjs says what counts as a problem). The browser is
``@sparticuz/chromium`` driven by ``puppeteer-core``, installed with npm from
tests/browser/package.json into a cache folder: ``$DDPCTX_BROWSER_CACHE``, else
``~/.cache/ddpctx-browser`` (about 120 MB, ~10 s the first time).

Without node and npm, or when the npm install fails, the test is skipped,
naming what is missing; with ``DDPCTX_REQUIRE_BROWSER=1`` (CI sets it) it fails
instead. On a failure, full-page screenshots of the failing pages are kept in
``$DDPCTX_ARTIFACTS/site-browser`` (default ``.ci-artifacts/site-browser``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn

import pytest

from tests.helpers import REPO, build_site, patience

pytestmark = pytest.mark.slow  # builds the site and loads every page twice: about a minute

BROWSER = REPO / "tests" / "browser"
#: The oldest node the pinned @sparticuz/chromium supports (its package's "engines").
NODE_AT_LEAST = (20, 11)
LAPTOP = (1280, 900)


def cache_folder() -> Path:
    return Path(os.environ.get("DDPCTX_BROWSER_CACHE") or Path.home() / ".cache/ddpctx-browser")


def artifacts_folder() -> Path:
    return Path(os.environ.get("DDPCTX_ARTIFACTS") or REPO / ".ci-artifacts") / "site-browser"


def unavailable(reason: str) -> NoReturn:
    """Skip, saying what is missing, or fail where the browser check is required (CI)."""
    if os.environ.get("DDPCTX_REQUIRE_BROWSER", "") not in ("", "0"):
        pytest.fail(f"{reason} (DDPCTX_REQUIRE_BROWSER is set: the check may not be skipped)")
    pytest.skip(reason)


def node_version(node: str) -> tuple[int, ...]:
    result = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30)
    found = re.match(r"v(\d+)\.(\d+)", result.stdout.strip())
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def installed(cache: Path) -> bool:
    """The cache holds node modules installed from this repository's package.json."""
    wanted = (BROWSER / "package.json").read_text()
    manifest = cache / "package.json"
    modules = cache / "node_modules"
    return (
        manifest.is_file()
        and manifest.read_text() == wanted
        and (modules / "@sparticuz" / "chromium" / "package.json").is_file()
        and (modules / "puppeteer-core" / "package.json").is_file()
    )


def npm_error(result: subprocess.CompletedProcess[str]) -> str:
    """What npm said went wrong, without its stack trace."""
    lines = (result.stderr or result.stdout).splitlines()
    said = [line for line in lines if not re.match(r"npm error\s+at ", line)]
    return "\n".join(said[:8]) or f"exit status {result.returncode}"


@pytest.fixture(scope="module")
def browser_modules() -> Path:
    """The folder whose node_modules holds @sparticuz/chromium and puppeteer-core."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        unavailable(
            "the browser check needs node and npm (Node.js 20.11 or newer), "
            "e.g. apt-get install nodejs npm, or from https://nodejs.org"
        )
    if node_version(node) < NODE_AT_LEAST:
        unavailable(
            f"the browser check needs Node.js {'.'.join(map(str, NODE_AT_LEAST))} or newer "
            f"(the pinned @sparticuz/chromium's minimum); {node} is older"
        )
    cache = cache_folder()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".install.lock", "w") as lock:  # another session may be installing
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not installed(cache):
            shutil.copyfile(BROWSER / "package.json", cache / "package.json")
            command = [npm, "install", "--no-audit", "--no-fund", "--no-update-notifier"]
            try:
                result = subprocess.run(
                    command, cwd=cache, capture_output=True, text=True, timeout=patience(300)
                )
                failure = None if result.returncode == 0 else npm_error(result)
            except subprocess.TimeoutExpired:
                failure = f"no answer within {patience(300):.0f} s"
            if failure is not None or not installed(cache):
                unavailable(
                    "the browser check could not install @sparticuz/chromium and puppeteer-core "
                    f"with npm into {cache}: {failure or 'it installed nothing'}\n"
                    f"Install them by hand: cp tests/browser/package.json {cache}/ && "
                    f"(cd {cache} && npm install), or point DDPCTX_BROWSER_CACHE at a folder "
                    "where they are installed"
                )
    return cache


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for package in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(package, reason='the docs extra: pip install -e ".[docs]"')
    folder = tmp_path_factory.mktemp("site")
    result = build_site(folder)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "html"


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serving(folder: Path) -> Iterator[str]:
    """The folder served on a free loopback port, in a thread of this process: its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def end_process_group(leader: int) -> None:
    """SIGTERM to a process group we started (node: puppeteer then closes its browser),
    then SIGKILL to what is left of it after a few seconds."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(leader, sig)
        except ProcessLookupError:
            return
        for _ in range(int(wait * 10)):
            try:
                os.killpg(leader, 0)
            except ProcessLookupError:
                return
            threading.Event().wait(0.1)


def end_browser(pid_file: Path) -> None:
    """The Chromium the script started, if it still runs: puppeteer starts it as a process
    group of its own, so it does not go with node's."""
    pid = pid_file.read_text().strip() if pid_file.is_file() else ""
    if not pid.isdigit():
        return
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return  # already gone
    if b"chromium" in command:  # still ours, not a new process under a reused id
        end_process_group(int(pid))


def check_site(modules: Path, site: Path, work: Path) -> dict[str, Any]:
    """Run check_site.mjs over every page of ``site``; its report."""
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    work.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(BROWSER / "check_site.mjs", work / "check_site.mjs")
    (work / "node_modules").symlink_to(modules / "node_modules")  # where node finds imports
    out = work / "out"
    with serving(site) as base:
        process = subprocess.Popen(
            ["node", "check_site.mjs", base, str(out), *pages],
            cwd=work,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a group of its own, to be stopped whole
        )
        try:
            stdout, stderr = process.communicate(timeout=patience(420))
        except subprocess.TimeoutExpired:
            end_process_group(process.pid)
            stdout, stderr = process.communicate(timeout=30)
            pytest.fail(f"the browser check did not finish in time:\n{stdout[-2000:]}{stderr}")
        finally:
            if process.poll() is None:
                end_process_group(process.pid)
            end_browser(out / "chromium.pid")
    stopped = f"the browser check stopped:\n{stdout[-2000:]}\n{stderr[-3000:]}"
    assert process.returncode == 0, stopped
    report_file = out / "report.json"
    assert report_file.is_file(), stopped
    report: dict[str, Any] = json.loads(report_file.read_text())
    assert report["checked"]["pages"] == len(pages) >= 25, report["checked"]
    report["out"] = out
    return report


@pytest.fixture(scope="module")
def report(
    built_site: Path, browser_modules: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    # the site first: without the docs extra the test is skipped before any npm install
    return check_site(browser_modules, built_site, tmp_path_factory.mktemp("browser"))


def keep_screenshots(out: Path) -> Path:
    """Copy the failing pages' screenshots to the artifacts folder; that folder."""
    kept = artifacts_folder()
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    for shot in out.glob("*.png"):
        shutil.copyfile(shot, kept / shot.name)
    shutil.copyfile(out / "report.json", kept / "report.json")
    return kept


def test_every_page_reads_in_a_real_browser_at_laptop_and_phone_size(
    report: dict[str, Any],
) -> None:
    problems = report["problems"]
    if problems:
        kept = keep_screenshots(report["out"])
        listed = "\n".join(f"  {p['page']} at {p['size']}: {p['reason']}" for p in problems)
        pytest.fail(
            f"{len(problems)} problems on {report['checked']['pages']} pages "
            f"(screenshots of the failing pages and report.json in {kept}):\n{listed}",
            pytrace=False,
        )


def test_the_front_page_shows_the_guides_within_a_screen_and_a_half_on_a_laptop(
    report: dict[str, Any],
) -> None:
    width, height = LAPTOP
    layout = report["layouts"]["index.html"][f"{width}x{height}"]
    assert layout["guideList"] is not None, "the front page has no list of links to the guides"
    assert layout["guideList"]["bottom"] <= 1.5 * height, (
        f"the front page's guide list ends {layout['guideList']['bottom']:.0f} px down at "
        f"{width}x{height}: keep what comes before it short ({layout['words']} words)"
    )
