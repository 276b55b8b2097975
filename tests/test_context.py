"""``distributed()`` in one process: set-up, clean-up on every exit path, bad input."""

from __future__ import annotations

import os
import random
import re
import signal
import textwrap
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ddpctx
from ddpctx import DistContext, distributed
from tests.helpers import child_env, listening_addresses, run_python


def test_single_process_forms_a_real_world_size_one_group() -> None:
    with distributed() as ctx:
        assert dist.is_initialized()
        assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (0, 1, 0, 1)
        assert (ctx.node_rank, ctx.launcher, ctx.backend) == (0, "single", "gloo")
        assert ctx.device == torch.device("cpu")
        assert ctx.is_main
        assert ctx.is_local_main
        assert ctx.restart_count == 0
        assert ddpctx.current() is ctx
        tensor = torch.tensor([3.0])
        dist.all_reduce(tensor)  # raw torch.distributed calls work as under torchrun
        assert tensor.item() == 3.0
    assert not dist.is_initialized()
    assert ddpctx.current() is None


def test_single_process_listens_on_loopback_only() -> None:
    with distributed():
        addresses = listening_addresses(os.getpid())
    assert addresses, "gloo is expected to open its transport socket"
    assert all(address.startswith(("127.", "::1")) for address in addresses), addresses
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # pinned only while the group formed


def test_seed_plus_rank_seeds_every_generator() -> None:
    with distributed(seed=1234) as ctx:
        drawn = (random.random(), np.random.rand(), torch.rand(1).item())
        assert ctx.seed == 1234
    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
    assert drawn == (random.random(), np.random.rand(), torch.rand(1).item())


def test_no_seed_leaves_generators_alone() -> None:
    random.seed(5)
    expected = random.random()
    random.seed(5)
    with distributed() as ctx:
        assert ctx.seed is None
        assert random.random() == expected


def test_exception_leaves_the_block_unchanged_and_group_is_destroyed() -> None:
    error = ValueError("bad batch")
    with pytest.raises(ValueError, match="bad batch") as raised, distributed():
        raise error
    assert raised.value is error
    assert not dist.is_initialized()
    assert ddpctx.current() is None


def test_keyboard_interrupt_cleans_up() -> None:
    with pytest.raises(KeyboardInterrupt), distributed():
        raise KeyboardInterrupt
    assert not dist.is_initialized()
    assert ddpctx.current() is None


def test_nested_distributed_is_refused_and_outer_survives() -> None:
    with distributed() as outer:
        nested = distributed()
        with pytest.raises(RuntimeError, match=r"already active.*ddpctx.current\(\)"), nested:
            pass
        assert ddpctx.current() is outer
        assert dist.is_initialized()
    assert not dist.is_initialized()


def test_foreign_group_is_adopted_and_left_alive() -> None:
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with distributed(seed=3) as ctx:
            assert (ctx.rank, ctx.world_size, ctx.backend) == (0, 1, "gloo")
        assert dist.is_initialized()
        assert ddpctx.current() is None
    finally:
        dist.destroy_process_group()


def test_adopting_with_a_different_backend_is_refused() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        with (
            pytest.raises(ValueError, match=r"backend='nccl'.*uses 'gloo'"),
            distributed(backend="nccl"),
        ):
            pass
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_deterministic_flags_are_set_inside_and_restored_after() -> None:
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    torch.backends.cudnn.benchmark = True
    try:
        with distributed(deterministic=True):
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.backends.cudnn.deterministic
            assert not torch.backends.cudnn.benchmark
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cudnn.benchmark
        assert (
            torch.are_deterministic_algorithms_enabled(),
            torch.backends.cudnn.deterministic,
            os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        ) == (before[0], before[1], before[3])
    finally:
        torch.backends.cudnn.benchmark = before[2]


def test_deterministic_flags_are_restored_after_an_exception() -> None:
    with pytest.raises(RuntimeError, match="x"), distributed(deterministic=True):
        raise RuntimeError("x")
    assert not torch.are_deterministic_algorithms_enabled()


def test_sigterm_handler_is_installed_inside_and_restored_after() -> None:
    # As in a fresh process: the plugin installs its own handler in a pytest process while
    # a pool of ranks lives (an earlier distributed test in the same worker), and
    # distributed() leaves a handler it did not install alone.
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with distributed():
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_wrap_gives_a_working_ddp_model_and_unwrap_the_module() -> None:
    with distributed(seed=0) as ctx:
        module = torch.nn.Linear(4, 1)
        model = ctx.wrap(module)
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
        model(torch.randn(8, 4)).sum().backward()
        assert module.weight.grad is not None
        assert ctx.unwrap(model) is module
        with pytest.raises(ValueError, match="already DistributedDataParallel"):
            ctx.wrap(model)


