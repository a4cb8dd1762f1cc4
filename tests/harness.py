"""Run a function on N real ranks (gloo on 127.0.0.1 via a FileStore) and collect results.

Each call gets a fresh FileStore in its own temp directory (or, with
``store="tcp"``, a TCPStore hosted by rank 0, as under torchrun), a hard
wall-clock deadline, and reaps every child: stragglers are SIGKILLed and joined
before ``run_ranks`` returns or raises. Children start from a forkserver that
has already imported torch, which saves seconds per test on a 2-core machine;
tests that must see environment variables at ``import torch`` time, or that
need a real interpreter exit (atexit handlers, finalization, C++ static
destructors; forkserver children leave through ``os._exit``), use
``start_method="spawn"``.

A rank's result comes back by value (plain pickle), so tensors arrive whole
even when the rank has already exited.

Every rank's exit code is checked, also for ranks that reported a result and
also with ``check=False``: a rank killed by a signal (SIGABRT from
``std::terminate``, SIGSEGV) fails the test unless the test names that
signal for that rank in ``expect_signals``.

Starting and reaping the processes is ``cc_launch``'s (shared with the demo
and the benchmarks): a top-level module of the standard library only, outside
the package, so this module, which the forkserver preloads, imports it at its
top without importing compiler_collectives there (whose install would read
its settings before a rank's ``env`` is in place).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cc_launch as launch
from tests import pool

EXIT_GRACE_S = 30.0  # how long a rank that reported may take to exit
# What the forkserver imports once for every rank; compile_fx: 1.5 CPU-s a rank
# that uses inductor would pay again in every test. Then what ranks import later
# (measured, issue 38): their test module's own imports (pytest, hypothesis, the
# tests' helpers) and what a compile imports lazily (inductor's C++ builder pulls
# in setuptools, DTensor's experimental API, the DDP optimizer, export's
# tracer): 0.1-0.2 CPU-s a rank. Never compiler_collectives, nor a module that
# imports it (msgpack is only its dependency).
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.distributed",
    "tests.harness",
    "pytest",
    "hypothesis",
    "msgpack",
    "tests.fixtures",
    "tests.rankside",
    "torch.utils.cpp_extension",
    "torch.distributed.tensor.experimental",
    "torch._dynamo.backends.distributed",
    "torch.export._trace",
)


class RanksFailed(AssertionError):
    """A rank raised, died, or the job passed its deadline."""

    def __init__(self, message: str, outcome: Outcome) -> None:
        super().__init__(message)
        self.outcome = outcome


@dataclasses.dataclass
class Outcome:
    results: list[Any]  # per rank; None where the rank did not report
    errors: dict[int, str]  # rank -> formatted traceback
    exitcodes: list[int | None]
    timed_out: list[int]  # ranks still running at the deadline (then killed)
    elapsed_s: float


def read_again_what_the_forkserver_read(env: dict[str, str]) -> None:
    """Settings that a preloaded module read from the environment at its import, in the
    forkserver, before this rank's ``env`` existed: read them again from ``env``.

    Inductor decides ``compile_threads`` at import (``TORCHINDUCTOR_COMPILE_THREADS``);
    without this a rank that sets it to 1 still compiles on the forkserver's count.
    A spawned rank imports inductor after its ``env`` is in place: nothing to redo.
    """
    config = sys.modules.get("torch._inductor.config")
    if config is not None and "TORCHINDUCTOR_COMPILE_THREADS" in env:
        config.compile_threads = config.decide_compile_threads()


def join_default_group(init_method: str, rank: int, world_size: int) -> None:
    """From a rank whose environment is in place: the job's default group, gloo, timed out after
    ``HARNESS_PG_TIMEOUT`` seconds (60 by default)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=float(os.environ.get("HARNESS_PG_TIMEOUT", "60"))),
    )


