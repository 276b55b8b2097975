"""Forming and tearing down the process group, and the exits around it.

- :func:`init_group`: one process -> an in-memory store (no rendezvous at
  all); torchrun -> ``env://`` (torchrun's own store); SLURM / Open MPI and
  the rendezvous variables ``launch()`` hands a task with ``init=False`` ->
  a store rank 0 serves on the address ``MASTER_ADDR`` names only. Each
  formation gets its own key prefix in the store (:func:`formation_store`),
  and gloo is pinned to loopback for groups that never leave this machine
  (:func:`loopback_gloo`).
- :func:`destroy_group_bounded`: teardown that cannot hang the exit path.
- :func:`peel_rank_prefix`: torch's ``init_process_group`` wraps ``sys.excepthook``
  to prefix ``[rankN]: `` and never unwraps it; a process that forms groups one
  after another would print ``[rank0]: [rank0]: ...``. Each formation starts
  from the hook under those layers, so an error shows one prefix.
- :func:`record_for_torchrun`: the failing rank's exception, written where
  torchrun looks for it (torch's ``@record`` format).

Split out of :mod:`ddpctx.session.context`, which composes these into
``distributed()``.
"""

from __future__ import annotations

import contextlib
import inspect
import ipaddress
import os
import socket
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

from ddpctx.session.formation import form_group
from ddpctx.utils.env import LaunchInfo

TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]  # exported, not re-declared

#: How long exit waits for ``destroy_process_group`` before giving up on it.
DESTROY_TIMEOUT_S = 30.0


#: The ``__qualname__`` of the hook torch's ``init_process_group`` installs.
_TORCH_RANK_HOOK = "init_process_group.<locals>._distributed_excepthook"

ExceptHook = Callable[..., Any]


def peel_rank_prefix() -> ExceptHook:
    """Set ``sys.excepthook`` to the hook under torch's rank-prefix layers; return it.

    A hook that is not torch's (the user's own, IPython's) is kept as it is.
    """
    hook: ExceptHook = sys.excepthook
    while getattr(hook, "__qualname__", "") == _TORCH_RANK_HOOK:
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or (), strict=False))
        if "old_hook" not in cells:  # another torch than this was written for: leave it
            break
        hook = cells["old_hook"].cell_contents
    sys.excepthook = hook
    return hook


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
    check_resolvable(info.master_addr, info.master_addr_from)
    with naming_a_busy_port(info):
        if info.launcher == "torchrun":
            # env:// lets torchrun hand over its own store (TORCHELASTIC_USE_AGENT_STORE).
            store, _, _ = next(
                rendezvous("env://", rank=info.rank, world_size=info.world_size, timeout=timeout)
            )
        else:  # SLURM, Open MPI, a task of launch()/the plugin forming its own group
            store = host_store(info, timeout)
    store.set_timeout(timeout)
    local_only = info.launcher != "torchrun" and _is_loopback(info.master_addr or "")
    with loopback_gloo() if local_only else contextlib.nullcontext():
        dist.init_process_group(
            store=formation_store(store, info.rank),
            rank=info.rank,
            world_size=info.world_size,
            **kwargs,
        )


