"""One verdict on whether a peer rank lives, and what each kind of wait makes of it.

Two waits ask whether a peer is still there: the failure procedure's
diagnosis (``diagnosis.diagnose``, a guard or compiler collective failed:
who is to blame, within seconds) and compile once's loader (``watch.watch_peer``,
a peer is compiling a graph for this rank: may take an hour). Both read the
same evidence, the peer's heartbeat record on the store, for a peer on this
host its process in ``/proc``, and, where the wait has one, its connection to
this rank (``broken``), and get the same verdict (``judge``):

* ``FAILED``: it reported a failure of its own;
* ``GONE``: evidence of its death: its process on this host is gone (absent,
  a zombie, or a new process under its pid); its connection to this rank
  broke (the kernel of its host reset it: the process ended); or it never
  wrote a record (every rank writes one before its first rendezvous,
  heartbeats on or off);
* ``STOPPED``: its process on this host is stopped (SIGSTOP, a debugger);
* ``WEDGED``: its beat counter stood still for ``2.5 x heartbeat + 0.5`` s, yet
  its process runs on this host (its heartbeat thread cannot take the GIL: a
  native call holds it);
* ``SILENT``: its beat counter stood still that long and it runs on another
  host: not heard from. Silence is no evidence of death: a stopped process
  (a debugger, a preempted VM), one whose native call holds the GIL, and one
  cut off from the store all fall silent, and all but the last go on;
* ``ALIVE``: its process runs on this host, or its beat counter moves;
* ``UNKNOWN``: it runs on another host without a heartbeat: nothing tells.

What the verdict means is each wait's own policy (``WaitPolicy``): the
diagnosis names a stopped, wedged or silent peer absent at once (its
collective cannot finish without it: seconds matter there, and the error
says what was seen); the compile wait waits for all three, warning when it
starts and every ``WARN_EVERY_S`` while it lasts, since a stopped compiler
that resumes, or a compile in a long native call, finishes its graph, within
the compile timeout. Only evidence of death (or a failure) ends that wait.

Time is only ever this rank's monotonic clock (``PeerWatch``): no two hosts'
clocks are compared. This module reads nothing but what it is handed and
``/proc`` through the probe it is handed.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Mapping
from typing import Any

# pid -> (state letter, start time in clock ticks) from /proc/<pid>/stat, or None if it is gone.
Probe = Callable[[int], tuple[str, int] | None]


class Liveness(str, enum.Enum):
    ALIVE = "alive"
    STOPPED = "stopped"
    WEDGED = "wedged"
    SILENT = "silent"
    GONE = "gone"
    FAILED = "failed"
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class Verdict:
    liveness: Liveness
    why: str  # what showed it, in words for an error message or a log line
    pid: int | None = None  # its process: on this host where /proc was read, on ``node`` for a silent peer
    silent_s: float | None = None  # how long its beat counter stood still, as this rank watched
    node: str | None = None  # the name of its host, for a silent peer (where to look at it)


def stale_after(heartbeat_s: float) -> float:
    """How long a beat counter may stand still before its rank counts as silent."""
    return 2.5 * heartbeat_s + 0.5


def as_int(value: Any) -> int | None:
    """A record's integer field, or None where it holds none (a bool is no integer here)."""
    return value if type(value) is int else None


def judge(
    record: Mapping[str, Any] | None,
    *,
    failed: bool,
    silent_s: float,
    here: int | None,
    probe: Probe | None,
    heartbeat_s: float,
    broken: str | None = None,
) -> Verdict:
    """The verdict on one peer.

    ``record``: its heartbeat record (None: it wrote none); ``failed``: it
    reported a failure; ``silent_s``: how long its beat counter stood still
    as this rank watched (``PeerWatch``); ``here``: this host's key (its
    records' ``host``); ``probe``: reads ``/proc`` (None: not available);
    ``heartbeat_s``: the interval assumed where its record does not say its own;
    ``broken``: what showed that its connection to this rank broke (None: it
    did not, or nobody looked); where ``/proc`` shows its process, ``/proc`` decides.
    """
    if failed:
        return Verdict(Liveness.FAILED, "it reported a failure")
    if record is None:
        return Verdict(Liveness.GONE, "it never sent a heartbeat (crashed, killed or stopped early)")
    interval = record.get("hb_s")
    if not isinstance(interval, (int, float)) or isinstance(interval, bool):
        interval = heartbeat_s
    beats = interval > 0
    silent = beats and silent_s >= stale_after(interval)
    host, pid, start = (as_int(record.get(k)) for k in ("host", "pid", "start"))
    if probe is not None and host is not None and pid is not None and host == here:
        # On this host /proc decides, heartbeat or not: a stop is not a death, a dead pid is.
        ident = probe(pid)
        if ident is None or ident[0] in ("Z", "X") or (start is not None and ident[1] != start):
            return Verdict(Liveness.GONE, f"its process (pid {pid}, this host) is gone: crashed, killed or exited", pid)
        if ident[0] in ("T", "t"):
            return Verdict(
                Liveness.STOPPED, f"its process (pid {pid}, this host) is stopped (SIGSTOP or a debugger)", pid
            )
        if silent:
            return Verdict(
                Liveness.WEDGED,
                f"no heartbeat for {silent_s:.1f}s, yet its process (pid {pid}, this host) runs: it is wedged, "
                f"most likely in a native call that holds the GIL (`py-spy dump --native --pid {pid}` shows where)",
                pid,
                silent_s,
            )
        return Verdict(Liveness.ALIVE, f"its process (pid {pid}, this host) runs", pid)
    if broken is not None:  # where /proc cannot tell: the kernel of its host reset the connection
        return Verdict(
            Liveness.GONE, f"its connection to this rank broke ({broken}): its process crashed, was killed or exited"
        )
    if not beats:
        return Verdict(Liveness.UNKNOWN, "it runs on another host with heartbeats off: nothing tells whether it lives")
    if silent:
        node = record.get("node")
        # Wording kept for the diagnosis, which names such a peer absent (logs are grepped for it).
        return Verdict(
            Liveness.SILENT,
            f"no heartbeat for {silent_s:.1f}s (crashed, killed, stopped or cut off from the store)",
            pid,
            silent_s,
            node if isinstance(node, str) else None,
        )
    return Verdict(Liveness.ALIVE, "its heartbeat moves")