def _child(
    target: tuple[str, str],
    rank: int,
    world_size: int,
    init_method: str,
    env: dict[str, str],
    args: Sequence[Any],
    init: bool,
    results: Any,
) -> None:
    os.environ.update(env)
    read_again_what_the_forkserver_read(env)
    tempfile.tempdir = None  # the forkserver's may be cached; this job's TMPDIR is its own
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        # Import the test module only now, with the environment in place: a
        # module that imports compiler_collectives at its top must see it.
        import importlib

        module_name, qualname = target
        fn = getattr(importlib.import_module(module_name), qualname)
        if init:
            join_default_group(init_method, rank, world_size)
        value = fn(rank, world_size, *args)
        # By value: the queue's own pickler would hand a tensor over as a file
        # descriptor that the parent fetches from this process, which may have
        # exited by then (ConnectionResetError in the parent).
        results.put(("ok", rank, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put(("err", rank, traceback.format_exc()))
    finally:
        if init:
            try:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


@dataclasses.dataclass
class _Reports:
    """What the ranks of one job reported: a result ("ok", pickled) or a traceback ("err")."""

    world_size: int
    values: list[Any] = dataclasses.field(default_factory=list)
    errors: dict[int, str] = dataclasses.field(default_factory=dict)
    reported: set[int] = dataclasses.field(default_factory=set)

    def __post_init__(self) -> None:
        self.values = [None] * self.world_size

    def take(self, status: str, rank: int, value: Any) -> None:
        self.reported.add(rank)
        if status == "ok":
            self.values[rank] = pickle.loads(value)
        else:
            self.errors[rank] = value


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    env: dict[str, str] | None = None,
    timeout: float = 90.0,
    init: bool = True,
    start_method: str = "forkserver",
    check: bool = True,
    store: str = "file",
    expect_signals: dict[int, int] | None = None,
    rank_env: dict[int, dict[str, str]] | None = None,
    fresh: bool = False,
) -> Outcome:
    """Run ``fn(rank, world_size, *args)`` on every rank; return results in rank order.

    With ``check`` (default) any rank error, crash, non-zero exit or timeout
    raises ``RanksFailed``; without it the caller inspects the ``Outcome``.
    Either way a rank that a signal ended (negative exit code) raises
    ``RanksFailed`` unless ``expect_signals`` maps that rank to that signal.
    ``rank_env`` adds variables for some ranks only (a setting that differs
    on one node), on top of ``env``.

    Where pooling is on (``tests/ranks/``: ``pooled()``), a call a pool can serve
    (``pool.eligible``) runs in this worker's pool of ranks instead of fresh
    processes; ``fresh=True`` says the test needs processes of its own.
    """
    env = dict(env or {})
    tmp = tempfile.mkdtemp(prefix="cc-ranks-")
    env.setdefault("HARNESS_JOB_DIR", tmp)  # for release() / stay_until()
    # Forkserver children see only ``env``: the test's own TMPDIR and inductor
    # cache (tests/conftest.py sets both) go with it unless the test set them.
    for name in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR"):
        if name in os.environ:
            env.setdefault(name, os.environ[name])
    if store == "tcp":
        init_method = f"tcp://127.0.0.1:{free_port()}"
    else:
        init_method = f"file://{os.path.join(tmp, 'store')}"
    if _pooling and not fresh and pool.eligible(world_size, init, start_method, store, expect_signals, rank_env):
        with pool.claimed() as free:
            # A pool's rank that cannot join the group (gloo's connect, rarely) gets its pool
            # replaced and the test a second try on the new one, with the leak check still on.
            for attempt in range(2 if free else 0):
                pool_store = f"file://{os.path.join(tmp, f'pool-store{attempt}')}"  # the fresh path's stays untouched
                pooled = _in_pool(fn, world_size, args, env, rank_env, pool_store, timeout, check)
                if pooled is not None:
                    return pooled
    expected = {rank: -abs(sig) for rank, sig in (expect_signals or {}).items()}
    ranks = launch.start_ranks(
        _child,
        world_size,
        lambda rank, results: (
            (fn.__module__, fn.__qualname__),
            rank,
            world_size,
            init_method,
            {**env, **(rank_env or {}).get(rank, {})},
            tuple(args),
            init,
            results,
        ),
        start_method=start_method,
        preload=PRELOAD,
    )
    deadline = ranks.started + timeout
    reports = _Reports(world_size)
    values, errors, reported = reports.values, reports.errors, reports.reported

    def record(message: Any) -> bool:
        if message is None:
            return False
        reports.take(*message)
        return True

    try:
        while len(reported) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if not record(ranks.receive(timeout=min(remaining, 0.5))):
                # A rank that died without reporting (signal, os._exit) never will.
                if all(not p.is_alive() for i, p in enumerate(ranks.procs) if i not in reported):
                    # Drain anything that raced in, then stop waiting.
                    while record(ranks.receive(timeout=0.2)):
                        pass
                    break
    finally:
        # A real interpreter exit (spawn) runs torch's static destructors, which
        # take seconds on a loaded machine: a rank that reported gets EXIT_GRACE_S.
        unreported_grace = max(0.0, min(5.0, deadline + 5.0 - time.monotonic()))
        graces = [EXIT_GRACE_S if rank in reported else unreported_grace for rank in range(world_size)]
        killed = launch.reap(ranks.procs, graces)
        ranks.close()
    timed_out = [rank for rank in killed if rank not in reported]
    stuck_at_exit = [rank for rank in killed if rank in reported]
    outcome = Outcome(
        results=values,
        errors=errors,
        exitcodes=ranks.exitcodes,
        timed_out=timed_out + stuck_at_exit,
        elapsed_s=time.monotonic() - ranks.started,
    )
    problems = [
        f"--- rank {rank} reported, but had not exited {EXIT_GRACE_S:.0f}s later: killed" for rank in stuck_at_exit
    ]
    return _verdict(outcome, problems, expected, reported, timed_out, timeout, check)


def _verdict(
    outcome: Outcome,
    problems: list[str],
    expected: dict[int, int],
    reported: set[int],
    timed_out: list[int],
    timeout: float,
    check: bool,
) -> Outcome:
    """``outcome``, or ``RanksFailed`` with every problem found (``problems``: the caller's own)."""
    for rank, code in enumerate(outcome.exitcodes):
        if rank in outcome.timed_out or code is None or code >= 0 or expected.get(rank) == code:
            continue
        problems.append(
            f"--- rank {rank} {launch.exit_text(code)}" + (" after reporting its result" if rank in reported else "")
        )
    for rank, code in sorted(expected.items()):
        if outcome.exitcodes[rank] != code:
            problems.append(
                f"--- rank {rank} was expected to end by signal {launch.signal_name(-code)}, "
                f"but its exit code is {outcome.exitcodes[rank]}"
            )
    if check:
        for rank, tb in sorted(outcome.errors.items()):
            problems.append(f"--- rank {rank} raised:\n{tb}")
        for rank, code in enumerate(outcome.exitcodes):
            if rank in outcome.timed_out or rank in expected:
                continue
            if rank not in reported:
                problems.append(f"--- rank {rank} died without reporting (exit code {code})")
            elif code not in (0, None) and code > 0:
                problems.append(f"--- rank {rank} reported, then exited with code {code}")
        if timed_out:
            problems.append(f"--- ranks {timed_out} still running after {timeout:.0f}s: killed")
    if problems:
        raise RanksFailed("\n".join(problems), outcome)
    return outcome


_pooling = False
log = logging.getLogger("tests.pool")


@contextlib.contextmanager
def pooled() -> Iterator[None]:
    """Inside: ``run_ranks`` runs what a pool can serve in this worker's pool (``tests/pool.py``)."""
    global _pooling
    before, _pooling = _pooling, True
    try:
        yield
    finally:
        _pooling = before


def _in_pool(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    env: dict[str, str],
    rank_env: dict[int, dict[str, str]] | None,
    init_method: str,
    timeout: float,
    check: bool,
) -> Outcome | None:
    """``run_ranks`` in this worker's pool: the same outcome and verdict, plus the leak check;
    None where a pool's rank could not join the test's group (the pool is replaced, and the
    test runs on processes of its own)."""
    ranks = pool.pool_for(pool.Key.of(world_size, env), PRELOAD)
    job_env = {name: env[name] for name in pool.JOB_VARIABLES if name in env}
    job_envs = [{**job_env, **(rank_env or {}).get(rank, {})} for rank in range(world_size)]
    # Shown with the test's output should it fail: what ran in these processes before it.
    pids = [p.pid for p in ranks.procs]
    sys.stderr.write(f"pool {pids}: job {ranks.jobs + 1}, after {ranks.served[-6:] or 'none'}\n")
    ranks.served.append(os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0])
    started = time.monotonic()
    number = ranks.send((fn.__module__, fn.__qualname__), args, init_method, job_envs)
    reports = _Reports(world_size)
    values, errors, reported = reports.values, reports.errors, reports.reported
    tidied: dict[int, list[str]] = {}
    setup_failed: dict[int, str] = {}  # rank -> its traceback

    def take(message: tuple[str, int, Any] | None) -> bool:
        if message is None:
            return False
        status, rank, value = message
        if status == "setup":
            setup_failed[rank] = value
        elif status == "tidy":
            tidied[rank] = value
        else:
            reports.take(status, rank, value)
        return True

    def alive(rank: int) -> bool:
        return ranks.procs[rank].is_alive()

    deadline = started + timeout
    while len(reported) < world_size and not setup_failed and (remaining := deadline - time.monotonic()) > 0:
        if not take(ranks.receive(number, min(remaining, 0.5))):
            if not any(alive(r) for r in range(world_size) if r not in reported):
                while take(ranks.receive(number, 0.2)):
                    pass
                break
    if setup_failed:
        said = "\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(setup_failed.items()))
        log.warning("a pool's ranks could not join the test's group; trying on a new pool:\n%s", said)
        pool.drop(ranks)
        return None
    tidy_by = time.monotonic() + pool.TIDY_S
    while any(alive(r) and r not in tidied for r in reported) and (remaining := tidy_by - time.monotonic()) > 0:
        take(ranks.receive(number, min(remaining, 0.5)))
    untidy = [r for r in sorted(reported) if alive(r) and r not in tidied]
    leaks = {r: left for r, left in tidied.items() if left}
    dead = [r for r in range(world_size) if not alive(r)]
    timed_out = [r for r in range(world_size) if r not in reported and alive(r)]
    exitcodes = [p.exitcode for p in ranks.procs]  # before a poisoned pool's ranks are killed
    if timed_out or untidy or leaks or dead:
        pool.drop(ranks)
    outcome = Outcome(
        results=values,
        errors=errors,
        exitcodes=exitcodes,
        timed_out=timed_out + untidy,
        elapsed_s=time.monotonic() - started,
    )
    problems = [
        f"--- rank {r} (a pool's) did not finish its tidy-up {pool.TIDY_S:.0f}s after the test: killed" for r in untidy
    ]
    for r, left in sorted(leaks.items()):
        problems.append(f"--- rank {r} (a pool's) was left holding, after the test: " + "; ".join(left))
    # A leak is among ``problems``: it fails the test whether or not ``check`` is on.
    return _verdict(outcome, problems, {}, reported, timed_out, timeout, check)


