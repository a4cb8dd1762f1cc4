"""Starting and reaping the ranks: each run in fresh rank processes, or this rank's part under torchrun.

A run is one way of training (``RUNS``); ``launch_run`` starts its ranks as
processes (``cc_launch`` starts and reaps them),
relays their progress, bounds them by the demo's timeout, asks a stuck rank
where it waits before it is killed, and gathers what each rank came to in a
``RunOutcome``. Under torchrun there is no parent to do that:
``run_this_rank`` runs every run in this process. What those outcomes say to
the user is ``demo_report``'s.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from demo_training import DemoConfig, train

import cc_launch as launch
import compiler_collectives

# --------------------------------------------------------------------- runs


@dataclasses.dataclass(frozen=True)
class Run:
    """One way of running the training; each run gets fresh rank processes."""

    name: str
    use_service: bool
    guards: bool
    description: str
    must_finish: bool = True  # False: getting stuck is what this run demonstrates
    expect_stuck: bool = False  # the hazard: reported as stuck, with a short collective timeout
    # Part 4: inductor, cfg.compile_steps steps, a fresh inductor cache shared
    # by the run's ranks, one compile thread per rank; compile_once sets
    # COMPILER_COLLECTIVES_COMPILE_ONCE (None: leave it alone).
    compile_part: bool = False
    compile_once: bool | None = None


RUNS: dict[str, Run] = {
    "compiler-only": Run(
        "compiler-only",
        True,
        False,
        "the hazard: compiler collectives without guard collectives (expected to get stuck)",
        must_finish=False,
        expect_stuck=True,
    ),
    "on": Run("on", True, True, "the cure: compiler + guard collectives (compiler_collectives.enable(guards=True))"),
    "off": Run(
        "off",
        False,
        False,
        "without the service (torch's default: each rank decides alone; finishes here only because "
        "the demo's graph holds no collective and torch's compiler collectives are off)",
    ),
    "compile-each": Run(
        "compile-each",
        True,
        True,
        "inductor with COMPILER_COLLECTIVES_COMPILE_ONCE=0: every rank compiles every graph",
        compile_part=True,
        compile_once=False,
    ),
    "compile-once": Run(
        "compile-once",
        True,
        True,
        "inductor with compile once (the default): one rank compiles each graph, the others load it",
        compile_part=True,
        compile_once=True,
    ),
}

COMPILE_RUNS = ("compile-each", "compile-once")
COMPILE_ONCE_ENV = "COMPILER_COLLECTIVES_COMPILE_ONCE"


def run_config(run: Run, cfg: DemoConfig) -> DemoConfig:
    """The configuration ``run`` trains with: part 4 compiles with inductor, for a few steps."""
    if run.compile_part:
        return dataclasses.replace(cfg, backend="inductor", steps=cfg.compile_steps)
    return cfg


def collective_timeout(run: Run, cfg: DemoConfig) -> float:
    """Seconds our collectives wait for the slowest rank: short in the hazard run."""
    return min(cfg.hazard_timeout, cfg.timeout) if run.expect_stuck else cfg.timeout


def rank_cache_dir(run_cache_dir: str, rank: int, cfg: DemoConfig) -> str:
    """This rank's inductor cache in part 4: the run's, or (``--compile-cache per-rank``) its own in it."""
    return run_cache_dir if cfg.compile_cache == "shared" else os.path.join(run_cache_dir, f"rank{rank}")


def prepare_compile_run(run: Run, cache_dir: str) -> bool | None:
    """Part 4's settings, on this rank, before it compiles anything.

    A fresh inductor cache for the run (shared by its ranks), one compile
    thread, so the C++ compiler runs as this rank's children, and
    ``COMPILER_COLLECTIVES_COMPILE_ONCE`` as the run asks. Returns whether
    compile once is on, or None when this version of the package has no such
    setting (then both runs of part 4 compile on every rank).
    """
    import torch._inductor.config as inductor_config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    inductor_config.compile_threads = 1  # read at import, and torch is imported already
    config = compiler_collectives.config
    row = next((r for r in config.SETTINGS_TABLE if r.env == COMPILE_ONCE_ENV), None)
    if row is None:
        return None
    # Settings are read from the environment at import (done in the parent
    # of this process): set the value too, as the environment would have.
    if run.compile_once is False:
        os.environ[COMPILE_ONCE_ENV] = "0"
        config.set_value(row.attr, row.parse(row.env, "0"), "env")
    else:
        os.environ.pop(COMPILE_ONCE_ENV, None)
        config.set_value(row.attr, row.default, "default")
    return bool(getattr(config.settings, row.attr))


# ---------------------------------------------------------- results of a run


@dataclasses.dataclass
class RankOutcome:
    rank: int
    status: str  # "finished", "timed out", "error", "died", "killed"
    result: dict[str, Any] | None = None
    last_step: int = -1  # last step this rank completed
    error: str | None = None  # traceback or reason
    pid: int | None = None  # of the rank process (None under torchrun)
    stuck_at: str | None = None  # where a rank that did not finish was waiting


@dataclasses.dataclass
class RunOutcome:
    run: Run
    ranks: list[RankOutcome]
    elapsed_s: float
    log_dir: str | None = None  # kept only when something went wrong
    steps: int = 0  # steps the run was to train
    compile_once: bool | None = None  # part 4: the setting on the ranks (None: not set or unknown)

    @property
    def finished(self) -> bool:
        return all(r.status == "finished" for r in self.ranks)

    @property
    def timed_out(self) -> bool:
        return any(r.status == "timed out" for r in self.ranks)

    @property
    def stuck(self) -> bool:
        """Did not finish because ranks waited for each other until a timeout (ours, or the demo's)."""
        return not self.finished and (self.timed_out or self.hang_error is not None)

    @property
    def hang_error(self) -> RankOutcome | None:
        """The first rank whose collective gave up waiting for its peers (its error names the hang)."""
        for o in self.ranks:
            if o.status == "error" and first_line(exception_text(o.error)).startswith(HANG_ERRORS):
                return o
        return None

    @property
    def agree(self) -> bool | None:
        """Whether every rank made the same compile decisions (None: unknown)."""
        if not self.finished:
            return None
        first = decisions(self.ranks[0].result)  # type: ignore[arg-type]
        return all(decisions(r.result) == first for r in self.ranks)  # type: ignore[arg-type]


def decisions(result: dict[str, Any]) -> tuple[tuple[str, ...], ...]:
    """What must be equal on every rank: the graphs, each with its dynamic dims."""
    return tuple(tuple(g) for g in result["graph_dims"])


# What our collectives raise when they give up waiting: peers that are gone or
# stuck, or (desync) peers that are alive but elsewhere, as in the hazard.
HANG_ERRORS = ("CollectiveTimeoutError", "CollectiveDesyncError")


# ------------------------------------------------- running ranks as processes


def _rank_main(
    rank: int, world: int, run_name: str, cfg: DemoConfig, run_dir: str, messages: Any, cache_dir: str | None
) -> None:
    """Entry point of one spawned rank process."""
    # Keep the terminal readable: this rank's stdout/stderr (Dynamo warnings
    # and the like) go to a log file; the parent shows it if the run fails.
    log_fd = os.open(os.path.join(run_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    if _STACK_SIGNAL is not None:
        # If this rank hangs, the parent asks for its stack before killing it.
        faulthandler.register(_STACK_SIGNAL, file=sys.stderr, all_threads=False)
    # Several ranks share few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    run = RUNS[run_name]
    try:
        compile_once = None
        if cache_dir is not None:
            compile_once = prepare_compile_run(run, rank_cache_dir(cache_dir, rank, cfg))
        dist.init_process_group(
            "gloo",
            init_method="file://" + os.path.join(run_dir, "store"),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=cfg.timeout),
        )

        def on_step(step: int, loss: float) -> None:
            messages.put(("step", rank, step, loss))

        result = train(
            rank,
            world,
            run.use_service,
            run_config(run, cfg),
            guards=run.guards,
            timeout_s=collective_timeout(run, cfg),
            record_timing=not run.compile_part,  # part 4 reports CPU-seconds only
            on_step=on_step,
        )
        result["compile_once"] = compile_once
        messages.put(("done", rank, result))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        messages.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


ProgressFn = Callable[[str], None]


def launch_run(run: Run, cfg: DemoConfig, progress: ProgressFn = lambda line: None) -> RunOutcome:
    """Run ``train`` on ``cfg.nproc`` fresh rank processes; bounded by ``cfg.timeout``.

    Every child is reaped before this returns: ranks still running at the
    deadline (or shortly after another rank failed) are killed. When a rank
    fails, the others are asked at once where they are (their stacks go to
    their logs), since that is where they were stuck.
    """
    rcfg = run_config(run, cfg)
    run_dir = tempfile.mkdtemp(prefix=f"cc-demo-{run.name}-")
    cache_dir = tempfile.mkdtemp(prefix=f"cc-demo-{run.name}-inductor-") if run.compile_part else None
    outcomes = [RankOutcome(rank, "running") for rank in range(cfg.nproc)]
    failed_at: float | None = None
    grace_after_failure = 10.0  # peers of a failed rank are stuck in collectives
    quiet_notice_s = 30.0  # say so when no rank finished a step for this long
    interrupted = True  # until the loop below ends normally
    ranks: launch.Ranks | None = None
    try:
        # From a forkserver that has imported this module (so torch), where it can:
        # that needs a server that takes our sys.path (Python 3.12.8, 3.13.1 and
        # later); an older one cannot import this module from scripts/, so each
        # rank imports it, and torch, itself. Either way a rank has our sys.path
        # before it unpickles ``_rank_main``.
        ranks = launch.start_ranks(
            _rank_main,
            cfg.nproc,
            lambda rank, messages: (rank, cfg.nproc, run.name, cfg, run_dir, messages, cache_dir),
            preload=[__name__],
            name=f"demo-{run.name}",
        )
        procs = ranks.procs
        started = ranks.started
        deadline = started + cfg.timeout
        last_news = started
        for p, o in zip(procs, outcomes):
            o.pid = p.pid
        while any(o.status == "running" for o in outcomes):
            now = time.monotonic()
            if now >= deadline or (failed_at is not None and now >= failed_at + grace_after_failure):
                break
            if now - last_news >= quiet_notice_s:
                # Not a frozen terminal: say what we are waiting for.
                done = " ".join(str(o.last_step + 1) for o in outcomes)
                progress(
                    f"  [{run.name}] no step finished for {now - last_news:.0f}s (compiling, or "
                    f"stuck); steps done per rank: {done}; timeout in {deadline - now:.0f}s"
                )
                last_news = now
            message = ranks.receive(timeout=0.5)
            if message is None:
                for o, p in zip(outcomes, procs):
                    # Exited, and nothing of it is left in the queue: it died
                    # without reporting (a signal, os._exit, a crash in C++).
                    if o.status == "running" and p.exitcode is not None and ranks.messages.empty():
                        o.status, o.error = "died", f"exit code {p.exitcode}"
                        failed_at = failed_at or time.monotonic()
                continue
            kind, rank = message[0], message[1]
            o = outcomes[rank]
            last_news = time.monotonic()
            if kind == "step":
                step, loss = message[2], message[3]
                o.last_step = step
                if rank == 0 and _should_log(step, rcfg):
                    progress(_progress_line(run.name, step, rcfg, loss, time.monotonic() - started))
            elif kind == "done":
                o.status, o.result = "finished", message[2]
            elif kind == "error":
                o.status, o.error = "error", message[2]
                progress(f"  [{run.name}] rank {rank} failed: {first_line(exception_text(o.error), 150)}")
                if failed_at is None:
                    failed_at = time.monotonic()
                    # Where the others are now is where they were stuck.
                    _request_stacks(p for p, q in zip(procs, outcomes) if q.status == "running")
        interrupted = False
    finally:
        if ranks is not None:
            # Ranks that reported are exiting: give them a moment. Otherwise we are
            # past the deadline (or interrupted): no more waiting. Those still
            # running are asked where they are stuck before they are killed.
            all_reported = all(o.status != "running" for o in outcomes)
            launch.reap(ranks.procs, 5.0 if all_reported else 0.0, before_kill=_stacks_before_kill)
            ranks.close()
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
        if interrupted:  # nobody will be shown the logs
            shutil.rmtree(run_dir, ignore_errors=True)
    for o in outcomes:
        if o.status == "running":
            o.status = "timed out" if failed_at is None else "killed"
        if o.status != "finished":
            # The stack it was asked for while it waited, else its own traceback.
            o.stuck_at = stuck_at(_read(os.path.join(run_dir, f"rank{o.rank}.log"))) or stuck_at(o.error or "")
    elapsed = time.monotonic() - started
    outcome = RunOutcome(run, outcomes, elapsed, steps=rcfg.steps)
    if run.compile_part:
        outcome.compile_once = next((o.result.get("compile_once") for o in outcomes if o.result), None)
    if all(o.status == "finished" for o in outcomes) or (run.expect_stuck and outcome.hang_error is not None):
        # Nothing to look into: it finished, or got stuck as the hazard does (the report shows where).
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        outcome.log_dir = run_dir
    return outcome


def _request_stacks(procs: Iterable[Any]) -> None:
    """Ask rank processes to write their Python stack to their logs (faulthandler)."""
    if _STACK_SIGNAL is None:
        return
    for p in procs:
        try:
            os.kill(p.pid, _STACK_SIGNAL)
        except (OSError, TypeError):
            pass


def _stacks_before_kill(stuck: list[Any]) -> None:
    """Before stuck ranks are killed: their stacks, which faulthandler writes to their logs."""
    _request_stacks(stuck)
    if _STACK_SIGNAL is not None:
        time.sleep(1.0)


# Sent to a stuck rank before it is killed; None where there is no SIGUSR1 (Windows).
_STACK_SIGNAL = getattr(signal, "SIGUSR1", None)

_FRAME = re.compile(r'^File "([^"]+)", line (\d+),? in (\S+)')


def stuck_at(text: str) -> str | None:
    """Where a rank was stuck: from the last stack in ``text``.

    That is a stack faulthandler wrote to a rank's log (most recent call
    first) or a Python traceback (most recent call last), whichever comes
    last. Returns e.g. ``all_gather_bytes (gloo.py:187) <- train (demo_training.py:301)``:
    the innermost frame, the innermost frame of the service below it, and the
    training loop's line that led there.
    """
    dump, tb = "(most recent call first):", "Traceback (most recent call last):"
    at_dump, at_tb = text.rfind(dump), text.rfind(tb)
    if at_dump < 0 and at_tb < 0:
        return None
    if at_dump > at_tb:
        lines = text[at_dump + len(dump) :].splitlines()[1:]
    else:
        lines = text[at_tb + len(tb) :].splitlines()[1:]
    frames = []
    for line in lines:
        if not line.startswith(" "):
            break  # the end of the stack (the exception's line, or a blank one)
        m = _FRAME.match(line.strip())
        if m:
            path, lineno, func = m.groups()
            frames.append((path, f"{func} ({os.path.basename(path)}:{lineno})"))
        elif at_dump > at_tb:
            break  # faulthandler writes frames only
    if at_tb > at_dump:
        frames.reverse()  # innermost first
    if not frames:
        return None
    package = os.path.dirname(os.path.abspath(compiler_collectives.__file__)) + os.sep
    shown = [frames[0][1]]
    # The innermost frame of the service, if any (e.g. the compiler collective) ...
    for path, frame in frames[1:]:
        if os.path.abspath(path).startswith(package):
            shown.append(frame)
            break
    # ... and the training loop's line that led there.
    for _path, frame in frames[1:]:
        if frame.startswith("train ("):
            shown.append(frame)
            break
    return " <- ".join(shown)


def _should_log(step: int, cfg: DemoConfig) -> bool:
    done = step + 1
    return done == 1 or done % cfg.log_every == 0 or done == cfg.steps


def _progress_line(run_name: str, step: int, cfg: DemoConfig, loss: float, elapsed_s: float) -> str:
    return f"  [{run_name}] step {step + 1:>3}/{cfg.steps}  loss {loss:6.3f}  (rank 0, {elapsed_s:5.1f}s)"


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _last_line(text: str | None) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


_EXCEPTION_TYPE = re.compile(r"^(?:[A-Za-z_][\w]*\.)+(?=\w+(?:Error|Exception|Interrupt|Exit)\b)")


def exception_text(text: str | None) -> str:
    """The exception a traceback ends with, all its lines: ``Type: message`` (the module path dropped)."""
    lines = (text or "").rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    start = frames[-1] + 1 if frames else 0
    while start < len(lines) and (not lines[start] or lines[start][0].isspace()):
        start += 1  # the frame's source line and its ^^^ markers
    message = "\n".join(lines[start:]).strip() or _last_line(text)
    return _EXCEPTION_TYPE.sub("", message)


def first_line(text: str, limit: int = 200) -> str:
    """The first line of ``text``, cut to ``limit`` characters: for one-line mentions of an error."""
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ------------------------------------------------------------ under torchrun


def launched_by_torchrun() -> bool:
    """True when this process is one rank of a job started by torchrun (or similar)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


# The lines shown before a run, given it, the run before it, the demo's settings and the world size.
IntroFn = Callable[[Run, Run | None, DemoConfig, int], Sequence[str]]


def run_this_rank(
    cfg: DemoConfig,
    progress: ProgressFn = lambda line: None,
    intro: IntroFn = lambda run, previous, cfg, world: (),
) -> list[RunOutcome] | None:
    """Under torchrun: run every selected run in this process, one after another.

    There is no parent to kill a hung rank here, so the timeout is enforced by
    the collectives themselves (process-group and service timeouts). Returns
    the outcomes on rank 0 and None on the other ranks. ``intro`` (the
    report's, passed in: this module builds no report text) goes to ``progress``.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout))
    outcomes: list[RunOutcome] = []
    previous: Run | None = None
    try:
        for name in cfg.runs:
            run = RUNS[name]
            rcfg = run_config(run, cfg)
            for line in intro(run, previous, cfg, world):
                progress(line)
            previous = run
            # A fresh start for each run, as if in a new process.
            torch._dynamo.reset()
            compiler_collectives.reset()
            compiler_collectives.reset_stats()
            compile_once, cache_dir = None, None
            if run.compile_part:
                # A fresh inductor cache for the run, named by rank 0 (shared by the ranks of a host).
                names: list[Any] = [tempfile.mkdtemp(prefix=f"cc-demo-{name}-inductor-") if rank == 0 else None]
                dist.broadcast_object_list(names, src=0)
                cache_dir = str(names[0])
                os.makedirs(cache_dir, exist_ok=True)
                compile_once = prepare_compile_run(run, rank_cache_dir(cache_dir, rank, cfg))
            started = time.monotonic()

            def on_step(step: int, loss: float, _name: str = name, _t0: float = started, _c: DemoConfig = rcfg) -> None:
                if rank == 0 and _should_log(step, _c):
                    progress(_progress_line(_name, step, _c, loss, time.monotonic() - _t0))

            result = train(
                rank,
                world,
                run.use_service,
                rcfg,
                guards=run.guards,
                timeout_s=collective_timeout(run, cfg),
                record_timing=not run.compile_part,
                on_step=on_step,
            )
            result["compile_once"] = compile_once
            gathered: list[Any] | None = [None] * world if rank == 0 else None
            dist.gather_object(result, gathered, dst=0)
            if cache_dir is not None:
                dist.barrier()
                shutil.rmtree(cache_dir, ignore_errors=True)
            if gathered is not None:
                ranks = [RankOutcome(r, "finished", res, rcfg.steps - 1) for r, res in enumerate(gathered)]
                outcome = RunOutcome(run, ranks, time.monotonic() - started, steps=rcfg.steps)
                outcome.compile_once = compile_once
                outcomes.append(outcome)
                progress(f"  [{name}] finished in {outcome.elapsed_s:.1f}s")
        compiler_collectives.disable()
    finally:
        dist.destroy_process_group()
    return outcomes if rank == 0 else None