def test_print_runs_on_rank_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with distributed() as ctx:
        ctx.print("loss", 0.5)
        ctx.print("a", "b", sep="-", end="!\n", flush=True)  # print's keywords (flush raised)
    assert capsys.readouterr().out == "loss 0.5\na-b!\n"


def test_barrier_returns_with_one_rank() -> None:
    with distributed() as ctx:
        ctx.barrier()


def test_timeout_is_passed_to_the_group() -> None:
    with distributed(timeout=timedelta(seconds=42)):
        # the gloo backend's options carry the timeout the group was created with
        group = dist.distributed_c10d._get_default_group()
        backend = group._get_backend(torch.device("cpu"))
        assert backend.options._timeout == timedelta(seconds=42)  # type: ignore[attr-defined]


def test_repr_names_rank_and_device() -> None:
    with distributed(seed=1) as ctx:
        assert repr(ctx) == (
            "DistContext(rank=0, world_size=1, local_rank=0, device='cpu', "
            "backend='gloo', launcher='single', seed=1)"
        )
        assert isinstance(ctx, DistContext)


BAD_ARGUMENTS = [
    pytest.param({"seed": "42"}, ValueError, "seed='42' (str) is not an int", id="seed-str"),
    pytest.param({"seed": 1.5}, ValueError, "seed=1.5 (float) is not an int", id="seed-float"),
    pytest.param({"seed": True}, ValueError, "seed=True (bool) is not an int", id="seed-bool"),
    pytest.param({"seed": -1}, ValueError, "seed=-1 gives rank seeds", id="seed-negative"),
    pytest.param({"seed": 2**32}, ValueError, "outside [0, 4294967295]", id="seed-too-big"),
    pytest.param({"backend": "nccl"}, RuntimeError, "backend='nccl' needs CUDA", id="nccl-cpu"),
    pytest.param({"backend": "tcp"}, ValueError, "backend='tcp' is not a known", id="backend"),
    pytest.param({"timeout": -1}, ValueError, "timeout=-1 is outside the accepted", id="timeout"),
]


@pytest.mark.parametrize(("kwargs", "error", "expected"), BAD_ARGUMENTS)
def test_bad_arguments_raise_before_anything_starts(
    kwargs: dict[str, object], error: type[Exception], expected: str
) -> None:
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(error, match=re.escape(expected)), distributed(**kwargs):  # type: ignore[arg-type]
        pass
    assert not dist.is_initialized()
    assert ddpctx.current() is None
    assert signal.getsignal(signal.SIGTERM) is handler


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"RANK": "0"}, "RANK='0' is set but WORLD_SIZE is not"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"DDPCTX_TIMEOUT": "forever"}, "DDPCTX_TIMEOUT='forever'"),
    ],
)
def test_bad_environment_leaves_no_group_behind(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], expected: str
) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(expected)), distributed():
        pass
    assert not dist.is_initialized()


@pytest.mark.slow
def test_sigterm_inside_the_block_exits_143_after_clean_up(tmp_path: Path) -> None:
    script = tmp_path / "sigterm.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, time
            import torch.distributed as dist
            from ddpctx import distributed
            try:
                with distributed():
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(30)
            finally:
                print("group alive after exit:", dist.is_initialized(), flush=True)
            """
        )
    )
    result = run_python(script, timeout=60, env=child_env())
    assert result.returncode == 143, result.stderr
    assert "group alive after exit: False" in result.stdout
    assert "rank 0 received SIGTERM" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("earlier", ["clean", "caught error"])
def test_entering_again_prints_an_error_with_one_rank_prefix(tmp_path: Path, earlier: str) -> None:
    """torch prefixes uncaught errors with ``[rank0]: `` per formed group; blocks never stack it."""
    script = tmp_path / "again.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            from ddpctx import distributed
            first = sys.excepthook
            for attempt in range(3):
                try:
                    with distributed():
                        if {earlier!r} == "caught error":
                            raise KeyError(attempt)
                except KeyError:
                    pass
            print("after clean blocks, the first hook:", sys.excepthook is first, flush=True)
            with distributed():
                raise ValueError("boom")
            """
        )
    )
    result = run_python(script, timeout=60, env=child_env())
    assert result.returncode == 1, result.stderr
    assert "[rank0]: ValueError: boom" in result.stderr
    assert "[rank0]: [rank0]:" not in result.stderr, result.stderr
    clean = earlier == "clean"
    assert f"after clean blocks, the first hook: {clean}" in result.stdout


@pytest.mark.slow
def test_an_error_after_the_blocks_has_no_rank_prefix(tmp_path: Path) -> None:
    script = tmp_path / "after.py"
    script.write_text(
        "from ddpctx import distributed\n"
        "with distributed():\n    pass\n"
        "with distributed():\n    pass\n"
        "raise ValueError('after')\n"
    )
    result = run_python(script, timeout=60, env=child_env())
    assert result.returncode == 1
    assert "ValueError: after" in result.stderr
    assert "[rank0]" not in result.stderr, result.stderr
