"""Shared fixtures: a launcher-free environment and a check that nothing leaks."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

import ddpctx
from tests.helpers import require_integration

pytest_plugins = ["pytester"]

# Scripts the tests launch as processes, and files only mypy checks: not test modules.
collect_ignore = ["scripts", "typing"]

LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_")
LAUNCHER_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DDPCTX_TIMEOUT",
    "GLOO_SOCKET_IFNAME",
    "DDPCTX_LAUNCHER",
    "DDPCTX_LAUNCHER_PID",
)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.integration("mlflow", ...)``: skip (or fail, in CI) before any fixture."""
    for mark in item.iter_markers("integration"):
        require_integration(*mark.args)


@pytest.fixture(autouse=True)
def clean_launcher_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts as a plain `python` process would, whatever shell ran pytest."""
    for name in list(os.environ):
        if name in LAUNCHER_NAMES or name.startswith(LAUNCHER_PREFIXES):
            monkeypatch.delenv(name)
    yield
    leaked_group = dist.is_initialized()
    leaked_context = ddpctx.current()
    if leaked_group:
        dist.destroy_process_group()
    assert not leaked_group, "the test left a process group initialised"
    assert leaked_context is None, f"the test left {leaked_context!r} active"