def check_resolvable(host: str | None, source: str = "MASTER_ADDR") -> None:
    """Rank 0's host failing to resolve here is an error now, not a retry loop to the timeout.

    ``source`` names where ``host`` was read (``LaunchInfo.master_addr_from``):
    ``MASTER_ADDR``, or the SLURM node list whose first host it is. A temporary
    DNS failure (``EAI_AGAIN``) is left to torch's retries.

    >>> check_resolvable("no-such-host.invalid")
    Traceback (most recent call last):
    ...
    ValueError: MASTER_ADDR='no-such-host.invalid' does not resolve on this host ...
    """
    if not host:
        return
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        if error.errno == socket.EAI_AGAIN:
            return
        fix = (
            "Set MASTER_ADDR to rank 0's host name or IP address as every node resolves it "
            "(e.g. `hostname -i` on rank 0's node), or 127.0.0.1 on one machine."
        )
        if source == "MASTER_ADDR":
            raise ValueError(
                f"MASTER_ADDR={host!r} does not resolve on this host ({error.strerror}), so "
                "this rank cannot reach rank 0's rendezvous store (torch would retry until "
                f"the timeout). {fix}"
            ) from None
        name = source.split("=", 1)[0]
        raise ValueError(
            f"rank 0's host {host!r}, the first host of {source} (MASTER_ADDR is not set, so "
            f"ddpctx took it from {name}), does not resolve on this host ({error.strerror}), "
            "so this rank cannot reach rank 0's rendezvous store. SLURM sets the node list "
            "for the job: a value copied from another job or cluster names hosts that are "
            f"not here -- run the script with srun inside its allocation, or unset {name}. "
            f"{fix}"
        ) from None


@contextlib.contextmanager
def naming_a_busy_port(info: LaunchInfo) -> Iterator[None]:
    """Rank 0's store failing to listen on a port in use: an error naming ``MASTER_PORT``."""
    try:
        yield
    except (RuntimeError, OSError) as error:  # torch's DistNetworkError is a RuntimeError
        text = str(error)
        if "EADDRINUSE" not in text and "Address already in use" not in text:
            raise
        raise RuntimeError(
            f"MASTER_PORT={info.master_port} is already in use on rank 0's host "
            f"({info.master_addr}): another job, or an earlier run still exiting, listens "
            "there, so the rendezvous store cannot. Set MASTER_PORT to a free port (e.g. "
            f"{(info.master_port or 29500) + 1}), or stop that process."
        ) from error


def host_store(info: LaunchInfo, timeout: timedelta) -> Any:
    """The store for SLURM, Open MPI and ``launch()``'s own: rank 0 serves it, the others connect.

    torch's TCPStore server listens on every interface whatever host it is
    given. Rank 0 therefore binds the listening socket itself, to the address
    ``MASTER_ADDR`` resolves to -- the one the other ranks connect to, and
    loopback only when the whole job is on this machine -- and hands it over.
    Where that address cannot be bound here, the store listens on all
    interfaces as torch does, with a warning.
    """
    host, port = info.master_addr or "", info.master_port or 0
    if info.rank != 0:
        return TCPStore(host, port, info.world_size, False, timeout)
    listener = _listen_on(host, port)
    if listener is None:
        store, _, _ = next(
            rendezvous(tcp_url(info), rank=0, world_size=info.world_size, timeout=timeout)
        )
        return store
    return TCPStore(
        host,
        port,
        info.world_size,
        True,
        timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store owns and closes it
    )


def _listen_on(host: str, port: int) -> socket.socket | None:
    """A socket listening on ``host``'s address only, or None (with a warning) if impossible."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM
        )[0]
        listener = socket.socket(family, kind, proto)
    except OSError as error:
        reason = str(error)
    else:
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(1024)
            return listener
        except OSError as error:
            listener.close()
            reason = str(error)
    warnings.warn(
        f"could not listen on MASTER_ADDR={host!r} port {port} only ({reason}); the rendezvous "
        "store listens on every interface of this host instead. Set MASTER_ADDR to an "
        "address of rank 0's host to keep it to that interface.",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def _is_loopback(host: str) -> bool:
    """Whether ``host`` resolves to loopback addresses only (then gloo stays on loopback too)."""
    try:
        found = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(entry[4][0]).is_loopback for entry in found)


def tcp_url(info: LaunchInfo) -> str:
    """``tcp://host:port`` for rank 0's store; an IPv6 address goes in brackets.

    >>> tcp_url(LaunchInfo("slurm", 0, 2, 0, 1, 0, master_addr="::1", master_port=29500))
    'tcp://[::1]:29500'
    """
    host = info.master_addr or ""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{info.master_port}"


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
