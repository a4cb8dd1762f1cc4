"""A side channel on the c10d store that lets a failing rank name the ranks to blame.

Gloo tells a survivor that "the connection was reset" or "a recv timed out",
but not which rank is gone. This module keeps, under the key prefix
``compiler_collectives/<generation>/`` of the default store:

* ``setup/...``: the setup agreement when our first group of a generation is
  created (``setup_agreement``), which is also the first rendezvous;
* ``join/<name>/<rank>``: our own rendezvous before each later group is
  created, bounded by ``COMPILER_COLLECTIVES_TIMEOUT``, so a rank that never
  comes is named instead of blocking group creation for torch's 30-minute
  default;
* ``hb/<rank>``: a heartbeat every ``COMPILER_COLLECTIVES_HEARTBEAT_S`` seconds
  from a daemon thread: a beat counter, the rank's process (pid, start time,
  host) and its progress (guard-collective number, compiler-collective number
  and frame). The hot path writes nothing: the thread reads counters the
  collectives keep anyway;
* ``fail/<rank>`` and the counter ``failures``: a failing rank's report. The
  heartbeat thread of every rank watches the counter and poisons its rank on
  a peer's report, so a rank waiting in one of our collectives (which checks
  that between slices of its wait) or about to enter one raises within about
  one heartbeat instead of at its timeout. A rank whose collective stopped on
  a peer's report reports too (``heard_from`` names that peer): the heartbeat
  threads prefer an original report, and a diagnosis never takes a relayed
  one for a failure of its own.

On a failure, ``diagnose`` waits briefly for every peer to either report its
own failure or be seen absent, then says which ranks are absent and which
are alive but elsewhere (a desync). A peer is absent when its process is gone
or stopped (checked in ``/proc`` when it runs on this host), or when its beat
counter did not move for ``2.5 × heartbeat + 0.5`` seconds of this rank's own
monotonic clock: no two hosts' clocks are ever compared.

Store calls from the caller's thread go through ``bounded``: the c10d store
bounds none of them (a stopped store host blocks a ``set`` for as long as the
process group's own timeout, 30 minutes by default), ours are bounded by
``COMPILER_COLLECTIVES_TIMEOUT`` or less.

At interpreter exit the heartbeat thread is stopped and joined (``shutdown``):
a daemon thread that is inside a store call while Python finalizes is killed
as it takes the GIL back, inside a C++ destructor, and that aborts the process
("terminate called without an active exception").
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from .. import config
from ..errors import StoreUnresponsive

log = logging.getLogger("compiler_collectives.watchdog")

T = TypeVar("T")


def bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``fn`` (store calls) on a helper thread; its result, its exception, or
    ``StoreUnresponsive`` after ``timeout_s``. The caller's thread never blocks longer."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="compiler_collectives-store", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StoreUnresponsive(what, timeout_s)
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


@dataclasses.dataclass
class PeerStatus:
    rank: int
    state: str  # "failed", "absent", "alive", "unknown"
    guard_seq: int | None = None
    compiler_seq: int | None = None
    frame: str | None = None
    silent_s: float | None = None  # how long this rank watched the beat counter stand still
    why: str | None = None  # for "absent": what showed it
    message: str | None = None
    report: dict[str, Any] | None = None  # for "failed": its failure report as the diagnosis ended

    def describe(self) -> str:
        where = []
        if self.guard_seq is not None:
            where.append(f"last guard collective #{self.guard_seq}")
        if self.compiler_seq:
            where.append(
                f"last compiler collective #{self.compiler_seq}" + (f" for frame {self.frame}" if self.frame else "")
            )
        at = f" ({', '.join(where)})" if where else ""
        if self.state == "absent":
            return f"rank {self.rank}: absent, {self.why or 'no heartbeat'}{at}"
        if self.state == "alive":
            return f"rank {self.rank}: alive but not in this collective{at}"
        if self.state == "failed":
            return f"rank {self.rank}: failed too{at}"
        return f"rank {self.rank}: unknown (the store did not answer)"


@dataclasses.dataclass
class Diagnosis:
    peers: list[PeerStatus]

    @property
    def absent(self) -> list[int]:
        return [p.rank for p in self.peers if p.state == "absent"]

    @property
    def alive_elsewhere(self) -> list[int]:
        return [p.rank for p in self.peers if p.state == "alive"]

    def original_reports(self) -> list[PeerStatus]:
        """Peers that reported a failure they saw themselves (not one relayed from a peer)."""
        return [
            p for p in self.peers if p.state == "failed" and p.report is not None and p.report.get("heard_from") is None
        ]

    def render(self) -> str:
        interesting = [p for p in self.peers if p.state != "failed"]
        return "\n".join("  " + p.describe() for p in interesting)


def _as_int(value: Any) -> int | None:
    return value if type(value) is int else None


# How to reach the default group's c10d store. Torch offers no public
# accessor; the Dynamo seam (the one place that touches torch internals)
# supplies it at install, checked by the seam table.
_default_store: Callable[[], Any] | None = None


def set_default_store_source(source: Callable[[], Any]) -> None:
    global _default_store
    _default_store = source


def default_store() -> Any:
    """The default process group's c10d store."""
    if _default_store is None:
        raise RuntimeError("compiler_collectives is not installed: no way to reach the c10d store")
    return _default_store()


