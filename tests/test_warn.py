"""Warnings name the user's line: whichever ddpctx path reached them, never a ddpctx file.

The same warning ("no checksum manifest") is raised at different depths
through ``ctx.load_checkpoint``, ``load_weights`` and ``checkpoint_meta``;
each must point at the line of this file that called ddpctx.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ddpctx import checkpoint_meta, distributed, load_weights
from ddpctx.utils import warn as warn_module
from ddpctx.utils.warn import warn_user


def saved_without_manifest(folder: Path) -> Path:
    """One checkpoint in ``folder``, its checksum manifest removed (as an older ddpctx wrote)."""
    with distributed() as ctx:
        model = ctx.wrap(nn.Linear(3, 2))
        ctx.save_checkpoint(folder, model=model, epoch=0)
    (manifest,) = folder.glob("*.sums")
    manifest.unlink()
    return folder


def caught(action: Callable[[], Any]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        action()
    return [w for w in found if "checksum manifest" in str(w.message)]


def load_in_a_block(folder: Path) -> None:
    with distributed() as ctx:
        ctx.load_checkpoint(folder, model=ctx.wrap(nn.Linear(3, 2)))


@pytest.mark.parametrize(
    "read",
    [load_in_a_block, load_weights, checkpoint_meta],
    ids=["load_checkpoint", "load_weights", "checkpoint_meta"],
)
def test_an_unverified_checkpoint_warning_names_this_file(
    tmp_path: Path, read: Callable[[Path], Any]
) -> None:
    folder = saved_without_manifest(tmp_path / "ckpt")
    found = caught(lambda: read(folder))
    if read is checkpoint_meta and not found:
        pytest.skip("checkpoint_meta reads no weights, so it verifies nothing")
    assert found, "no warning about the missing manifest"
    assert all(w.filename == __file__ for w in found), [(w.filename, w.lineno) for w in found]


def test_a_warning_from_a_with_blocks_exit_names_the_with_line() -> None:
    import contextlib

    @contextlib.contextmanager
    def block() -> Any:
        yield
        warn_user("at exit")

    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        with block():
            pass
    assert [w.filename for w in found] == [__file__]


@settings(max_examples=20, deadline=None)
@given(depth=st.integers(min_value=0, max_value=6))
def test_any_depth_of_ddpctx_frames_is_skipped(depth: int) -> None:
    # a chain of functions compiled as if they were in ddpctx's own files
    source = "def level_0():\n    warn_user('deep')\n"
    for n in range(1, depth + 1):
        source += f"def level_{n}():\n    level_{n - 1}()\n"
    namespace: dict[str, Any] = {"warn_user": warn_user}
    exec(compile(source, warn_module.__file__, "exec"), namespace)
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        namespace[f"level_{depth}"]()
    assert [w.filename for w in found] == [__file__]
