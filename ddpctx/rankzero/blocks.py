"""Rank-zero blocks: ``with ctx.rank_zero() as main: if main: ...`` and ``ctx.atomic_dir``.

A block of code that only rank 0 runs, without turning it into a decorated
function, with the failure guarantee of ``@rank_zero_only(barrier=True)``:
on leaving the block rank 0 sends every rank an :class:`~ddpctx.rankzero.outcome.Outcome`;
if rank 0's block raised, it re-raises its own exception and the others raise
:class:`~ddpctx.RankZeroError` carrying its traceback, instead of waiting at a
barrier. The other ranks skip the body themselves (``if main:``); a ``with``
statement cannot skip its body.

:func:`atomic_dir` builds on it: rank 0 gets a temporary directory beside
``path`` to write into; on success it replaces ``path`` in one rename; on
failure it is removed and ``path`` is untouched. Others get None and wait.
Missing parent directories are created (as ``save_pretrained`` would). A
``path`` that is a symbolic link to a directory keeps the link: the directory
it points to is what gets replaced. The current directory and its parents
(``"."``, ``".."``, ``""``) cannot be replaced while in use and are refused.

This module sits beside :mod:`ddpctx.rankzero.outcome` (whose protocol it reuses
unchanged) and below :mod:`ddpctx.session.context`.

Example:
    >>> place = Place(rank=0, world_size=1, local_rank=0, node_rank=0)
    >>> with rank_zero_block(place) as main:
    ...     if main:
    ...         print("only rank 0")
    only rank 0
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from ddpctx.rankzero.outcome import Outcome, refuse_inside_first, share
from ddpctx.reduce.guard import inside_rank_zero_work, running_alone
from ddpctx.utils.atomic import remove_abandoned, replace_dir, temporary_name
from ddpctx.utils.identity import Place


@contextlib.contextmanager
def rank_zero_block(
    place: Place, local: bool = False, what: str = "a ctx.rank_zero() block"
) -> Iterator[bool]:
    """Yield True on (local) rank 0 and False elsewhere; on exit every rank waits for rank 0.

    A failure inside rank 0's block is raised on every rank. Inside other
    rank-zero work the block simply runs where it is (nobody else is there to
    wait), and rank-zero work inside the block runs directly too, as inside a
    ``@rank_zero_only`` function (see :mod:`ddpctx.rankzero.outcome`). A collective
    inside the block is refused at once on whichever rank calls it, rank 0 or
    another (see :mod:`ddpctx.reduce.guard`): the others' side of the block runs
    while rank 0's runs alone. ``what`` names the block in that error.
    """
    nested = inside_rank_zero_work()
    if nested == "first":
        refuse_inside_first("a rank_zero() block or atomic_dir()")
    if nested == "function":
        main = place.is_zero(local)
        with running_alone("function", what):
            yield main
        return
    if not place.is_zero(local):
        # This rank's side of the block runs while rank 0's runs alone: a collective in it
        # would pair with nothing there, so it is refused here too (every rank, at once).
        try:
            with running_alone("function", what):
                yield False
        except BaseException:
            share(None, place, local)  # rank 0 still reports its block: take it, raise ours
            raise
        outcome, source = share(None, place, local)
        outcome.result(source)  # RankZeroError if rank 0's block failed
        return
    try:
        with running_alone("function", what):  # nested waits must not wait for the others
            yield True
    except BaseException as error:  # Ctrl-C and sys.exit() too: the others must not wait
        share(Outcome.failure(error), place, local)
        raise
    share(Outcome(True), place, local)


def replaceable(path: Path) -> Path:
    """The directory ``atomic_dir(path)`` replaces: ``path``, or where its symlink points.

    Refuses the current directory or one of its parents, a dangling link and a file.
    """
    if path.is_symlink():
        if not path.is_dir():
            raise FileNotFoundError(
                f"{str(path)!r} is a symbolic link to {os.readlink(path)!r}, which is not an "
                "existing directory. Point it at a directory, or remove the link."
            )
        path = path.resolve()
    absolute = Path(os.path.abspath(path))
    here = Path.cwd()
    if absolute == here or absolute in here.parents:
        raise ValueError(
            f"atomic_dir({str(path)!r}) would replace {str(absolute)!r}, the current directory "
            "or a parent of it, which cannot be swapped while in use. Write into a "
            "subdirectory instead, e.g. atomic_dir('model')."
        )
    if absolute.exists() and not absolute.is_dir():
        raise FileExistsError(
            f"{str(path)!r} exists and is not a directory; atomic_dir replaces directories "
            "only. Remove it, or choose another path."
        )
    return absolute


@contextlib.contextmanager
def atomic_dir(place: Place, path: Path) -> Iterator[Path | None]:
    """Rank 0 writes a directory into the yielded temporary path; it replaces ``path`` whole."""
    with rank_zero_block(place, what="a ctx.atomic_dir() block") as main:
        if not main:
            yield None
            return
        path = replaceable(path)
        path.parent.mkdir(parents=True, exist_ok=True)  # as save_pretrained would
        for suffix in ("tmpdir", "old"):
            remove_abandoned(path, suffix)
        temporary = temporary_name(path, "tmpdir")
        temporary.mkdir()
        try:
            yield temporary
            replace_dir(temporary, path)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
