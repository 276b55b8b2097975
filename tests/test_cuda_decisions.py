"""CUDA decisions (backend, device, errors) with ``torch.cuda`` faked in-process.

These machines have no GPU; the real NCCL path is exercised by
``scripts/gpu_check.sh`` on a machine that has one.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ddpctx
from ddpctx import distributed
from ddpctx.session.context import _make_plan
from ddpctx.session.group import init_kwargs

TWO_RANKS = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.usefixtures("two_gpus")
def test_cuda_gives_nccl_and_the_local_rank_device() -> None:
    plan = _make_plan(None, None, None, TWO_RANKS)
    assert plan.backend == "nccl"
    assert plan.device == torch.device("cuda", 1)


@pytest.mark.usefixtures("two_gpus")
def test_explicit_gloo_on_a_gpu_node_still_pins_the_gpu() -> None:
    plan = _make_plan(None, "gloo", None, TWO_RANKS)
    assert (plan.backend, plan.device) == ("gloo", torch.device("cuda", 1))


def test_no_cuda_gives_gloo_on_cpu() -> None:
    plan = _make_plan(None, None, None, TWO_RANKS)
    assert (plan.backend, plan.device) == ("gloo", torch.device("cpu"))


@pytest.mark.usefixtures("two_gpus")
def test_init_binds_the_group_to_the_gpu() -> None:
    kwargs = init_kwargs("nccl", torch.device("cuda", 1), timedelta(seconds=5))
    assert kwargs == {
        "backend": "nccl",
        "timeout": timedelta(seconds=5),
        "device_id": torch.device("cuda", 1),
    }
    assert "device_id" not in init_kwargs("gloo", torch.device("cpu"), timedelta(seconds=5))


@pytest.mark.usefixtures("two_gpus")
def test_local_rank_beyond_the_visible_gpus_is_refused_before_any_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    environ = {
        **TWO_RANKS,
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
    }
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    expected = r"LOCAL_RANK=2 but only 2 CUDA.*'0,1'.*--nproc_per_node=2"
    with pytest.raises(RuntimeError, match=expected), distributed():
        pass
    assert not dist.is_initialized()
    assert ddpctx.current() is None


def test_nccl_without_cuda_is_refused_before_any_group() -> None:
    with pytest.raises(RuntimeError, match="needs CUDA"), distributed(backend="nccl"):
        pass
    assert not dist.is_initialized()
