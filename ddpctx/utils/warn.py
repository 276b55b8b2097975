"""Warnings that point at the user's line, not at the ddpctx line that raised them.

``warnings.warn(..., stacklevel=N)`` with a fixed ``N`` names the right line
only for the one call path it was counted for: the same warning reached
through ``ctx.load_checkpoint`` and through ``load_weights`` sits at another
depth, and a fixed ``N`` then names a line inside ddpctx (``resume.py:256``),
which the user can neither read nor filter on. :func:`warn_user` walks the
stack instead, past ddpctx's own frames and ``contextlib``'s (a ``with``
block's ``__exit__``), to the first frame of the caller's code; where there
is none (a background thread), it names its direct caller.

>>> import warnings
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     warn_user("an example", RuntimeWarning)
>>> caught[0].filename.endswith("warn.py")  # a doctest's frame is not ddpctx's
False
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from types import FrameType

#: Frames from files under these folders are ddpctx's own.
_PACKAGE = str(Path(__file__).resolve().parent.parent)
#: Frames of these files are the plumbing of a ``with`` block, not the caller's code.
_PLUMBING = ("contextlib.py", "contextlib2")


def is_internal(frame: FrameType) -> bool:
    """Whether ``frame`` runs ddpctx's code or a context manager's plumbing."""
    filename = frame.f_code.co_filename
    return filename.startswith(_PACKAGE) or any(part in filename for part in _PLUMBING)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller name user code.

    Counted as ``warnings.warn`` counts: 1 is the caller of this function.
    """
    frame = sys._getframe(1)
    level = 1
    while frame is not None and is_internal(frame):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level if frame is not None else 1


def warn_user(message: str | Warning, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` at the first frame outside ddpctx."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
