"""Sections 3 and 4 of ``run.py``: forming and destroying the process group, and importing ddpctx.

Run by benchmarks/run.py as: torchrun --standalone --nproc_per_node=N benchmarks/startup.py ROUNDS
There (:func:`rank_main`) rank 0 prints "MEDIAN raw=<s>" and "MEDIAN ddpctx=<s>". Both do a
rendezvous through torchrun's store each round; the raw path prefixes its keys per round, as
ddpctx does, since torch cannot otherwise form a default group twice on the same store.

Contract: :func:`startup_single` times raw ``init_process_group`` + ``destroy_process_group``
against ``with distributed()`` in this process (world size 1), :func:`startup_torchrun` the
same under torchrun at N ranks (rank 0's medians), :func:`import_cost` ``import torch``
against ``import ddpctx; ddpctx.distributed`` in fresh interpreters, interleaved;
:func:`startup_section` says both sections' markdown.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository, not benchmarks/, heads sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.processes import HERE, fresh_interpreter_seconds, repo_env, torchrun
from benchmarks.report import Say


def rank_main(rounds: int) -> None:
    """One rank under torchrun: ``rounds`` raw groups and ``distributed()`` blocks in turn."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore
    from torch.distributed.rendezvous import rendezvous

    from ddpctx import distributed

    raw: list[float] = []
    ours: list[float] = []
    rank = 0
    for index in range(rounds):
        started = time.perf_counter()
        store, rank, world_size = next(rendezvous("env://"))
        prefixed = PrefixStore(f"raw/{index}/", store)
        dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world_size)
        dist.barrier()
        dist.destroy_process_group()
        raw.append(time.perf_counter() - started)
        started = time.perf_counter()
        with distributed() as ctx:
            ctx.barrier()
        ours.append(time.perf_counter() - started)
    if rank == 0:
        print(f"MEDIAN raw={statistics.median(raw)}")
        print(f"MEDIAN ddpctx={statistics.median(ours)}")


def startup_single(rounds: int) -> dict[str, list[float]]:
    """One process: seconds of a raw group formed and destroyed, and of ``distributed()``."""
    import torch.distributed as dist

    from ddpctx import distributed
    from ddpctx.session.group import loopback_gloo

    results: dict[str, list[float]] = {"raw init + destroy": [], "with distributed()": []}
    for _ in range(rounds):
        started = time.perf_counter()
        with loopback_gloo():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
        dist.destroy_process_group()
        results["raw init + destroy"].append(time.perf_counter() - started)
        started = time.perf_counter()
        with distributed():
            pass
        results["with distributed()"].append(time.perf_counter() - started)
    return results


def startup_torchrun(world_size: int, rounds: int) -> dict[str, float]:
    """Runs benchmarks/startup.py under torchrun; returns rank 0's medians."""
    command = torchrun(world_size, HERE / "startup.py", rounds)
    output = subprocess.run(
        command, capture_output=True, text=True, env=repo_env(), timeout=300, check=True
    )
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^MEDIAN (.+?)=([0-9.e-]+)$", output.stdout, re.M)
    }


def import_cost(rounds: int) -> dict[str, list[float]]:
    """Seconds of ``import torch`` and of ``import ddpctx; ddpctx.distributed``, in turn."""
    results: dict[str, list[float]] = {"import torch": [], "import ddpctx (+ distributed)": []}
    for _ in range(rounds):  # interleaved
        results["import torch"] += fresh_interpreter_seconds("import torch", 1)
        results["import ddpctx (+ distributed)"] += fresh_interpreter_seconds(
            "import ddpctx; ddpctx.distributed", 1
        )
    return results


def startup_section(say: Say, quick: bool, world: int) -> None:
    """Sections 3 (start-up and teardown, 1 process and ``world`` ranks) and 4 (imports)."""
    say("\n## 3. Start-up and teardown (median)\n")
    single = startup_single(10 if quick else 30)
    ranks = startup_torchrun(world, 5 if quick else 15)
    say("| | raw init + destroy | with distributed() | ratio |\n|---|---:|---:|---:|")
    single_raw, single_ours = (
        statistics.median(single[k]) for k in ("raw init + destroy", "with distributed()")
    )
    say(
        f"| 1 process | {single_raw * 1e3:.1f} ms | {single_ours * 1e3:.1f} ms "
        f"| {single_ours / single_raw:.2f}x |"
    )
    say(
        f"| {world} ranks (torchrun) | {ranks['raw'] * 1e3:.1f} ms "
        f"| {ranks['ddpctx'] * 1e3:.1f} ms | "
        f"{ranks['ddpctx'] / ranks['raw']:.2f}x |"
    )

    say("\n## 4. Import cost (fresh interpreters, median)\n")
    imports = import_cost(3 if quick else 7)
    torch_import, ours_import = (statistics.median(imports[k]) for k in imports)
    say(
        f"`import torch` {torch_import:.2f} s; `import ddpctx; ddpctx.distributed` "
        f"{ours_import:.2f} s: {ours_import / torch_import:.2f}x (target <= 1.15x). "
        "`import ddpctx` alone does not import torch."
    )


if __name__ == "__main__":
    rank_main(int(sys.argv[1]))
