"""A Griffe extension for the API reference: ddpctx's docstrings, read as Markdown.

The docstrings are written for ``help()`` and doctest: examples sit under
``Example:`` or stand alone (``>>>`` lines in the text), code is shown with
reStructuredText's ``::`` literal blocks, and cross-references use roles
(``:func:`launch```). Markdown would turn a doctest's ``>>>`` into nested
block quotes and run its lines into one paragraph, and show the roles raw.
So, for the site only, this extension

- renames ``Example:`` sections to Google style's ``Examples:``, which Griffe
  splits into prose and doctests and mkdocstrings renders as ``pycon`` code;
- fences stand-alone doctests as ``pycon`` code and ``::`` literal blocks as
  ``python`` code (both highlighted by Pygments at build time);
- turns roles into code spans;
- leaves out maintainers' notes: a paragraph that opens with ``Layering:`` or
  ``May import:`` (where a module sits among the package's layers), and
  everything from a paragraph that opens with ``For maintainers:`` to the end,
  and pointers to internal modules (``(see :mod:`ddpctx.data.book`)``).
  ``help()`` and the source still show them; the reference is for users.

The docstrings themselves stay as they are. Griffe reads the source
statically: building the site imports neither ddpctx nor torch.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")
SECTION = re.compile(r"^(\s*)(Example|Examples)\s*:\s*$")


def _role(match: re.Match[str]) -> str:
    target = match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


MODULE_POINTER = re.compile(
    r"\s*\((?:see\s+)?:mod:`~?ddpctx\.[\w.]+`\)|;\s*:mod:`~?ddpctx\.[\w.]+`(?=\))"
)
MAINTAINERS_NOTE = ("Layering:", "May import:")
MAINTAINERS_REST = "For maintainers:"


def without_maintainers_notes(text: str) -> str:
    r"""``text`` without its maintainers' paragraphs (see the module docstring).

    >>> without_maintainers_notes("Does x.\n\nLayering: below y.\nAbove z.\n\nExample: 1")
    'Does x.\n\nExample: 1'
    >>> without_maintainers_notes("Does x.\n\nFor maintainers: the modules.\n\n- a\n- b")
    'Does x.'
    >>> pointers = "Saves it (see\n:mod:`ddpctx.checkpoint.meta`). Checks (one; :mod:`ddpctx.x`)."
    >>> without_maintainers_notes(pointers)
    'Saves it. Checks (one).'
    """
    kept: list[str] = []
    for paragraph in re.split(r"\n[ \t]*\n", text):
        opening = paragraph.lstrip()
        if opening.startswith(MAINTAINERS_REST):
            break
        if not opening.startswith(MAINTAINERS_NOTE):
            kept.append(paragraph)
    return MODULE_POINTER.sub("", "\n\n".join(kept).rstrip())


def markdown_docstring(text: str) -> str:
    r"""``text`` with doctests and literal blocks fenced, and reST roles as code spans.

    >>> doctest = ">" * 3 + " 1 + 1\n2"
    >>> text = markdown_docstring(f"Sums.\n\n{doctest}\n\nSee :func:`~ddpctx.launch`.")
    >>> text.splitlines()[2:6]
    ['```pycon', '>>> 1 + 1', '2', '```']
    >>> text.splitlines()[-1]
    'See `launch`.'
    >>> markdown_docstring("Like this::\n\n    f(x)\n\nDone.").splitlines()
    ['Like this:', '', '```python', 'f(x)', '```', '', 'Done.']
    >>> markdown_docstring("Example:\n    " + doctest).splitlines()[0]
    'Examples:'
    """
    lines, out = fence_literal_blocks(without_maintainers_notes(text).splitlines()), []
    in_section = in_doctest = in_fence = False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        if in_doctest and not stripped:
            out.append("```")
            in_doctest = False
        section = SECTION.match(line)
        if section and not in_fence:
            in_section = True
            line = f"{section.group(1)}Examples:"
        elif in_section and stripped and not line.startswith((" ", "\t")):
            in_section = False
        if not (in_section or in_doctest or in_fence) and stripped.startswith(">>>"):
            out.append("```pycon")
            in_doctest = True
        if not (in_doctest or in_fence):
            line = ROLE.sub(_role, line)
        out.append(line)
    if in_doctest:
        out.append("```")
    return "\n".join(out)


def fence_literal_blocks(lines: list[str]) -> list[str]:
    """reST's ``text::`` + an indented block, as ``text:`` + a fenced ``python`` block.

    >>> fence_literal_blocks(["Use it::", "", "    f(x)", "    g(x)", "", "Then."])
    ['Use it:', '', '```python', 'f(x)', 'g(x)', '```', '', 'Then.']
    """
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if not line.rstrip().endswith("::") or line.strip().startswith((">>>", "```")):
            out.append(line)
            continue
        margin = " " * _indent(line)
        block: list[str] = []
        while index < len(lines) and (
            not lines[index].strip() or _indent(lines[index]) > len(margin)
        ):
            block.append(lines[index])
            index += 1
        code = "\n".join(block).strip("\n").splitlines()
        if not code:  # "::" with no block after it: just the colon
            out.append(line.rstrip()[:-1])
            continue
        cut = min(_indent(c) for c in code if c.strip())
        out.extend([line.rstrip()[:-1], "", margin + "```python"])
        out.extend(margin + c[cut:] if c.strip() else "" for c in code)
        out.extend([margin + "```", ""] if index < len(lines) else [margin + "```"])
    return out


class MarkdownDocstrings(griffe.Extension):
    """Rewrite every docstring with ``markdown_docstring`` as Griffe loads it."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