def release(name: str = "released") -> None:
    """From a rank: let the ranks waiting in ``stay_until(..., name)`` go on.

    A rank that must stay alive (heartbeating, elsewhere) until its peers have
    their errors waits for their ``release`` instead of a fixed sleep sized for
    a loaded machine: as short as the behaviour allows.
    """
    open(os.path.join(os.environ["HARNESS_JOB_DIR"], f"{name}.{os.getpid()}"), "w").close()


def stay_until(count: int, max_s: float, name: str = "released") -> bool:
    """From a rank: wait until ``count`` ranks called ``release(name)``, or ``max_s``; True if they did."""
    import glob

    pattern = os.path.join(os.environ["HARNESS_JOB_DIR"], f"{name}.*")
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        if len(glob.glob(pattern)) >= count:
            return True
        time.sleep(0.05)
    return False


def free_port() -> int:
    return launch.free_port()


@contextlib.contextmanager
def machine_lock(path: str, *, exclusive: bool) -> Iterator[None]:
    """A fair readers-writer lock between processes (``flock`` on ``path``.gate and ``path``.machine).

    Side by side, every test holds the machine shared while it runs and a
    whole-machine test holds it exclusively (tests/conftest.py). The gate is
    held by whoever waits for the machine, so a waiting exclusive holder keeps
    new shared holders out and is never starved by a stream of them.
    """
    with open(path + ".gate", "a+") as gate, open(path + ".machine", "a+") as machine:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)


class MachineHold:
    """One worker's hold on the machine (``machine_lock``) from test to test.

    Shared for a test, exclusive for a whole-machine test, and kept from one whole-machine
    test to the next when they follow each other: the machine is emptied of other tests
    once for the lot, not once per test (each time leaving the other workers idle until the
    slowest running test ended).
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._held = contextlib.ExitStack()
        self._holding = False

    def before(self, exclusive: bool) -> None:
        """Before a test: take the machine, unless the previous whole-machine test kept it for this one."""
        if not self._holding:
            self._held.enter_context(machine_lock(self._path, exclusive=exclusive))
            self._holding = True

    def after(self, exclusive: bool, next_exclusive: bool) -> None:
        """After a test: let the machine go, unless this one and the next are both whole-machine tests."""
        if not (exclusive and next_exclusive):
            self._held.close()
            self._holding = False
