"""Command line: ``python -m compiler_collectives <command>`` (or ``compiler-collectives``).

Each subcommand is an ``add_<name>_parser(subparsers)`` function that declares
its options and a ``cmd_<name>(args) -> int`` function that runs it; ``main``
only dispatches. To add a command (``report DIR``, ``doctor``, ...), write
those two functions and list the first in ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import textwrap
import threading
import time
from typing import Any, Callable, Sequence


def _say(line: str = "") -> None:
    print(line, flush=True)


# --------------------------------------------------------------------- demo


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number > 0, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _run_list(text: str) -> tuple[str, ...]:
    from .demo import RUNS

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in RUNS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(RUNS)}; got {text!r}"
        )
    return names


def add_demo_parser(subparsers: Any) -> None:
    from .demo import DEFAULT_RUNS, RUNS, DemoConfig

    d = DemoConfig()
    runs_help = "; ".join(f"'{name}': {run.description}" for name, run in RUNS.items())
    p = subparsers.add_parser(
        "demo",
        help="train a small DDP + torch.compile model without and with the service, compare ranks",
        description=(
            "Train a tiny transformer language model with DistributedDataParallel (gloo, CPU) and "
            "torch.compile on several ranks that see different sequence lengths, once without "
            "and once with compiler_collectives, each run in fresh rank processes. Prints a "
            "per-rank table (compiles, recompiles, graphs, dynamic dims, guard collectives, "
            "forced recompiles, time in collectives, steps/s, status) and whether every rank "
            "made the same compile decisions. Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR "
            "and MASTER_PORT set) it runs only this rank's part and rank 0 prints the table."
        ),
        epilog=(
            "Exit status: 0 when every run that should finish finished and the service run's "
            "ranks agree; 1 otherwise; 2 for bad options."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nproc", type=_positive_int, default=d.nproc, metavar="N",
                   help="number of ranks (processes) to launch; ignored under torchrun")
    p.add_argument("--steps", type=_positive_int, default=d.steps, metavar="N",
                   help="training steps per run (at least 2)")
    p.add_argument("--backend", default=d.backend, metavar="NAME",
                   help="torch.compile backend, e.g. aot_eager, eager, inductor "
                        "(inductor needs a C++ compiler)")
    p.add_argument("--timeout", type=_positive_float, default=d.timeout, metavar="SECONDS",
                   help="wall-clock limit per run; ranks still running then are killed and the "
                        "run is reported as timed out (under torchrun: the collectives' timeout)")
    p.add_argument("--runs", type=_run_list, default=",".join(DEFAULT_RUNS), metavar="LIST",
                   help=f"comma-separated runs to do, in order. {runs_help}")
    p.add_argument("--batch-size", type=_positive_int, default=d.batch_size, metavar="N",
                   help="sequences per batch and rank")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the model weights and the synthetic token data")
    p.add_argument("--log-every", type=_positive_int, default=d.log_every, metavar="N",
                   help="print a progress line every N steps (from rank 0)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the per-rank results of every run as JSON to PATH")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    if args.steps < 2:
        print("demo: --steps must be at least 2", file=sys.stderr)
        return 2
    if args.nproc < 2 and not demo.launched_by_torchrun():
        print("demo: --nproc must be at least 2 (the point is ranks that disagree)", file=sys.stderr)
        return 2
    cfg = demo.DemoConfig(
        nproc=args.nproc,
        steps=args.steps,
        backend=args.backend,
        timeout=args.timeout,
        runs=args.runs,
        batch_size=args.batch_size,
        seed=args.seed,
        log_every=args.log_every,
    )
    started = time.monotonic()

    if demo.launched_by_torchrun():
        is_rank0 = os.environ.get("RANK") == "0"
        say = _say if is_rank0 else (lambda line="": None)
        say(f"compiler_collectives demo under torchrun: {os.environ['WORLD_SIZE']} ranks, "
            f"{cfg.steps} steps, backend {cfg.backend}")
        outcomes = demo.run_this_rank(cfg, progress=say)
        if outcomes is None:
            return 0
    else:
        _say(f"compiler_collectives demo: {cfg.nproc} ranks (gloo, CPU), {cfg.steps} steps per run, "
             f"backend {cfg.backend}, timeout {cfg.timeout:.0f}s per run")
        _say(textwrap.fill(
            f"Ranks see different sequence lengths: all start at {cfg.base_length} tokens; "
            "ranks 1.. switch to other lengths one after another (rank 0 never), and the last "
            "rank's final batch is short.", width=100))
        outcomes = []
        for name in cfg.runs:
            run = demo.RUNS[name]
            _say()
            _say(f"run '{name}': {run.description}")
            outcome = demo.launch_run(run, cfg, progress=_say)
            state = "finished" if outcome.finished else ("timed out" if outcome.timed_out else "failed")
            _say(f"  [{name}] {state} in {outcome.elapsed_s:.1f}s")
            outcomes.append(outcome)

    _say()
    _say(demo.format_table(outcomes, cfg.steps))
    _say()
    _say(textwrap.fill(
        "compiles: Dynamo frame compilations, recompiles: those of an already compiled frame; "
        "graphs: graphs handed to the backend; dynamic dims: graph inputs with symbolic sizes; "
        "guard colls: guard collectives run; forced: recompiles this rank did only because "
        "another rank's guards missed; coll time: time spent in compiler + guard collectives "
        "(mostly waiting for slower ranks); steps/s: over the whole run, compiles included.",
        width=100))
    _say(f"total wall time {time.monotonic() - started:.1f}s")
    for outcome in outcomes:
        if outcome.ranks and any(o.error for o in outcome.ranks):
            _say()
            for o in outcome.ranks:
                if o.error and o.status == "error":
                    _say(f"--- run '{outcome.run.name}', rank {o.rank}:\n{o.error.rstrip()}")
                    break  # the first traceback is usually the cause

    if args.json:
        with open(args.json, "w") as f:
            json.dump([demo.outcome_to_json(o) for o in outcomes], f, indent=2)
    return 0 if demo.demo_succeeded(outcomes) else 1


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
    p.add_argument("--out", metavar="PATH", default=None,
                   help="where to write the merged trace (default: DIR/merged.json)")
    p.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from . import report

    try:
        _say(report.run(args.directory, args.out))
    except report.ReportError as e:
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

_COMMANDS: tuple[Callable[[Any], None], ...] = (add_demo_parser, add_report_parser, add_doctor_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m compiler_collectives",
        description="compiler_collectives: every rank of a torch.compile job makes the same "
                    "compile decisions.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more (-v: info, -vv: debug) from compiler_collectives")
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
    # A SIGTERM (a CI job cancelled, `timeout`, ...) unwinds like Ctrl-C, so the
    # commands' cleanup runs: the demo kills and reaps its rank processes.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if in_main_thread else None
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