class SideChannel:
    """One per generation of our groups (a new default group starts a new one)."""

    def __init__(
        self,
        rank: int,
        world: int,
        generation: int,
        progress: Callable[[], dict[str, Any]],
        *,
        identity: dict[str, int] | None = None,
        probe: Callable[[int], tuple[str, int] | None] | None = None,
        current: Callable[[], bool] = lambda: True,
    ) -> None:
        self.rank = rank
        self.world = world
        self.generation = generation
        # torch.distributed re-exports PrefixStore at run time, outside what its types declare.
        prefix_store = dist.PrefixStore  # type: ignore[attr-defined]
        self.store = prefix_store(f"compiler_collectives/{generation}/", default_store())
        self._progress = progress
        # This process as peers on the same host check it: pid, start time, host key.
        self._identity = dict(identity or {})
        self._probe = probe  # pid -> (state letter, start time) or None if gone
        self._current = current  # False once the default group this channel serves is gone
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_peer_failure: Callable[[int, dict[str, Any]], None] | None = None
        self._seen_failures = 0
        self._beats = 0
        self._store_failing = False
        # The ranks our agreements span (a scope: compiler_collectives.scope); None: every rank.
        # Rendezvous and diagnosis cover these only, so another scope is never waited for or
        # blamed. Failure reports are watched from every rank: a job stops as a whole.
        self.members: tuple[int, ...] | None = None

    def peers(self) -> tuple[int, ...] | range:
        """The ranks this rank's agreements span (itself included)."""
        return self.members if self.members is not None else range(self.world)

    # ------------------------------------------------------------ rendezvous

    def rendezvous(self, name: str, timeout_s: float) -> list[int]:
        """Wait until every rank reached ``name``; returns the absent ranks ([] on success)."""
        peers = list(self.peers())
        keys = [f"join/{name}/{r}" for r in peers]

        def meet() -> list[int]:
            self.store.set(f"join/{name}/{self.rank}", "1")
            try:
                self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
                return []
            except Exception:  # noqa: BLE001 - c10d raises DistStoreError/RuntimeError
                return [r for r, key in zip(peers, keys) if not self.store.check([key])]

        return bounded(meet, timeout_s + 5.0, f"at the {name} rendezvous")

    # ------------------------------------------------------------ heartbeat

    @property
    def beating(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def beats(self) -> int:
        """Heartbeats begun so far (tests time a SIGSTOP to fall between two beats)."""
        return self._beats

    def start(self, on_peer_failure: Callable[[int, dict[str, Any]], None]) -> None:
        self._on_peer_failure = on_peer_failure
        interval = config.settings.heartbeat_s
        if interval <= 0 or self._thread is not None:
            return
        bounded(self._beat, config.settings.timeout_s, "the first heartbeat")
        self._thread = threading.Thread(
            target=self._run, args=(interval,), name="compiler_collectives-heartbeat", daemon=True
        )
        self._thread.start()

    def stop(self, join_s: float = 0.0) -> bool:
        """Stop the heartbeat; with ``join_s``, wait that long for the thread. True if it ended."""
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        if join_s > 0:
            thread.join(join_s)
        return not thread.is_alive()

    def _beat(self) -> None:
        self._beats += 1
        record = dict(self._progress())
        record.update(self._identity)
        record["n"] = self._beats
        self.store.set(f"hb/{self.rank}", json.dumps(record))

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            if not self._current():
                return  # the default group is gone (destroyed or replaced): so is our job here
            try:
                self._beat()
                failures = self.store.add("failures", 0)
                if failures > self._seen_failures:
                    self._seen_failures = failures
                    self._notice_failures()
            except Exception as e:  # noqa: BLE001 - keep beating: a silent thread looks absent
                if not self._store_failing:
                    self._store_failing = True
                    log.warning(
                        "heartbeat of rank %d: the c10d store failed (%s: %s); retrying every %.1fs. "
                        "Until it answers, this rank cannot hear of other ranks' failures and "
                        "may look absent to them.",
                        self.rank,
                        type(e).__name__,
                        e,
                        interval,
                    )
                else:
                    log.debug("heartbeat of rank %d: store still failing: %s", self.rank, e)
                continue
            if self._store_failing:
                self._store_failing = False
                log.warning("heartbeat of rank %d: the c10d store answers again", self.rank)

    def _notice_failures(self) -> None:
        # The lowest rank with an original report: a relayed one (a rank that stopped on
        # another's report) only where none is readable yet.
        relayed: tuple[int, dict[str, Any]] | None = None
        for r in range(self.world):
            if r == self.rank:
                continue
            report = self._report(r)
            if report is None:
                continue
            if report.get("heard_from") is None:
                if self._on_peer_failure is not None:
                    self._on_peer_failure(r, report)
                return
            if relayed is None:
                relayed = (r, report)
        if relayed is not None and self._on_peer_failure is not None:
            self._on_peer_failure(*relayed)

    def _report(self, r: int) -> dict[str, Any] | None:
        key = f"fail/{r}"
        if not self.store.check([key]):
            return None
        try:
            report = json.loads(self.store.get(key))
        except ValueError:
            return {}
        return report if isinstance(report, dict) else {}

    def read_report(self, r: int, wait_s: float = 0.0) -> dict[str, Any] | None:
        """Rank ``r``'s failure report, waiting up to ``wait_s`` for it (bounded: the store may
        be what failed); None if there is none. A rank publishes its shared-memory failure word
        before its store report, so a peer that saw the word waits a moment for the words."""

        def read() -> dict[str, Any] | None:
            if wait_s > 0:
                try:
                    self.store.wait([f"fail/{r}"], datetime.timedelta(seconds=wait_s))
                except Exception:  # noqa: BLE001 - c10d raises DistStoreError/RuntimeError on a timeout
                    return None
            return self._report(r)

        return bounded(read, wait_s + 2.0, f"reading rank {r}'s failure report")

    # ------------------------------------------------------------ failures

    def report_failure(
        self,
        kind: str,
        seq: int | None,
        message: str,
        *,
        ranks: tuple[int, ...] = (),
        left: bool = False,
        update: bool = False,
        heard_from: int | None = None,
    ) -> None:
        """Publish this rank's failure (bounded: the store may be what failed).

        ``ranks``: the ranks the failure implicates, so that peers who hear of
        it name them; ``left``: this rank did not fail, it left (its own code
        raised while it waited), and peers say so. ``update``: replace this
        rank's report (after its diagnosis named the ranks) without counting
        a new failure. ``heard_from``: this rank's collective stopped on that
        peer's report (a relay, not a failure of its own).
        """
        record = {
            "kind": kind,
            "seq": seq,
            "message": message[:2000],
            "ranks": list(ranks),
            "left": left,
            "heard_from": heard_from,
        }

        def report() -> None:
            self.store.set(f"fail/{self.rank}", json.dumps(record))
            if not update:
                self.store.add("failures", 1)

        bounded(report, min(config.settings.timeout_s, 2.0 + config.settings.heartbeat_s), "the failure report")

    def _read_peer(self, r: int) -> tuple[bool, dict[str, Any] | None]:
        """(reported a failure, heartbeat record or None)."""
        failed = self.store.check([f"fail/{r}"])
        if not self.store.check([f"hb/{r}"]):
            return failed, None
        try:
            record = json.loads(self.store.get(f"hb/{r}"))
        except ValueError:
            record = None
        return failed, record if isinstance(record, dict) else None

    # ------------------------------------------------------------ notices

    def post(self, name: str, value: bytes) -> None:
        """Leave ``value`` under ``name`` for the peers (bounded like every store call of ours)."""
        # c10d stores take bytes at run time; their stubs declare str only.
        bounded(lambda: self.store.set(f"post/{name}", value), config.settings.timeout_s, "posting a notice")  # type: ignore[arg-type]

    def read_post(self, name: str) -> bytes | None:
        """The value posted under ``name``, or None if nothing is posted yet (never waits)."""

        def read() -> bytes | None:
            key = f"post/{name}"
            if not self.store.check([key]):
                return None
            value: bytes = self.store.get(key)
            return value

        return bounded(read, config.settings.timeout_s, "reading a notice")

    def watch(self, rank: int) -> Callable[[], str | None]:
        """A probe of peer ``rank``: each call returns why it is absent (crashed, killed, stopped,
        silent for ``2.5 x heartbeat + 0.5`` s of this rank's clock), or None while it looks alive.
        A silent peer whose process runs on this host is alive: a long native call that holds
        the GIL silences a rank that is still working (logged once, with how to see where)."""
        seen: list[Any] = [None, time.monotonic()]  # its beat counter, when it last moved here
        stale_after = 2.5 * config.settings.heartbeat_s + 0.5
        warned = [False]

        def absent() -> str | None:
            if config.settings.heartbeat_s <= 0:
                return None
            failed, record = bounded(lambda: self._read_peer(rank), config.settings.timeout_s, "reading a heartbeat")
            now = time.monotonic()
            if failed:
                return "it reported a failure"
            if record is None:
                return "it never sent a heartbeat" if now - seen[1] >= stale_after else None
            why = self._process_gone_or_stopped(record)
            if why is not None:
                return why
            if record.get("n") != seen[0]:
                seen[0], seen[1] = record.get("n"), now
                return None
            if now - seen[1] >= stale_after:
                pid = self._runs_here(record)
                if pid is None:
                    return self._silent(now - seen[1], None)
                if not warned[0]:
                    warned[0] = True
                    log.warning(
                        "rank %d's heartbeat is silent for %.1fs, but its process (pid %d, this host) runs: "
                        "still waiting for it (a native call that holds the GIL? `py-spy dump --native "
                        "--pid %d` shows where)",
                        rank,
                        now - seen[1],
                        pid,
                        pid,
                    )
            return None

        return absent

    def _process_gone_or_stopped(self, record: dict[str, Any]) -> str | None:
        """Why a same-host peer's process shows it absent, or None (or not on this host)."""
        host, pid, start = (_as_int(record.get(k)) for k in ("host", "pid", "start"))
        if self._probe is None or host is None or pid is None or host != self._identity.get("host"):
            return None
        ident = self._probe(pid)
        if ident is None or ident[0] in ("Z", "X") or (start is not None and ident[1] != start):
            return f"its process (pid {pid}, this host) is gone: crashed, killed or exited"
        if ident[0] in ("T", "t"):
            return f"its process (pid {pid}, this host) is stopped (SIGSTOP or a debugger)"
        return None

    @staticmethod
    def _silent(silent_s: float, pid: int | None) -> str:
        """Why a peer whose heartbeat stopped moving is absent; ``pid``: its process runs on this
        host (``_runs_here``). Such a peer is wedged: its heartbeat thread cannot take the GIL (a
        native call that holds it and blocks, such as a lock-order deadlock inside torch), and a
        stack dump shows where."""
        if pid is not None:
            return (
                f"no heartbeat for {silent_s:.1f}s, yet its process (pid {pid}, this host) runs: "
                f"it is wedged, most likely in a native call that holds the GIL (`py-spy dump --native "
                f"--pid {pid}` shows where)"
            )
        return f"no heartbeat for {silent_s:.1f}s (crashed, killed, stopped or cut off from the store)"

    def _runs_here(self, record: dict[str, Any]) -> int | None:
        """The pid of a peer whose process runs on this host (checked in ``/proc``), else None."""
        host, pid = _as_int(record.get("host")), _as_int(record.get("pid"))
        if self._probe is None or pid is None or host is None or host != self._identity.get("host"):
            return None
        return pid if self._probe(pid) is not None else None

    def diagnose(self, grace_s: float, *, until_absent: bool = False) -> Diagnosis:
        """Classify every peer; waits up to ``grace_s`` for undecided ones (with
        ``until_absent``, only until some peer is found absent)."""
        interval = config.settings.heartbeat_s
        stale_after = 2.5 * interval + 0.5
        start = time.monotonic()
        deadline = start + grace_s
        first_beat: dict[int, tuple[Any, float]] = {}  # rank -> (beat counter, when this rank first saw it)
        decided: dict[int, PeerStatus] = {}
        while True:
            now = time.monotonic()
            peers = []
            for r in self.peers():
                if r == self.rank:
                    continue
                if r in decided:
                    peers.append(decided[r])
                    continue
                failed, record = self._read_peer(r)
                status = PeerStatus(r, "failed" if failed else "alive")
                if record is not None:
                    status.guard_seq = _as_int(record.get("guard_seq"))
                    status.compiler_seq = _as_int(record.get("compiler_seq"))
                    frame = record.get("frame")
                    status.frame = frame if isinstance(frame, str) else None
                if not failed:
                    if record is None:
                        status.state, status.why = (
                            "absent",
                            "it never sent a heartbeat (crashed, killed or stopped early)",
                        )
                    else:
                        why = self._process_gone_or_stopped(record)
                        beat = record.get("n")
                        seen = first_beat.setdefault(r, (beat, now))
                        if why is not None:
                            status.state, status.why = "absent", why
                        elif beat != seen[0]:
                            pass  # its heartbeat moved while we watched: alive
                        elif now - seen[1] >= stale_after:
                            status.state = "absent"
                            status.silent_s = now - seen[1]
                            status.why = self._silent(status.silent_s, self._runs_here(record))
                if status.state in ("failed", "absent"):
                    decided[r] = status
                peers.append(status)
            undecided = [p for p in peers if p.state == "alive"]
            left = deadline - time.monotonic()
            if not undecided or left <= 0 or (until_absent and any(p.state == "absent" for p in peers)):
                for p in peers:  # as they read now (a report is updated once its sender diagnosed)
                    if p.state == "failed":
                        p.report = self._report(p.rank)
                return Diagnosis(peers)
            time.sleep(min(0.1, left))


def diagnose_with_deadline(
    channel: SideChannel | None, deadline_s: float, *, until_absent: bool = False
) -> Diagnosis | None:
    """Run ``channel.diagnose`` for about ``deadline_s``; give up 1.5 s after that (a dead store hangs).

    The margin lets the last round of store reads after the grace finish on a
    loaded host: a diagnosis cut off there is lost, and the error then says
    less than it could.
    """
    if channel is None or config.settings.heartbeat_s <= 0:
        return None
    try:
        return bounded(
            lambda: channel.diagnose(grace_s=max(0.0, deadline_s - 0.5), until_absent=until_absent),
            deadline_s + 1.5,
            "during the diagnosis",
        )
    except Exception as e:  # noqa: BLE001
        log.debug("side-channel diagnosis failed: %s", e)
        return None
