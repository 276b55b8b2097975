"""SLURM's compact lists: tasks per node (``2(x3),1``) and host lists (``node[01-03,07]``).

Pure parsing; every malformed value is a ``ValueError`` naming the variable,
its value and the fix.

Example:
    >>> parse_tasks_per_node("2(x2),1")
    [2, 2, 1]
    >>> parse_nodelist("gpu[01-02],cpu7")
    ['gpu01', 'gpu02', 'cpu7']
"""

from __future__ import annotations

import re

_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand SLURM's compressed tasks-per-node list.

    >>> parse_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    counts: list[int] = []
    for item in text.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if match is None:
            raise ValueError(
                f"{name}={text!r} is not a SLURM tasks-per-node list such as '2(x3),1'. "
                "Leave it as srun set it."
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def parse_nodelist(text: str, name: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expand a SLURM host list into host names, in order.

    >>> parse_nodelist("node[01-03,07],gpu-a1")
    ['node01', 'node02', 'node03', 'node07', 'gpu-a1']
    """
    fix = (
        f"{name}={text!r} is not a SLURM host list such as 'node[01-04,07],gpu-a1'. "
        "Leave it as SLURM set it, or set MASTER_ADDR to rank 0's host."
    )
    hosts: list[str] = []
    for item in _split_top_level(text, fix):
        hosts.extend(_expand_host(item, fix))
    if not hosts:
        raise ValueError(f"{fix} It names no host.")
    return hosts


def _split_top_level(text: str, fix: str) -> list[str]:
    items: list[str] = []
    depth = 0
    current = ""
    for char in text.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(fix)
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ValueError(fix)
    items.append(current)
    return [item for item in (i.strip() for i in items) if item]


def _expand_host(item: str, fix: str) -> list[str]:
    start = item.find("[")
    if start < 0:
        return [item]
    end = item.index("]", start)
    prefix, ranges, rest = item[:start], item[start + 1 : end], item[end + 1 :]
    suffixes = _expand_host(rest, fix) if rest else [""]
    hosts: list[str] = []
    for part in ranges.split(","):
        bounds = part.strip().split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            numbers = [bounds[0]]
        elif len(bounds) == 2 and bounds[0].isdigit() and bounds[1].isdigit():
            low, high = int(bounds[0]), int(bounds[1])
            if high < low:
                raise ValueError(f"{fix} The range {part!r} runs backwards.")
            width = len(bounds[0])
            numbers = [str(n).zfill(width) for n in range(low, high + 1)]
        else:
            raise ValueError(f"{fix} Cannot read the range {part!r}.")
        hosts.extend(prefix + number + suffix for number in numbers for suffix in suffixes)
    return hosts
