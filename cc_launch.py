"""Starting the processes of a job on this machine, and reaping every one: for our tests, the demo and the benchmarks.

A job's ranks run as children of one parent (``start_ranks``: from a
forkserver that has imported what every rank needs, or spawned), or under
torchrun agents started as commands (``Agents``). Whatever starts processes
for the test suite (``tests/harness.py``), the demo (``scripts/demo_launch.py``)
or a benchmark (``scripts/bench_*.py``) starts them here, so that every job
has a deadline and leaves no process behind. It lives outside the package
(a top-level module of its own, beside ``compiler_collectives_autoload``):
it is not part of the runtime service, and nothing in the library imports it.

How it reaps. ``reap`` gives each process its grace to exit, hands those still
alive to an optional hook (the demo asks them where they are stuck), then
SIGKILLs them and joins every one. ``start_ranks`` reaps what it started when
a later start fails. ``run_to_end`` is ``torch.multiprocessing.spawn`` with a
deadline: a rank still running at the deadline, or a while after another
rank failed (its peers wait for it in collectives), is killed and named in
the error instead of hanging the job. An agent is killed with its whole tree
(``kill_tree``): torchrun runs its ranks in sessions of their own, which a
signal to its process group would miss; ``Agents`` does that to every agent
still running when its block ends, by an exception or SystemExit included.

It imports the standard library only: neither torch nor compiler_collectives,
so anything may import it at its top, the ranks' forkserver preload
(``tests/harness.py``) included. A rank never needs it: a rank runs the
caller's own function, never one of this module's, so it imports
compiler_collectives only when its own code does, after setting its
environment.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import queue
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from types import TracebackType
from typing import IO, Any

log = logging.getLogger("compiler_collectives.launch")  # under our loggers, as TORCH_LOGS sets them

JOIN_AFTER_KILL_S = 10.0  # how long ``reap`` waits for a SIGKILLed process to be gone


# ------------------------------------------------------------------ ranks


def context(start_method: str = "forkserver", preload: Sequence[str] = ()) -> BaseContext:
    """Where rank processes come from: a multiprocessing context.

    With "forkserver" every rank is forked from a server process that has
    imported only ``preload`` (torch, say: imported once, not once per rank)
    and initialized nothing, so each rank starts as clean as a spawned one,
    seconds sooner. The server is one per parent process; it takes the
    preload set when it starts (the first rank started). Where there is no
    forkserver, "spawn".
    """
    if start_method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        start_method = "spawn"
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver" and preload:
        ctx.set_forkserver_preload(list(preload))
    return ctx


@dataclasses.dataclass
class Ranks:
    """The processes of one job, in rank order, and the one queue they report to."""

    procs: list[BaseProcess]
    messages: Queue[Any]
    started: float  # time.monotonic() just before the first rank started

    @property
    def exitcodes(self) -> list[int | None]:
        """Per rank: None while it runs; negative: the signal that ended it."""
        return [p.exitcode for p in self.procs]

    def receive(self, timeout: float) -> Any:
        """The next message a rank sent, or None if none came within ``timeout`` seconds."""
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Done with the queue (after ``reap``): only the ranks wrote to it."""
        self.messages.close()
        self.messages.join_thread()


def start_ranks(
    target: Callable[..., object],
    world: int,
    args: Callable[[int, Queue[Any]], Sequence[Any]],
    *,
    start_method: str = "forkserver",
    preload: Sequence[str] = (),
    name: str | None = None,
    daemon: bool = True,
) -> Ranks:
    """Start ``target(*args(rank, messages))`` in one process per rank, 0 to ``world`` - 1.

    ``messages`` is the job's queue (``Ranks.messages``), for the ranks to
    report to. ``target`` and the arguments must pickle (but for "fork"):
    a module-level function of the caller's, which sets up what its rank
    needs (environment, process group). Processes are named
    ``<name>-rank<N>`` when ``name`` is given; a daemonic one (the default)
    cannot start multiprocessing children. The caller ends the job with
    ``reap`` and ``Ranks.close``; if a start fails, those already started are
    reaped here.
    """
    ctx: Any = context(start_method, preload)
    messages: Queue[Any] = ctx.Queue()
    procs: list[BaseProcess] = [
        ctx.Process(
            target=target,
            args=tuple(args(rank, messages)),
            name=None if name is None else f"{name}-rank{rank}",
            daemon=daemon,
        )
        for rank in range(world)
    ]
    started = time.monotonic()
    try:
        for p in procs:
            p.start()
    except BaseException:
        reap(procs, 0.0)
        messages.close()
        messages.join_thread()
        raise
    return Ranks(procs, messages, started)


def reap(
    procs: Sequence[BaseProcess],
    grace_s: float | Sequence[float],
    before_kill: Callable[[list[BaseProcess]], None] | None = None,
) -> list[int]:
    """Let each process exit within its grace, kill the others, join every one; return the indices of those killed.

    ``grace_s`` counts from now: one for all, or one per process. The
    processes still alive then go to ``before_kill`` (e.g. to ask them for
    their stacks), are SIGKILLed and joined (``JOIN_AFTER_KILL_S`` at most).
    A process never started is passed over.
    """
    now = time.monotonic()
    graces = [float(grace_s)] * len(procs) if isinstance(grace_s, (int, float)) else list(grace_s)
    for p, grace in zip(procs, graces):
        if p.pid is not None:
            p.join(timeout=max(0.0, now + grace - time.monotonic()))
    stuck = [i for i, p in enumerate(procs) if p.pid is not None and p.is_alive()]
    if stuck and before_kill is not None:
        before_kill([procs[i] for i in stuck])
    for i in stuck:
        log.info("killing %s (pid %s)", procs[i].name, procs[i].pid)
        procs[i].kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=JOIN_AFTER_KILL_S)
    return stuck


