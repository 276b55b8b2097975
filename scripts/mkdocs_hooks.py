"""MkDocs hooks: serve the repository's top-level documents in the site.

README.md becomes the home page, BENCHMARKS.md and CHANGELOG.md their own
pages, with the benchmark plot beside them. Links written for reading on the
repository (``docs/x.md``, ``BENCHMARKS.md``; from a guide ``../../BENCHMARKS.md``)
are pointed at the site's pages. A long one-line command in those documents'
``bash`` blocks (README.md's Quickstart commands are single lines because
``.ci/run`` runs them as written) is shown on the site as backslash-continued lines
that fit the text column.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
PAGES = {"index.md": "README.md", "benchmarks.md": "BENCHMARKS.md", "changelog.md": "CHANGELOG.md"}
ASSETS = ["benchmarks/reduction.png"]
LINKS = {"docs/": "", "BENCHMARKS.md": "benchmarks.md", "CHANGELOG.md": "changelog.md"}
#: The widest code line the site shows at 1280 px without scrolling (80 in Material's column),
#: less one for a wider monospace font. Code in docs/ is wrapped to it (tests/test_docs.py).
CODE_COLUMNS = 79
SHELL_BLOCK = re.compile(r"^```bash\n(.*?)^```$", re.DOTALL | re.MULTILINE)
#: A shell word: quoted parts and other non-blank characters, run together.
SHELL_WORD = re.compile(r"""(?:"[^"]*"|'[^']*'|[^\s"'])+""")


def on_files(files: Files, config: Any) -> Files:
    for page, source in PAGES.items():
        files.append(File.generated(config, page, abs_src_path=str(ROOT / source)))
    for asset in ASSETS:
        files.append(File.generated(config, asset, abs_src_path=str(ROOT / asset)))
    return files


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    if page.file.src_uri not in PAGES:
        # A page in docs/ links the top-level documents as the repository holds them
        # (docs/guides/x.md: ../../BENCHMARKS.md); on the site they sit beside index.md.
        up = "../" * page.file.src_uri.count("/")
        for source, served in PAGES.items():
            markdown = markdown.replace(f"]({up}../{served}", f"]({up}{source}")
        return markdown
    for old, new in LINKS.items():
        markdown = re.sub(rf"\]\({re.escape(old)}", f"]({new}", markdown)
    return SHELL_BLOCK.sub(wrap_shell_block, markdown)


def wrap_shell_block(block: re.Match[str]) -> str:
    lines = [part for line in block.group(1).splitlines() for part in wrap_command(line)]
    return "```bash\n" + "".join(f"{line}\n" for line in lines) + "```"


def wrap_command(line: str) -> list[str]:
    """A command over CODE_COLUMNS as continued lines: each ``&&`` step on a line of its own,
    a step still too long broken between words. A line with a comment is left as it is."""
    if len(line) <= CODE_COLUMNS or "#" in line:
        return [line]
    lines: list[str] = []
    current = ""
    for word in SHELL_WORD.findall(line):
        step = word == "&&"
        if current and (step or len(current) + len(word) + 3 > CODE_COLUMNS):
            lines.append(current + " \\")
            current = ("  " if step else "      ") + word
        else:
            current = f"{current} {word}" if current else word
    return [*lines, current]
