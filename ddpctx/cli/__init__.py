"""``python -m ddpctx`` (also the ``ddpctx`` command): ``env``, ``check`` and ``export``.

- ``ddpctx env [--json]``: what ddpctx detects here -- launcher, ranks, the
  backend and device ``distributed()`` would choose, GPUs, torch / CUDA /
  NCCL / gloo versions, and the environment variables that steer them. It
  never forms a process group, so it also works when forming one is the
  problem. Under torchrun every rank prints its own block, headed by its rank:
  ranks differ in ``LOCAL_RANK`` and device, and across nodes in host and GPUs.
- ``ddpctx check [--world-size N] [--sizes 1024,262144]``: starts N local
  ranks with ``ddpctx.launch`` (or, under torchrun, uses the job's ranks)
  and checks every collective ddpctx relies on -- all_reduce, broadcast,
  all_gather, barrier, the object collectives and ``@all_reduced`` --
  verifying the numbers, with latency and bandwidth per message size. Sizes
  are float32 element counts; the table shows elements and bytes. A
  ``GLOO_SOCKET_IFNAME`` that names no interface here is a failed check of
  its own. Exits non-zero, naming what failed. The first thing to run on a
  new cluster.
- ``ddpctx export CHECKPOINT OUT.pt [--safetensors]``: the checkpoint's (a
  checkpoint directory's newest that loads, or one ``.pt`` / ``.dcp``)
  weights as a plain state dict, with its meta, for code outside ddpctx
  (:mod:`ddpctx.checkpoint.export`). No process group.

For maintainers: the commands live in :mod:`ddpctx.cli.environment` and
:mod:`ddpctx.cli.check`; this module is the argument parser and the entry
point (``console``).

May import: every subsystem; nothing imports the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence

from ddpctx.cli.check import check_everywhere, format_table, merge, run_checks, sizes
from ddpctx.cli.environment import (
    describe_environment,
    environment_rows,
    format_environment,
    in_a_multi_rank_job,
    interface_problems,
)

__all__ = ["console", "describe_environment", "interface_problems", "main", "merge", "run_checks"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown (not for flags), descriptions and examples kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0:  # a flag: "(default: False)" says nothing
            return action.help
        return super()._get_help_string(action)


_DESCRIPTION = "Inspect and check the distributed set-up that ddpctx sees on this machine."

_EXAMPLES = """\
examples:
  ddpctx env
  ddpctx check --world-size 2 --sizes 256,65536
  torchrun --nproc_per_node=8 -m ddpctx check    # the job's own ranks (NCCL on GPUs)
  ddpctx export runs/demo model.pt               # newest checkpoint that loads -> plain file