def wait_all(
    exitcodes: Callable[[], Sequence[int | None]],
    deadline: float,
    grace_after_failure_s: float,
    poll_s: float = 0.2,
) -> str | None:
    """Wait until every process has exited: None; or why the wait stopped first.

    "timed out": ``deadline`` (a ``time.monotonic()`` value) passed.
    "failed": ``grace_after_failure_s`` passed since a process was first seen
    to end with anything but 0 (its peers may wait for it until their own
    timeouts). ``exitcodes`` gives the current ones (None: still running).
    """
    failed_at: float | None = None
    while True:
        codes = exitcodes()
        if all(code is not None for code in codes):
            return None
        now = time.monotonic()
        if failed_at is None and any(code not in (None, 0) for code in codes):
            failed_at = now
        if now > deadline:
            return "timed out"
        if failed_at is not None and now > failed_at + grace_after_failure_s:
            return "failed"
        time.sleep(poll_s)


def run_to_end(
    target: Callable[..., object],
    world: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float,
    start_method: str = "spawn",
    grace_after_failure_s: float = 10.0,
) -> None:
    """``torch.multiprocessing.spawn`` with a deadline: ``target(rank, *args)`` on every rank, each to exit 0.

    Raises RuntimeError naming every rank that ended otherwise (its exit
    code, or the signal that ended it) and every rank still running
    ``timeout_s`` after the start, or ``grace_after_failure_s`` after a rank
    failed: those were killed. A rank's own traceback goes to its stderr. As
    with ``mp.spawn``, a rank is not daemonic: it may start processes of its
    own (inductor's compile workers).
    """
    ranks = start_ranks(target, world, lambda rank, _messages: (rank, *args), start_method=start_method, daemon=False)
    try:
        stopped = wait_all(lambda: ranks.exitcodes, ranks.started + timeout_s, grace_after_failure_s)
    finally:
        killed = reap(ranks.procs, 0.0)
        ranks.close()
    codes = ranks.exitcodes
    problems = [f"rank {rank} {exit_text(code)}" for rank, code in enumerate(codes) if rank not in killed and code != 0]
    why = f"after {timeout_s:.0f}s" if stopped == "timed out" else f"{grace_after_failure_s:.0f}s after a rank failed"
    problems += [f"rank {rank} was still running {why}: killed" for rank in killed]
    if problems:
        raise RuntimeError(f"{world} ranks of {getattr(target, '__qualname__', target)}:\n" + "\n".join(problems))


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; the number itself for one this platform does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def exit_text(code: int | None) -> str:
    """How a process ended, after "rank N": ``exited with code 3``, ``was ended by signal SIGABRT (exit code -6)``."""
    if code is None:
        return "is still running"
    if code < 0:
        return f"was ended by signal {signal_name(-code)} (exit code {code})"
    return f"exited with code {code}"


_LEAST_PORT = 15000  # above the ports services commonly listen on


def free_port() -> int:
    """A TCP port on 127.0.0.1, free a moment ago, for a rendezvous or a store to listen on.

    Drawn at random below the kernel's ephemeral range where there is room:
    a port from ``bind(0)`` lies inside that range, where any process's next
    outgoing connection (a gloo pair, a store client) may be given it as its
    local port before the server binds it, which the suite saw as a torchrun
    agent's EADDRINUSE. Below the range only another explicit choice can
    take it, and the random draw makes that rare."""
    low = ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(_LEAST_PORT, low) if low - _LEAST_PORT >= 1024 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise OSError(f"no free TCP port on 127.0.0.1 in {_LEAST_PORT}..{low - 1} after 64 tries")


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default, 32768, where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# ---------------------------------------------------------------- agents


class Agents:
    """Command-line agents (torchrun) of one block: every one still running when it ends is killed with its tree.

    ``with Agents() as agents: proc = agents.start(cmd, env=..., log=...)``.
    """

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log: int | IO[bytes] | None = None,
        cwd: str | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` in a session of its own, stdin closed, stdout and stderr both to ``log``.

        ``log``: a file, ``subprocess.PIPE`` (read it with ``communicate``),
        or None (this process's stdout).
        """
        proc = subprocess.Popen(
            list(cmd),
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def __enter__(self) -> Agents:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                kill_tree(proc)
            if proc.stdout is not None:
                proc.stdout.close()


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) for every process /proc shows; {} where there is no /proc."""
    table: dict[int, tuple[int, str]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry)] = (int(fields[1]), fields[19])
    return table


def _tree(root: int) -> dict[int, str]:
    """The processes descending from ``root`` (itself included), each with its start time."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in found:
            found[pid] = table[pid][1]
            todo.extend(children.get(pid, []))
    return found


def _signal_tree(tree: dict[int, str], sig: int) -> None:
    table = _process_table()
    for pid, start in tree.items():
        if pid in table and table[pid][1] == start:  # the same process, not a reused pid
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def kill_tree(proc: subprocess.Popen[bytes], term_grace_s: float = 5.0) -> None:
    """End an agent and every process under it: SIGTERM to all, SIGKILL to what is left ``term_grace_s`` later.

    The tree is read from /proc, again while the agent ends (it may start
    processes meanwhile); without /proc, the agent alone. Returns once the
    agent is reaped.
    """
    tree = _tree(proc.pid)
    _signal_tree(tree, signal.SIGTERM)
    if proc.poll() is None and proc.pid not in tree:  # no /proc: the agent alone
        proc.terminate()
    deadline = time.monotonic() + term_grace_s
    while time.monotonic() < deadline and proc.poll() is None:
        tree.update(_tree(proc.pid))
        time.sleep(0.1)
    tree.update(_tree(proc.pid))
    _signal_tree(tree, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
