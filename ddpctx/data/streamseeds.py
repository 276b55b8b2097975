"""Seeds for a stream's batches, and the rank's own generators put aside while one is read.

Before reading each batch of a stream, ddpctx seeds ``random``, NumPy and torch
from :func:`batch_seed` (base seed, rank, epoch, worker, batch), so a batch's
random draws depend only on which batch it is. Without DataLoader workers the
batch is read in the rank itself, between training steps: the rank's own
generator states are put aside first and put back after
(:func:`python_state`, :func:`numpy_state`), so the training loop draws the
same numbers as if the dataset drew none.

Example:
    >>> import random
    >>> saved = python_state(); saved.save(); first = random.random()
    >>> saved.restore(); random.random() == first
    True
"""

from __future__ import annotations

import ctypes
import hashlib
import random
import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np


def batch_seed(base: int, rank: int, epoch: int, worker: int, index: int) -> int:
    """The 64-bit seed of one batch's reading (``worker`` -1 when batch numbers are rank-wide).

    >>> batch_seed(0, 0, 0, -1, 1) != batch_seed(0, 0, 0, -1, 2)
    True
    """
    key = struct.pack("<6q", base, rank, epoch, 0x57AE, worker, index)
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class CopiedState:
    """A global generator's C state put aside and back by copying its bytes (about 2 us).

    ``random.getstate``/``setstate`` and ``np.random.get_state``/``set_state``
    cost 35 us and 0.2 ms a round trip (they build Python objects), which a
    rank reading a stream without workers would pay per batch. Both generators
    are Mersenne Twisters whose state (624 words and a position) sits at a
    fixed place in memory; it is copied directly. The copy is checked once,
    when made, against the slow API (a draw between the two copies must be
    undone exactly); where that fails, the slow API is used.
    """

    SIZE = 624 * 4 + 4

    def __init__(self, address: int | None, get: Callable[[], Any], put: Callable[[Any], None],
                 draw: Callable[[], object], same: Callable[[Any, Any], bool]) -> None:  # fmt: skip
        self._get, self._put = get, put
        self._buffer = ctypes.create_string_buffer(self.SIZE)
        self._address = address
        self._saved: Any = None
        if address is not None:
            before = get()
            self.save()
            draw()
            self.restore()
            if not same(get(), before):
                self._address = None
            put(before)

    def save(self) -> None:
        if self._address is not None:
            ctypes.memmove(self._buffer, self._address, self.SIZE)
        else:
            self._saved = self._get()

    def restore(self) -> None:
        if self._address is not None:
            ctypes.memmove(self._address, self._buffer, self.SIZE)
        else:
            self._put(self._saved)


def python_state() -> CopiedState:
    """``random``'s global generator: its index and 624 words follow the object header."""
    generator = random._inst
    address = id(generator) + object.__basicsize__ if sys.implementation.name == "cpython" else None
    return CopiedState(address, random.getstate, random.setstate, random.random, _equal)


def numpy_state() -> CopiedState:
    """NumPy's legacy global generator: its MT19937's C state, at ``ctypes.state_address``."""
    bits = getattr(getattr(np.random.mtrand, "_rand", None), "_bit_generator", None)
    address = bits.ctypes.state_address if type(bits).__name__ == "MT19937" else None  # type: ignore[union-attr]
    return CopiedState(address, np.random.get_state, np.random.set_state, np.random.random, _equal)


def _equal(first: Any, second: Any) -> bool:
    """Generator states compared, NumPy arrays inside by value."""
    if isinstance(first, tuple) and isinstance(second, tuple):
        return len(first) == len(second) and all(map(_equal, first, second))
    if isinstance(first, np.ndarray) or isinstance(second, np.ndarray):
        return bool(np.array_equal(first, second))
    return bool(first == second)
