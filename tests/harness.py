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
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

_CONTEXTS: dict[str, Any] = {}
EXIT_GRACE_S = 30.0  # how long a rank that reported may take to exit


def _context(start_method: str) -> Any:
    ctx = _CONTEXTS.get(start_method)
    if ctx is None:
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(
                # compile_fx: 1.5 CPU-s a rank that uses inductor would pay again in every test
                ["torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed", "tests.harness"]
            )
        _CONTEXTS[start_method] = ctx
    return ctx


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
            import datetime

            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=float(env.get("HARNESS_PG_TIMEOUT", "60"))),
            )
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
) -> Outcome:
    """Run ``fn(rank, world_size, *args)`` on every rank; return results in rank order.

    With ``check`` (default) any rank error, crash, non-zero exit or timeout
    raises ``RanksFailed``; without it the caller inspects the ``Outcome``.
    Either way a rank that a signal ended (negative exit code) raises
    ``RanksFailed`` unless ``expect_signals`` maps that rank to that signal.
    ``rank_env`` adds variables for some ranks only (a setting that differs
    on one node), on top of ``env``.
    """
    ctx = _context(start_method)
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
    expected = {rank: -abs(sig) for rank, sig in (expect_signals or {}).items()}
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(
                (fn.__module__, fn.__qualname__),
                rank,
                world_size,
                init_method,
                {**env, **(rank_env or {}).get(rank, {})},
                tuple(args),
                init,
                results,
            ),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    started = time.monotonic()
    deadline = started + timeout
    for p in procs:
        p.start()
    values: list[Any] = [None] * world_size
    errors: dict[int, str] = {}
    reported: set[int] = set()

    def record(status: str, rank: int, value: Any) -> None:
        reported.add(rank)
        if status == "ok":
            values[rank] = pickle.loads(value)
        else:
            errors[rank] = value

    try:
        while len(reported) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                record(*results.get(timeout=min(remaining, 0.5)))
            except queue_mod.Empty:
                # A rank that died without reporting (signal, os._exit) never will.
                if all(not p.is_alive() for i, p in enumerate(procs) if i not in reported):
                    # Drain anything that raced in, then stop waiting.
                    try:
                        while True:
                            record(*results.get(timeout=0.2))
                    except queue_mod.Empty:
                        break
    finally:
        timed_out = []
        stuck_at_exit = []
        for rank, p in enumerate(procs):
            if rank in reported:
                # A real interpreter exit (spawn) runs torch's static destructors,
                # which take seconds on a loaded machine: allow for it.
                p.join(timeout=EXIT_GRACE_S)
            else:
                p.join(timeout=max(0.0, min(5.0, deadline + 5.0 - time.monotonic())))
            if p.is_alive():
                (stuck_at_exit if rank in reported else timed_out).append(rank)
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=10)
        results.close()
        results.join_thread()
    outcome = Outcome(
        results=values,
        errors=errors,
        exitcodes=[p.exitcode for p in procs],
        timed_out=timed_out + stuck_at_exit,
        elapsed_s=time.monotonic() - started,
    )
    problems = [
        f"--- rank {rank} reported, but had not exited {EXIT_GRACE_S:.0f}s later: killed" for rank in stuck_at_exit
    ]
    for rank, code in enumerate(outcome.exitcodes):
        if rank in outcome.timed_out or code is None or code >= 0 or expected.get(rank) == code:
            continue
        problems.append(
            f"--- rank {rank} was ended by signal {_signal_name(-code)} (exit code {code})"
            + (" after reporting its result" if rank in reported else "")
        )
    for rank, code in sorted(expected.items()):
        if outcome.exitcodes[rank] != code:
            problems.append(
                f"--- rank {rank} was expected to end by signal {_signal_name(-code)}, "
                f"but its exit code is {outcome.exitcodes[rank]}"
            )
    if check:
        for rank, tb in sorted(errors.items()):
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


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
