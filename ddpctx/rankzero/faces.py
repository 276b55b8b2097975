"""Rank-zero work's face on :class:`~ddpctx.DistContext`: blocks, ordered work, printing.

:class:`RankZeroFaces` is mixed into ``DistContext``; each method hands this
rank's :class:`~ddpctx.utils.identity.Place` to :mod:`ddpctx.rankzero.outcome`
or :mod:`ddpctx.rankzero.blocks`, which keep the guarantee that a failure on
rank 0 reaches every rank.
"""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any, TypeVar

from ddpctx.rankzero.blocks import atomic_dir, rank_zero_block
from ddpctx.rankzero.outcome import zero_first
from ddpctx.rankzero.report import bar_on_main
from ddpctx.utils.identity import Place

T = TypeVar("T")


class RankZeroFaces:
    """``ctx.rank_zero_first``, ``rank_zero``, ``atomic_dir``, ``progress``, ``print``."""

    rank: int
    world_size: int
    local_rank: int
    node_rank: int

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on local rank 0 of each node."""
        return self.local_rank == 0

    def _place(self) -> Place:
        return Place(self.rank, self.world_size, self.local_rank, self.node_rank)

    def rank_zero_first(self, local: bool = False) -> contextlib.AbstractContextManager[None]:
        """Rank 0 (local rank 0 with ``local=True``) runs the block first, then the others.

        An exception on rank 0 is raised on every rank instead of deadlocking them.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx, ctx.rank_zero_first():
        ...     print("downloading once")
        downloading once
        """
        place = Place(self.rank, self.world_size, self.local_rank, self.node_rank)
        return zero_first(place, local)

    def rank_zero(self, local: bool = False) -> contextlib.AbstractContextManager[bool]:
        """A block only rank 0 runs (``if main:``); every rank waits, and a failure reaches all.

        The same guarantee as ``@rank_zero_only(barrier=True)``, without a function.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     with ctx.rank_zero() as main:
        ...         if main:
        ...             print("rank 0 writes")
        rank 0 writes
        """
        return rank_zero_block(self._place(), local)

    def atomic_dir(
        self, path: str | os.PathLike[str]
    ) -> contextlib.AbstractContextManager[Path | None]:
        """Rank 0 writes a directory into the yielded temporary path; it replaces ``path`` whole.

        Other ranks get None and wait; a failure reaches every rank and leaves
        ``path`` as it was (see :mod:`ddpctx.rankzero.blocks`).

        >>> import tempfile
        >>> from pathlib import Path
        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     target = Path(tempfile.mkdtemp()) / "model"
        ...     with ctx.atomic_dir(target) as tmp:
        ...         if tmp is not None:
        ...             _ = (tmp / "config.json").write_text("{}")
        ...     sorted(p.name for p in target.iterdir())
        ['config.json']
        """
        return atomic_dir(self._place(), Path(path))

    def progress(self, iterable: Iterable[T], **tqdm_kwargs: Any) -> Iterable[T]:
        """``iterable`` with a tqdm bar on rank 0 (if tqdm is installed); as it is elsewhere."""
        return bar_on_main(iterable, self.is_main, tqdm_kwargs)

    def print(
        self,
        *values: object,
        sep: str = " ",
        end: str = "\n",
        file: IO[str] | None = None,
        flush: bool = True,
    ) -> None:
        """``print`` on rank 0 only, with ``print``'s keywords.

        Always flushed (``flush`` is accepted, as ``print`` takes it), so it
        interleaves sanely with the other ranks' output.

        >>> from ddpctx import distributed
        >>> with distributed() as ctx:
        ...     ctx.print("hello from rank", ctx.rank)
        hello from rank 0
        """
        if self.is_main:
            builtins.print(*values, sep=sep, end=end, file=file, flush=True)
