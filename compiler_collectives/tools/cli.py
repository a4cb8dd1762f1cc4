"""Command line: ``python -m compiler_collectives <command>`` (or ``compiler-collectives``).

Each subcommand is an ``add_<name>_parser(subparsers)`` function that declares
its options and a ``cmd_<name>(args) -> int`` function that runs it; ``main``
only dispatches. To add a command (``report DIR``, ``doctor``, ...), write
those two functions and list the first in ``_COMMANDS``. The demo is not a
command of the library: it lives in ``scripts/demo.py`` (``scripts/dev demo``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _say(line: str = "") -> None:
    print(line, flush=True)


# --------------------------------------------------------------------- report


def add_report_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report",
        help="merge per-rank traces (COMPILER_COLLECTIVES_TRACE_DIR) and summarize them",
        description=(
            "Merge DIR/rank{N}.json, written by ranks run with COMPILER_COLLECTIVES_TRACE_DIR=DIR, "
            "into one Chrome trace with a process row per rank (load it in Perfetto or "
            "chrome://tracing), and print a per-rank, per-kind table (count, p50, p99, max, total, "
            "bytes), the slowest collectives and the ranks that arrived last most often."
        ),
        epilog="Exit status: 0 on success, 1 when the directory or a file cannot be used.",
    )
    p.add_argument("directory", metavar="DIR", help="the trace directory")
    p.add_argument(
        "--out", metavar="PATH", default=None, help="where to write the merged trace (default: DIR/merged.json)"
    )
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from ..errors import ReportError
    from . import report

    try:
        _say(report.run(args.directory, args.out))
    except ReportError as e:
        print(f"report: {e}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------- doctor


def add_doctor_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check the installation: torch version, Dynamo seams, switches, autoload, groups",
        description=(
            "Print the torch version, whether every Dynamo seam compiler_collectives needs is "
            "present, which switches are on and where each came from (environment, Python, torch "
            "config), whether autoload at `import torch` is active, and, under torchrun, the "
            "backend of the default process group and of our own groups (created for the check)."
        ),
        epilog="Exit status: 0 when nothing needed is missing, 1 otherwise (each problem comes with its fix).",
    )
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import doctor

    return doctor.run()


# --------------------------------------------------------------------- main

_COMMANDS: tuple[Callable[[Any], None], ...] = (add_report_parser, add_doctor_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m compiler_collectives",
        description="compiler_collectives: every rank of a torch.compile job makes the same compile decisions.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v: info, -vv: debug) from compiler_collectives"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.verbose:
        # Without -v, logging is left as configured (e.g. TORCH_LOGS=+compiler_collectives).
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("compiler_collectives").setLevel(logging.INFO if args.verbose == 1 else logging.DEBUG)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
