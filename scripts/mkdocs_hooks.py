"""MkDocs hooks: serve the repository's top-level documents in the site.

README.md becomes the home page, BENCHMARKS.md and CHANGELOG.md their own
pages, with the benchmark plot beside them. Links written for reading on the
repository (``docs/x.md``, ``BENCHMARKS.md``; from a guide ``../../BENCHMARKS.md``)
are pointed at the site's pages.
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
    return markdown
