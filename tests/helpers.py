"""Helpers for tests that start real processes: torchrun runs, socket tables, collectives."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

#: The most a bound is stretched on a loaded machine (see :func:`patience`).
MAX_STRETCH = 6.0

#: What brings the packages the integration tests run against (see :func:`require_integration`).
INTEGRATIONS_INSTALL = 'pip install -e ".[test,integrations]"'


def require_integration(*packages: str) -> None:
    """Skip the test, naming the extra to install, unless every one of ``packages`` is there.

    TensorBoard, MLflow, W&B, Ray and Hugging Face ``datasets`` are the
    ``integrations`` extra, not the ``test`` one, so that a first install stays
    quick. With ``DDPCTX_REQUIRE_INTEGRATIONS=1`` (CI sets it) a missing package
    fails the test instead: there the integration tests never pass by skipping.
    Nothing is imported (``import mlflow`` alone takes seconds). A whole test says
    it with ``@pytest.mark.integration("mlflow")``, which tests/conftest.py checks
    before the test's fixtures are set up.
    """
    import pytest

    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if not missing:
        return
    reason = (
        f"needs {', '.join(missing)}, not installed: the integration tests run with "
        f"{INTEGRATIONS_INSTALL}"
    )
    if os.environ.get("DDPCTX_REQUIRE_INTEGRATIONS", "") not in ("", "0"):
        pytest.fail(f"{reason} (DDPCTX_REQUIRE_INTEGRATIONS is set: they may not be skipped)")
    pytest.skip(reason)


def patience(seconds: float) -> float:
    """``seconds``, stretched by how oversubscribed the CPUs are now (load per core, 1 to 6x).

    A bound that holds on an idle machine (a job ends within 30 s) fails on a
    shared CI runner where every process gets a fraction of a core: bounds on
    other processes' progress scale with the load instead of being fixed.
    """
    load_per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * min(MAX_STRETCH, max(1.0, load_per_core))


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child: this one, without launcher variables, plus ``extra``."""
    from tests.conftest import LAUNCHER_NAMES, LAUNCHER_PREFIXES

    env = {
        name: value
        for name, value in os.environ.items()
        if name not in LAUNCHER_NAMES and not name.startswith(LAUNCHER_PREFIXES)
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def signals_as_at_a_terminal() -> None:
    """``preexec_fn`` for a child a test sends Ctrl-C or a hangup: both as at a terminal.

    A suite started in the background by a non-interactive shell hands its children
    SIGINT ignored, and under ``nohup`` SIGHUP too; a program rightly keeps an
    ignored signal ignored (``launch`` does), so such a test would wait for an exit
    that never comes. The child gets the default actions first.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def run_python(
    script: Path, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python script args`` as one process, bounded in time."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=patience(timeout),
        env=env or child_env(),
        cwd=REPO,
    )


def torchrun_command(
    script: Path, *args: str, nproc: int = 2, launcher_args: tuple[str, ...] = ("--standalone",)
) -> list[str]:
    """``torchrun [launcher_args] --nproc_per_node=nproc script args`` as an argument list.

    ``--monitor-interval`` is short so that a failed rank is noticed fast.
    """
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher_args,
        f"--nproc_per_node={nproc}",
        "--monitor-interval=0.2",
        str(script),
        *args,
    ]


def start_torchrun(
    script: Path, *args: str, nproc: int = 2, launcher_args: tuple[str, ...] = ("--standalone",)
) -> subprocess.Popen[str]:
    """Start a torchrun job in the background (its own session, so it can be signalled whole)."""
    return subprocess.Popen(
        torchrun_command(script, *args, nproc=nproc, launcher_args=launcher_args),
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run_torchrun(
    script: Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``torchrun --standalone --nproc_per_node=nproc script args``, bounded in time.

    ``subprocess.run`` kills torchrun on timeout; torchrun's workers are in its
    process group and die with it.
    """
    return subprocess.run(
        torchrun_command(script, *args, nproc=nproc),
        capture_output=True,
        text=True,
        timeout=patience(timeout),
        env=env or child_env(),
        cwd=REPO,
    )


def child_pids(parent: int) -> list[int]:
    """Live (not zombie) child processes of ``parent``, from /proc, in pid order."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(entry.name))
    return sorted(found)


def still_running(pids: list[int], grace: float = 5) -> list[int]:
    """The pids that still exist after waiting up to ``grace`` seconds for them to go."""
    deadline = time.monotonic() + patience(grace)
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def wait_for_files(folder: Path, pattern: str, count: int, timeout: float = 60) -> list[Path]:
    """Wait until ``folder`` holds ``count`` files matching ``pattern``; return them."""
    deadline = time.monotonic() + patience(timeout)
    while len(found := sorted(folder.glob(pattern))) < count:
        assert time.monotonic() < deadline, f"only {len(found)} of {count} {pattern} in {folder}"
        time.sleep(0.05)
    return found


def listening_addresses(pid: int) -> list[str]:
    """``ip:port`` of every TCP socket ``pid`` is listening on (Linux /proc)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address_hex, port_hex = local.split(":")
            raw = bytes.fromhex(address_hex)
            # /proc prints each 32-bit word in host byte order.
            words = [
                struct.pack("<I", struct.unpack(">I", raw[i : i + 4])[0])
                for i in range(0, len(raw), 4)
            ]
            address = socket.inet_ntop(family, b"".join(words))
            found.append(f"{address}:{int(port_hex, 16)}")
    return found


def store_sync(key: str, world_size: int, give_up_s: float = 120.0) -> None:
    """In a rank: wait until ``world_size`` ranks reached ``key``, over the job's store.

    Not a collective, so a rank that arrives late on a loaded machine is no hang to
    the hang doctor, and no collective timeout can fire: scripts that test a hang
    line their ranks up with it before the hang they stage.
    """
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    store.add(key, 1)
    deadline = time.monotonic() + give_up_s
    while int(store.add(key, 0)) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{world_size} ranks did not reach {key!r} in {give_up_s} s")
        time.sleep(0.02)


def stored(key: str, give_up_s: float = 120.0) -> bool:
    """In a rank: poll the job's store until ``key`` is set; False after ``give_up_s``.

    Polled, not a store ``wait``: a wait holds the store's one connection, and this
    rank's hang doctor could not answer meanwhile.
    """
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    deadline = time.monotonic() + give_up_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def shared_fifo(rank: int, world_size: int) -> tuple[str, str]:
    """In a rank: ``(fifo, folder)``, a FIFO that rank 0 makes in a new folder.

    Every rank gets the FIFO's path; only rank 0 gets the folder (others ""), to
    remove once done. With :func:`hold_the_gil_until_opened` one rank stalls
    with its GIL held, and another ends the stall with :func:`open_for_writing`.
    """
    import tempfile

    import torch.distributed as dist

    folder = tempfile.mkdtemp() if rank == 0 else ""
    if rank == 0:
        os.mkfifo(os.path.join(folder, "resume"))
    paths: list[object] = [None] * world_size
    dist.all_gather_object(paths, os.path.join(folder, "resume"))
    return str(paths[0]), folder


def hold_the_gil_until_opened(fifo: str) -> None:
    """Open ``fifo`` for reading from native code that keeps the GIL (``ctypes.PyDLL``).

    The open blocks until a writer opens the FIFO: meanwhile no other thread of this
    process runs Python, the hang doctor's watchdog included.
    """
    import ctypes

    os.close(ctypes.PyDLL(None).open(fifo.encode(), os.O_RDONLY))


def open_for_writing(fifo: str) -> None:
    """End the stall of a rank in :func:`hold_the_gil_until_opened`."""
    os.close(os.open(fifo, os.O_WRONLY))


def checkpoint_names(folder: Path) -> list[str]:
    """The checkpoints in ``folder``, sorted, once every single-file one is checked to have its
    checksum manifest (``.pt.sums``, and no manifest without its file).

    Left out: those manifests and the writer lock a running job holds (``.ddpctx-writer.lock``).
    """
    names = sorted(path.name for path in folder.iterdir())
    manifests = {name for name in names if name.endswith(".pt.sums")}
    files = {name for name in names if name.startswith("checkpoint-") and name.endswith(".pt")}
    assert manifests == {name + ".sums" for name in files}, names
    return [name for name in names if name not in manifests and name != ".ddpctx-writer.lock"]


def build_site(folder: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` into ``folder/html``, in a process that cannot import torch.

    The site is promised to build without torch (mkdocstrings reads the source
    statically): a ``torch`` that raises on import is put first on the path.
    """
    blocker = folder / "no-torch"
    (blocker / "torch").mkdir(parents=True, exist_ok=True)
    (blocker / "torch" / "__init__.py").write_text(
        "raise ImportError('building the documentation must not import torch')\n"
    )
    path = os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder / "html")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=patience(300),
    )


class Reductions:
    """The element count of every reduction collective issued, while inside (the real ones run).

    A reduction is a ``dist.all_reduce``, or a ``dist.all_gather`` (a small buffer of a 2-rank
    gloo group travels that way: ``ddpctx.reduce.transport``); object gathers do not count.
    """

    def __enter__(self) -> Reductions:
        import torch.distributed as dist

        self.sizes: list[int] = []
        self.originals = (dist.all_reduce, dist.all_gather)

        def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.sizes.append(tensor.numel())
            return self.originals[0](tensor, *args, **kwargs)

        def all_gather(outputs: Any, tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.sizes.append(tensor.numel())
            return self.originals[1](outputs, tensor, *args, **kwargs)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather  # type: ignore[assignment]
        return self

    @property
    def calls(self) -> int:
        return len(self.sizes)

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.all_reduce, dist.all_gather = self.originals  # type: ignore[assignment]


def shared_folder(ctx: Any, factory: Any, name: str = "run") -> Path:
    """A fresh temporary folder made by rank 0, the same path on every rank (a collective)."""
    return Path(ctx.broadcast(str(factory.mktemp(name)) if ctx.is_main else None))


def two_sharded_layers(ctx: Any) -> Any:
    """``Linear(8, 16)`` then ``Linear(16, 4)``, each block sharded by ``ctx.shard``."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return ctx.shard(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), blocks=[nn.Linear])