"""


def _parser() -> argparse.ArgumentParser:
    from ddpctx import __version__

    parser = argparse.ArgumentParser(
        prog="ddpctx",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ddpctx {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{env,check,export}")
    env = commands.add_parser(
        "env",
        help="what ddpctx detects: launcher, ranks, backend, device, GPUs, versions",
        description="Show what ddpctx detects here: launcher, ranks, backend, device, GPUs,\n"
        "versions, and the environment variables that steer them. It forms no process\n"
        "group. Under torchrun every rank prints its own block, headed by its rank.",
        formatter_class=_HelpFormatter,
    )
    env.add_argument(
        "--json", action="store_true", help="print JSON (one line per rank under a launcher)"
    )
    check = commands.add_parser(
        "check",
        help="check every collective ddpctx relies on, with timings; non-zero exit on failure",
        description="Check every collective ddpctx relies on, with latency and bandwidth, on\n"
        "--world-size local ranks started here or, under torchrun, on the job's ranks.\n"
        "Exits non-zero naming what failed.",
        formatter_class=_HelpFormatter,
    )
    check.add_argument(
        "--world-size",
        type=int,
        default=2,
        help="local ranks to start (ignored under torchrun, which sets the ranks)",
    )
    check.add_argument(
        "--sizes",
        type=sizes,
        default="256,65536,1048576",
        help="message sizes in float32 elements (4 bytes each), separated by commas",
    )
    export = commands.add_parser(
        "export",
        help="write a checkpoint's weights and meta as a plain state dict (.pt or .safetensors)",
        description="Write a checkpoint's weights (a plain state dict, no DDP/FSDP prefixes) and\n"
        "its meta to OUT, loadable with torch.load(OUT, weights_only=True) (or safetensors).\n"
        "CHECKPOINT: a checkpoint directory (its newest checkpoint that loads) or one\n"
        "checkpoint (.pt or sharded .dcp). One process, no process group.",
        formatter_class=_HelpFormatter,
    )
    export.add_argument("checkpoint", help="checkpoint directory, or one .pt / .dcp checkpoint")
    export.add_argument("out", help="the file to write (.pt, or .safetensors)")
    export.add_argument(
        "--safetensors",
        action="store_true",
        help="write safetensors (meta as JSON under 'ddpctx.meta'); needs ddpctx[export]",
    )
    return parser


def _export(checkpoint: str, out: str, safetensors: bool) -> int:
    from ddpctx.checkpoint.export import export_checkpoint

    try:
        written = export_checkpoint(checkpoint, out, safetensors=safetensors)
    except (OSError, ImportError, ValueError, TypeError, RuntimeError) as error:
        print(f"ddpctx export: {error}", file=sys.stderr)
        return 1
    print(f"ddpctx export: wrote {written} ({written.stat().st_size} bytes)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)

    if args.command == "env":
        report = describe_environment()
        several = in_a_multi_rank_job()
        if args.json:
            text = json.dumps(report) if several else json.dumps(report, indent=2)
        else:
            text = format_environment(report, header=several)
        sys.stdout.write(text + "\n")  # one write: ranks' blocks do not interleave
        sys.stdout.flush()
        return 0 if report.get("problem") is None else 1

    if args.command == "export":
        return _export(args.checkpoint, args.out, args.safetensors)

    if args.world_size < 1:
        parser.error(f"--world-size {args.world_size}: must be at least 1")
    from ddpctx.launching.preflight import max_local_ranks

    if "RANK" not in os.environ and args.world_size > max_local_ranks():
        parser.error(
            f"--world-size {args.world_size}: more ranks than this machine can hold "
            f"(at most {max_local_ranks()} local processes); pass a smaller --world-size, "
            "or run the check under torchrun across nodes"
        )
    from ddpctx import distributed, launch
    from ddpctx.utils.errors import record_for_torchrun

    environment = environment_rows()
    if any(not row["ok"] for row in environment):
        # gloo would fail with a raw traceback on every rank: report it as a check instead.
        # Under torchrun, local rank 0 reports and fails the job (and names the problem in
        # torchrun's summary); the node's other ranks exit quietly, so that torchrun cannot
        # stop the reporting rank before it has printed.
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return 0
        world_size = int(os.environ.get("WORLD_SIZE", args.world_size))
        print(format_table(environment, world_size, "none (ranks not started)"), flush=True)
        print("FAILED: GLOO_SOCKET_IFNAME", file=sys.stderr)
        record_for_torchrun(ValueError(environment[0]["failures"][0]), os.environ)
        return 1
    if "RANK" in os.environ:  # already one of torchrun's ranks: check the job itself
        with contextlib.ExitStack() as stack:
            try:
                ctx = stack.enter_context(distributed())
            except (ValueError, RuntimeError) as error:
                print(f"ddpctx check: FAILED forming the process group: {error}", file=sys.stderr)
                record_for_torchrun(error, os.environ)
                return 1
            per_rank = check_everywhere(args.sizes)
            world_size, backend, is_main = ctx.world_size, ctx.backend, ctx.is_main
    else:
        import torch

        per_rank = launch(check_everywhere, args.sizes, world_size=args.world_size, timeout=300)[0]
        world_size, is_main = args.world_size, True
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    rows = environment + merge(per_rank)
    if is_main:
        print(format_table(rows, world_size, backend))
    failed = [row["collective"] for row in rows if not row["ok"]]
    if failed and is_main:
        print(f"FAILED: {', '.join(dict.fromkeys(failed))}", file=sys.stderr)
    return 1 if failed else 0


def console() -> None:
    """The ``ddpctx`` console script."""
    raise SystemExit(main())
