"""The demo: what the service is for, in one command (``scripts/dev demo``).

The story it tells
------------------
Every rank trains the same tiny transformer language model under
``DistributedDataParallel`` (gloo, CPU) and ``torch.compile``. The ranks see
*different sequence lengths*, as they do with per-rank length bucketing or
sequence packing:

* at step 0 every rank is in the same length bucket (32 tokens);
* then the ranks leave that bucket one after another (rank 1 first, rank 2 a
  few steps later, ...), while rank 0 stays in it;
* the last rank's data does not divide evenly, so its final batch is short
  (``drop_last=False``).

So rank 1 recompiles at a step where rank 0 does not. The default run shows:

1. **The hazard** (``compiler-only``: compiler collectives without guard
   collectives). Every compile is a collective, so rank 1's lone recompile
   waits for peers that never join it, while rank 0 waits for rank 1 in DDP's
   all-reduce: the job hangs. (Torch's own compiler collective crashes on
   gloo/CPU before it gets that far, so the demo uses ours.) Our collective
   timeout, short here, turns the hang into ``CollectiveTimeoutError``; the
   demo shows where each rank was stuck. This run is expected to fail.
2. **The cure** (``on``: ``compiler_collectives.enable(guards=True)``). The
   guard collective notices the first rank whose guards miss and every rank
   recompiles at that step; the compiler collective makes the differing dim
   dynamic everywhere. It finishes, with the same decisions on every rank.
3. **The cost**, per rank, beside the run's total: guard collectives (µs per
   call), exchanges (compiler collectives and program audits), and forced
   recompiles (recompiles a rank did only because a peer's guards missed).
4. **Compile once** (inductor; ``--compile-once`` or ``--backend inductor``):
   CPU-seconds spent compiling, the C++ compiler's processes included, per rank
   and in total, with ``COMPILER_COLLECTIVES_COMPILE_ONCE=0`` and with the
   default, each in a fresh inductor cache.

``--runs off`` adds the run without the service: it finishes here, with
different graphs on different ranks, only because the demo's compiled graph
holds no collective and torch's own compiler collectives are off.

Run it
------
``scripts/dev demo`` (or ``python scripts/demo.py``; ``--help`` for the
options) launches the ranks itself; under ``torchrun --nproc-per-node 2
scripts/demo.py`` each process runs its own rank and rank 0 prints the results
(the hazard is left out there: nothing could stop its stuck ranks but the
timeouts).

How to read it
--------------
``train()`` in ``demo_training.py`` is the part to copy: it is an ordinary DDP
training loop plus one call, ``compiler_collectives.enable(guards=True)``.
Everything else is scaffolding: ``demo_launch.py`` starts the rank processes
(or runs this rank under torchrun), bounds them by the timeouts and reaps them;
``demo_report.py`` turns what they came to into text; this file is the command
line, which prints it.

This is not part of the library: it is an example of using it, kept out of the package.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from demo_launch import (
    COMPILE_RUNS,
    RUNS,
    Run,
    launch_run,
    launched_by_torchrun,
    run_this_rank,
)
from demo_report import (
    demo_succeeded,
    format_intro,
    format_report,
    format_summary,
    outcome_to_json,
    usable_cores,
    wrap,
)
from demo_training import DEFAULT_RUNS, DemoConfig, divergence_step

# --------------------------------------------------------------------- command line


def _say(line: str = "") -> None:
    print(line, flush=True)


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
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in RUNS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(RUNS)}; got {text!r}")
    return names


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except those that are None (--runs says its own)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def add_demo_parser(subparsers: Any) -> None:
    d = DemoConfig()
    runs_help = "; ".join(f"'{name}': {run.description}" for name, run in RUNS.items())
    p = subparsers.add_parser(
        "demo",
        help="what the service is for: the deadlock it prevents, what it costs, one compile instead of N",
        description=(
            "Train a tiny transformer language model with DistributedDataParallel (gloo, CPU) and "
            "torch.compile on ranks that see different sequence lengths, each run in fresh rank "
            "processes. By default: the hazard (compiler collectives without guard collectives: one rank "
            "recompiles alone and the job gets stuck until our timeout names it; expected to fail), the "
            "cure (compiler + guard collectives: it finishes with the same compile decisions on every "
            "rank) and its cost per rank (guard collectives, exchanges, forced recompiles). "
            "--compile-once adds CPU-seconds spent compiling with inductor, with and without compile "
            "once. Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set) it runs only this "
            "rank's part, without the hazard, and rank 0 prints the results."
        ),
        epilog=(
            "Exit status: 0 when every run that should finish finished and the service runs' "
            "ranks agree (the hazard is expected to get stuck); 1 otherwise; 2 for bad options."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--nproc",
        type=_positive_int,
        default=d.nproc,
        metavar="N",
        help="number of ranks (processes) to launch; more ranks than CPU cores makes every compile "
        "slower (ignored under torchrun)",
    )
    p.add_argument(
        "--steps", type=_positive_int, default=d.steps, metavar="N", help="training steps per run (at least 2)"
    )
    p.add_argument(
        "--backend",
        default=d.backend,
        metavar="NAME",
        help="torch.compile backend, e.g. aot_eager, eager, inductor (inductor needs a C++ compiler, "
        "and adds the compile-once part)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=d.timeout,
        metavar="SECONDS",
        help="wall-clock limit per run; ranks still running then are killed and the "
        "run is reported as timed out (under torchrun: the collectives' timeout)",
    )
    p.add_argument(
        "--hazard-timeout",
        type=_positive_float,
        default=d.hazard_timeout,
        metavar="SECONDS",
        help="our collectives' timeout in the hazard run ('compiler-only'): how long the rank that "
        "recompiles alone waits for its peers before it raises (CollectiveDesyncError: they are alive, "
        "elsewhere)",
    )
    p.add_argument(
        "--runs",
        type=_run_list,
        default=None,
        metavar="LIST",
        help=f"comma-separated runs to do, in order (default: {','.join(DEFAULT_RUNS)}). {runs_help}",
    )
    p.add_argument(
        "--compile-once",
        action="store_true",
        help="also run the compile-once part ('compile-each' then 'compile-once': inductor, about 1.5 "
        "minutes more on 2 cores)",
    )
    p.add_argument(
        "--compile-steps",
        type=_positive_int,
        default=d.compile_steps,
        metavar="N",
        help="training steps of each compile-once run (each new graph is one more compile)",
    )
    p.add_argument(
        "--compile-cache",
        choices=("shared", "per-rank"),
        default=d.compile_cache,
        help="inductor's cache in each compile-once run: one fresh directory per rank (the default: as on "
        "different hosts or in containers), or one shared by the run's ranks (as ranks of one host share "
        "the default one)",
    )
    p.add_argument(
        "--batch-size", type=_positive_int, default=d.batch_size, metavar="N", help="sequences per batch and rank"
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the model weights and the synthetic token data")
    p.add_argument(
        "--log-every",
        type=_positive_int,
        default=d.log_every,
        metavar="N",
        help="print a progress line every N steps (from rank 0)",
    )
    p.add_argument(
        "--json", metavar="PATH", default=None, help="also write the per-rank results of every run as JSON to PATH"
    )
    p.set_defaults(func=cmd_demo)


def selected_runs(args: argparse.Namespace, under_torchrun: bool) -> tuple[str, ...]:
    """--runs as given; else the default story (without the hazard under torchrun), plus part 4 if asked."""
    if args.runs is not None:
        return tuple(args.runs)
    runs = tuple(n for n in DEFAULT_RUNS if not (under_torchrun and RUNS[n].expect_stuck))
    if args.compile_once or args.backend == "inductor":
        runs += COMPILE_RUNS
    return runs


def cmd_demo(args: argparse.Namespace) -> int:
    if args.steps < 2:
        print("demo: --steps must be at least 2", file=sys.stderr)
        return 2
    under_torchrun = launched_by_torchrun()
    if args.nproc < 2 and not under_torchrun:
        print("demo: --nproc must be at least 2 (the point is ranks that disagree)", file=sys.stderr)
        return 2
    cfg = DemoConfig(
        nproc=args.nproc,
        steps=args.steps,
        backend=args.backend,
        timeout=args.timeout,
        hazard_timeout=args.hazard_timeout,
        compile_steps=args.compile_steps,
        compile_cache=args.compile_cache,
        runs=selected_runs(args, under_torchrun),
        batch_size=args.batch_size,
        seed=args.seed,
        log_every=args.log_every,
    )
    started = time.monotonic()
    cores = usable_cores()

    if under_torchrun:
        world = int(os.environ["WORLD_SIZE"])
        is_rank0 = os.environ.get("RANK") == "0"
        say = _say if is_rank0 else (lambda line="": None)
        say(f"compiler_collectives demo under torchrun: {world} ranks, {cfg.steps} steps, backend {cfg.backend}")
        outcomes = run_this_rank(cfg, progress=say, intro=format_intro)
        if outcomes is None:
            return 0
        for i, outcome in enumerate(outcomes):
            _say()
            _say(f"run '{outcome.run.name}':")
            # Cores across the job, as if every host had as many as this one.
            all_cores = cores * max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
            for line in format_report(outcomes[: i + 1], cfg.runs[i + 1 : i + 2], all_cores, cfg):
                _say(line)
    else:
        world = cfg.nproc
        per_core = "one per core" if world <= cores else "MORE RANKS THAN CORES"
        _say(
            f"compiler_collectives demo: {world} ranks on {cores} CPU cores ({per_core}), gloo; a tiny "
            f"transformer under DDP and torch.compile (backend {cfg.backend}), {cfg.steps} steps per run"
        )
        for line in wrap(
            f"The ranks see different sequence lengths, as with per-rank length bucketing: all start at "
            f"{cfg.base_length} tokens; rank 1 moves to other lengths in step "
            f"{divergence_step(1, world, cfg.steps) + 1}"
            + (", the next ranks later" if world > 2 else "")
            + "; rank 0 never does; the last rank's final batch is short.",
            "",
        ):
            _say(line)
        outcomes = []
        previous: Run | None = None
        for i, name in enumerate(cfg.runs):
            run = RUNS[name]
            for line in format_intro(run, previous, cfg, world):
                _say(line)
            previous = run
            outcomes.append(launch_run(run, cfg, progress=_say))
            for line in format_report(outcomes, cfg.runs[i + 1 : i + 2], cores, cfg):
                _say(line)

    if not any(o.run.compile_part for o in outcomes) and not under_torchrun:
        _say()
        _say(
            "COMPILE ONCE (one compile instead of N: CPU-seconds compiling with inductor, with and without "
            "it; about 1.5 minutes more on 2 cores): scripts/dev demo --compile-once"
        )
    _say()
    _say(f"In short: {format_summary(outcomes)} Total wall time {time.monotonic() - started:.0f}s.")
    for outcome in outcomes:
        if outcome.run.must_finish and not outcome.finished:
            for o in outcome.ranks:
                if o.error and o.status == "error":
                    _say(f"--- run '{outcome.run.name}', rank {o.rank}:\n{o.error.rstrip()}")
                    break  # the first traceback is usually the cause

    if args.json:
        with open(args.json, "w") as f:
            json.dump([outcome_to_json(o) for o in outcomes], f, indent=2)
    return 0 if demo_succeeded(outcomes) else 1


def build_parser() -> argparse.ArgumentParser:
    """The demo's command line (``scripts/dev demo --help``)."""
    parent = argparse.ArgumentParser(prog="scripts/dev")
    add_demo_parser(parent.add_subparsers(dest="command"))
    return parent._subparsers._group_actions[0].choices["demo"]  # type: ignore[union-attr]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    # A SIGTERM (a CI job cancelled, `timeout`, ...) unwinds like Ctrl-C, so the
    # demo kills and reaps its rank processes.
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


if __name__ == "__main__":
    sys.exit(main())