class PeerWatch:
    """One peer's beat counter as this rank watched it: each ``read`` of its record gives the verdict."""

    def __init__(
        self,
        *,
        here: int | None,
        probe: Probe | None,
        heartbeat_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._here = here
        self._probe = probe
        self._heartbeat_s = heartbeat_s
        self._clock = clock
        self._beat: object = PeerWatch  # a value no record holds: the first record seen counts as a move
        self._moved_at = clock()

    def read(self, record: Mapping[str, Any] | None, *, failed: bool, broken: str | None = None) -> Verdict:
        now = self._clock()
        beat = None if record is None else record.get("n")
        if record is not None and beat != self._beat:
            self._beat, self._moved_at = beat, now
        verdict = judge(
            record,
            failed=failed,
            silent_s=now - self._moved_at,
            here=self._here,
            probe=self._probe,
            heartbeat_s=self._heartbeat_s,
            broken=broken,
        )
        if verdict.liveness is Liveness.STOPPED:
            # Silence counts only while the process runs: once resumed, its heartbeat thread gets a
            # beat in before the silence says wedged.
            self._moved_at = now
        return verdict


WARN_EVERY_S = 30.0
"""How often a wait that waits through a verdict warns again while the verdict lasts."""


@dataclasses.dataclass(frozen=True)
class WaitPolicy:
    """What one kind of wait makes of each verdict: give up on the peer (it is absent), wait
    on with a warning (when the verdict starts, then every ``WARN_EVERY_S`` while it lasts),
    or wait on silently (``ALIVE``, ``UNKNOWN`` and whatever is in neither)."""

    name: str
    absent: frozenset[Liveness]
    warn: frozenset[Liveness]
    within: str = ""  # the bound a warned wait stays within, for the warning

    def gives_up(self, verdict: Verdict) -> bool:
        return verdict.liveness in self.absent

    def warning(self, rank: int, verdict: Verdict, *, connected: bool = False) -> str:
        """The warning for a peer waited for although it looks like ``verdict`` (``connected``:
        its connection to this rank was looked at and is intact)."""
        pid = verdict.pid
        if verdict.liveness is Liveness.WEDGED and pid is not None:
            # Wording kept from before the verdict was shared (logs are grepped for it).
            what = (
                f"rank {rank}'s heartbeat is silent for {verdict.silent_s or 0.0:.1f}s, but its process "
                f"(pid {pid}, this host) runs: still waiting for it (a native call that holds the GIL? "
                f"`py-spy dump --native --pid {pid}` shows where)"
            )
        elif verdict.liveness is Liveness.STOPPED and pid is not None:
            what = (
                f"rank {rank}'s process (pid {pid}, this host) is stopped (SIGSTOP or a debugger): still "
                "waiting for it, since a stopped process that resumes (SIGCONT) goes on"
            )
        elif verdict.liveness is Liveness.SILENT:
            silent_s = verdict.silent_s or 0.0
            since = time.strftime("%H:%M:%S", time.localtime(time.time() - silent_s))
            host = verdict.node or "its host"
            process = f"pid {pid} on {host}" if pid is not None else f"on {host}"
            look = f"; on {host}, `py-spy dump --native --pid {pid}` shows where it is" if pid is not None else ""
            what = (
                f"rank {rank} ({process}, another host) has not been heard from for {silent_s:.0f}s (no heartbeat "
                f"since {since} by this host's clock), but nothing shows it dead ("
                + ("its connection to this rank is intact, " if connected else "")
                + "it reported no failure): still waiting for it, since a process that is "
                f"stopped (a debugger, SIGSTOP, a preempted VM) or in a native call that holds the GIL goes on{look}"
            )
        else:
            what = f"rank {rank}: {verdict.why}: still waiting for it"
        return what + (f", {self.within}" if self.within else "")


# The failure procedure's diagnosis: a collective has failed, and every peer that cannot
# finish it now, stopped, wedged or silent included, is named absent within seconds.
DIAGNOSIS = WaitPolicy(
    "failure diagnosis",
    absent=frozenset({Liveness.FAILED, Liveness.GONE, Liveness.STOPPED, Liveness.WEDGED, Liveness.SILENT}),
    warn=frozenset(),
)

# Compile once's loader waiting for the rank that compiles its graph: only evidence of death
# (gone) or a failure ends the wait; a stopped, wedged or silent one may still finish its compile.
COMPILE_WAIT = WaitPolicy(
    "compile wait",
    absent=frozenset({Liveness.FAILED, Liveness.GONE}),
    warn=frozenset({Liveness.STOPPED, Liveness.WEDGED, Liveness.SILENT}),
    within="up to COMPILER_COLLECTIVES_COMPILE_TIMEOUT",
)
