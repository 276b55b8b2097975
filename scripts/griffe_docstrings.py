"""A Griffe extension for the API reference: ddpctx's docstrings, read as Markdown.

The docstrings are written for ``help()`` and doctest: examples often stand
alone (``>>>`` lines outside an ``Example:`` section) and cross-references use
reStructuredText roles (``:func:`launch```). Markdown would run a doctest's
lines into one paragraph and show the roles raw, so, for the site only, this
extension fences stand-alone doctests as ``pycon`` code, turns roles into
code spans and drops reST's ``::`` literal-block markers. The docstrings
themselves stay as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")
SECTION = re.compile(r"^(Example|Examples)\s*:\s*$")


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


def markdown_docstring(text: str) -> str:
    r"""``text`` with stand-alone doctests fenced and reST roles as code spans.

    >>> doctest = ">" * 3 + " 1 + 1\n2"
    >>> text = markdown_docstring(f"Sums.\n\n{doctest}\n\nSee :func:`~ddpctx.launch`.")
    >>> text.splitlines()[2:6]
    ['```pycon', '>>> 1 + 1', '2', '```']
    >>> text.splitlines()[-1]
    'See `launch`.'
    """
    lines, out = text.splitlines(), []
    in_section = in_doctest = in_fence = False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        if in_doctest and not stripped:
            out.append("```")
            in_doctest = False
        if SECTION.match(line):
            in_section = True
        elif in_section and stripped and not line.startswith((" ", "\t")):
            in_section = False
        if not (in_section or in_doctest or in_fence) and stripped.startswith(">>>"):
            out.append("```pycon")
            in_doctest = True
        if not in_doctest:
            line = ROLE.sub(_role, line)
            if line.endswith("::") and not in_fence:  # reST's literal-block marker
                line = line[:-1]
        out.append(line)
    if in_doctest:
        out.append("```")
    return "\n".join(out)


class MarkdownDocstrings(griffe.Extension):
    """Rewrite every docstring with ``markdown_docstring`` as Griffe loads it."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
