"""Forming and tearing down the process group, and the exits around it.

- :func:`init_group`: one process -> an in-memory store (no rendezvous at
  all); torchrun -> ``env://`` (torchrun's own store); SLURM / Open MPI ->
  ``tcp://`` to rank 0. Each formation gets its own key prefix in the store
  (:func:`formation_store`), and gloo is pinned to loopback for groups that
  never leave this machine (:func:`loopback_gloo`).
- :func:`destroy_group_bounded`: teardown that cannot hang the exit path.
- :func:`exit_on_sigterm`: SIGTERM from a launcher becomes ``SystemExit(143)``
  so clean-up runs.
- :func:`record_for_torchrun`: the failing rank's exception, written where
  torchrun looks for it (torch's ``@record`` format).

Split out of :mod:`ddpctx.context`, which composes these into
``distributed()``.
"""

from __future__ import annotations

import builtins
import contextlib
import inspect
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

from ddpctx.env import LaunchInfo
from ddpctx.errors import is_follow_on
from ddpctx.formation import form_group

#: How long exit waits for ``destroy_process_group`` before giving up on it.
DESTROY_TIMEOUT_S = 30.0


@contextlib.contextmanager
def loopback_gloo() -> Iterator[None]:
    """Pin gloo's transport to the loopback interface while a group is formed.

    gloo listens on the address the host name resolves to -- often a LAN
    address -- even for one process. Groups ddpctx forms by itself are local,
    so they must not be reachable from the network.
    """
    names = [name for _, name in socket.if_nameindex()]
    loopback = next((n for n in ("lo", "lo0") if n in names), None)
    if loopback is None:  # no loopback interface known by name: nothing to pin
        yield
        return
    previous = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = loopback
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = previous


def init_kwargs(plan_backend: str, device: torch.device, timeout: timedelta) -> dict[str, Any]:
    """Arguments for ``init_process_group`` common to every launcher.

    On CUDA, ``device_id`` binds the group to this rank's GPU (eager NCCL
    init, and no guessing of the device in barriers) where torch supports it.
    """
    kwargs: dict[str, Any] = {"backend": plan_backend, "timeout": timeout}
    if device.type == "cuda" and _init_accepts_device_id():
        kwargs["device_id"] = device
    return kwargs


def _init_accepts_device_id() -> bool:
    return "device_id" in inspect.signature(dist.init_process_group).parameters


def init_group(info: LaunchInfo, backend: str, device: torch.device, timeout: timedelta) -> None:
    """Form the default process group for ``info``'s launcher (see the module docstring)."""
    kwargs = init_kwargs(backend, device, timeout)
    if info.world_size == 1:
        with loopback_gloo():
            store = dist.HashStore()  # type: ignore[attr-defined]  # exported, not re-declared
            form_group(store, rank=0, world_size=1, **kwargs)
        return
    # env:// lets torchrun hand over its own store (TORCHELASTIC_USE_AGENT_STORE).
    url = (
        "env://"
        if info.launcher in ("torchrun", "launch")
        else f"tcp://{info.master_addr}:{info.master_port}"
    )
    store, _, _ = next(rendezvous(url, rank=info.rank, world_size=info.world_size, timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(
        store=formation_store(store, info.rank),
        rank=info.rank,
        world_size=info.world_size,
        **kwargs,
    )


def formation_store(store: Any, rank: int) -> Any:
    """A view of ``store`` private to this formation of the process group.

    torch names every default group's keys alike, so a group formed again on
    the same store (a second ``distributed()`` in one torchrun job, a group
    formed after someone else's) can read the previous group's stale addresses
    and fail to connect. Each rank counts its formations in the store itself;
    the count, the same on every rank, prefixes the new group's keys.
    """
    generation = store.add(f"ddpctx/formations/rank{rank}", 1)
    return PrefixStore(f"ddpctx/{generation}/", store)


def destroy_group_bounded() -> None:
    """Destroy the default group, giving up after ``DESTROY_TIMEOUT_S``.

    Runs in a helper thread so that a backend stuck on a dead peer cannot hold
    the exit path hostage; the process may then exit with the group alive.
    Never raises: an error here must not replace the exception leaving the block.
    """
    failure: list[BaseException] = []

    def destroy() -> None:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException as error:  # reported below, never raised
            failure.append(error)

    worker = threading.Thread(target=destroy, name="ddpctx-destroy", daemon=True)
    worker.start()
    worker.join(DESTROY_TIMEOUT_S)
    if worker.is_alive():
        warnings.warn(
            f"destroy_process_group() did not return within {DESTROY_TIMEOUT_S:.0f} s; "
            "leaving it behind so this process can exit.",
            RuntimeWarning,
            stacklevel=2,
        )
    elif failure:
        warnings.warn(
            f"destroy_process_group() failed: {failure[0]!r}", RuntimeWarning, stacklevel=2
        )


def exit_on_sigterm(rank: int) -> Callable[[], None] | None:
    """Make SIGTERM raise ``SystemExit(143)`` so clean-up runs; returns the undo.

    Only from the main thread, and only when nobody installed a handler of
    their own. A rank blocked inside a C++ collective runs the handler when
    the collective returns or times out; launchers follow SIGTERM with SIGKILL
    after a grace period (torchrun: 30 s), which bounds that case.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:
        return None

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends us at once
        builtins.print(
            f"ddpctx: rank {rank} received SIGTERM; leaving distributed() and "
            "destroying the process group.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(128 + signum)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    signal.signal(signal.SIGTERM, on_sigterm)
    return restore


def record_for_torchrun(exc: BaseException, environ: Mapping[str, str]) -> None:
    """Write ``exc`` where torchrun looks for a worker's error (torch's ``@record`` format).

    torchrun names as root cause the failure with the smallest timestamp, in
    whole seconds. A rank whose collective failed because a peer died usually
    fails within the same second as that peer; its record is dated one second
    later so the rank that failed first is the one named.
    """
    path = environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    follow_on = isinstance(exc, RuntimeError) and is_follow_on(str(exc))
    timestamp = int(time.time()) + (1 if follow_on else 0)
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(
                    traceback.format_exception(type(exc), exc, exc.__traceback__)
                ),
                "timestamp": str(timestamp),
            },
        }
    }
    try:
        with open(path, "w") as handle:
            json.dump(data, handle)
    except OSError as error:
        warnings.warn(
            f"could not write TORCHELASTIC_ERROR_FILE={path!r}: {error}",
            RuntimeWarning,
            stacklevel=2,
        )
