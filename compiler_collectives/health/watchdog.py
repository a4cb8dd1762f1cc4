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

With heartbeats off (``COMPILER_COLLECTIVES_HEARTBEAT_S=0``) no thread runs,
but ``hb/<rank>`` is still written once at start: the process's identity, so
that a peer on the same host can look for it in ``/proc``.

Whether a peer lives is one verdict (``liveness.judge``: alive, stopped,
wedged, silent, gone, failed), read from its record, on this host ``/proc``,
and where a caller hands one, the state of this rank's connection to it (a
broken one is evidence of death: transport looks, this module only asks);
each wait applies its own policy to it. On a failure, ``diagnose``
(``liveness.DIAGNOSIS``) waits briefly for every peer to either report its
own failure or be seen absent (gone, stopped, wedged or silent), then says
which ranks are absent and which are alive but elsewhere (a desync).
``watch`` (compile once's loader, ``liveness.COMPILE_WAIT``) waits for a
stopped, wedged or silent peer, warning every ``liveness.WARN_EVERY_S``, and
gives up on a gone or failed one. Beat counters are timed on this rank's own
monotonic clock: no two hosts' clocks are ever compared.

Store calls from the caller's thread are bounded: the c10d store bounds none
of them (a stopped store host blocks a ``set`` for as long as the process
group's own timeout, 30 minutes by default), ours are bounded by
``COMPILER_COLLECTIVES_TIMEOUT`` or less. One-off calls go through
``bounded`` (a thread each); the frequent ones (a loader reads its peers'
records for as long as a compile takes) through the side channel's
``StoreCaller``, one long-lived thread. A loader's wait for a notice
(``NoticeWait``) blocks in the store's own ``wait`` on a connection of its
own (one per generation, kept between waits and dropped with the side
channel at ``GROUP_ENDING``), so that it asks the store a few requests per
notice, not one per poll, and holds up nothing else; ``stats()["store_requests"]`` counts every request
this module sends.

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
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from .. import config, process_state
from ..errors import StoreFailureError, StoreUnresponsive
from ..ledger import ledger
from .liveness import COMPILE_WAIT, DIAGNOSIS, WARN_EVERY_S, Liveness, PeerWatch, Probe, WaitPolicy, stale_after

log = logging.getLogger("compiler_collectives.watchdog")

CONNECTION_EVERY_S = 1.0
"""How often ``SideChannel.watch`` looks at its connection to a peer it cannot see in /proc
(each look sends that peer one small gloo message)."""

RECORD_EVERY_S = 1.0
"""How often ``SideChannel.watch`` reads the failure key of a peer that beats no heartbeat (one
store request; with heartbeats on, failure reports reach a rank through its heartbeat thread)."""

_DOUBTS = (Liveness.SILENT, Liveness.WEDGED)  # verdicts from an old record that a new one may undo

GAVE_UP = b"\x00gave up: "
"""What a ``NoticeWait`` leaves under a notice it stops waiting for (it is cancelled): its wait
on the store returns only once the key exists. Never a notice's value (notices are text);
``read_post`` reads it as nothing posted, and the poster's own post replaces it."""

GAVE_UP_POLL_S = 0.2  # how often a wait that found another rank's GAVE_UP looks for the real post

_counted = threading.Lock()


@process_state.kept(names=("_counted",), why="a lock around the store-request counter, for the process's life")
def count_requests(n: int = 1) -> None:
    """Count ``n`` requests to the c10d store (``stats()["store_requests"]``); from any thread."""
    ledger.store_requests(n)


T = TypeVar("T")


def store_name(store: Any) -> str:
    """How messages name ``store``: "the c10d store at host:port" for a TCPStore (under any
    PrefixStores), else by its type. Reads attributes only: no store request."""
    inner = store
    for _ in range(8):
        under = getattr(inner, "underlying_store", None)  # a PrefixStore's
        if under is None:
            break
        inner = under
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    if isinstance(host, str) and isinstance(port, int):
        return f"the c10d store at {host}:{port}"
    return f"the c10d store ({type(inner).__name__})"


def store_error_text(error: BaseException) -> str:
    """A store error in one line: its type and the first line of its words (c10d's may go on
    with a C++ trace)."""
    words = str(error).strip().splitlines()
    return f"{type(error).__name__}: {words[0] if words else '(no message)'}"


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


class _Request:
    """One call handed to a ``StoreCaller`` worker, and what came of it."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self.error = e
        finally:
            self.done.set()


class _Worker:
    """A daemon thread running requests from its queue until it takes None."""

    def __init__(self, name: str) -> None:
        self.requests: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            request = self.requests.get()
            if request is None:
                return
            request.run()


class StoreCaller:
    """Bounded store calls on one long-lived daemon thread, for the calls made often.

    ``bounded`` starts a thread per call; a loader polling every 200 ms for an
    hour-long compile would start tens of thousands. Here each call waits for
    the one worker at most ``timeout_s`` (calls from several threads take
    turns, the turn counted in the bound). A call that overruns leaves its
    worker inside the store: that worker is retired (it ends once the store
    returns) and the next call gets a fresh one, so one slow answer never holds
    up later calls. While ``MAX_STUCK`` retired workers are still inside the
    store, it hangs: calls raise ``StoreUnresponsive`` at once instead of
    piling more threads onto it.
    """

    MAX_STUCK = 2

    def __init__(self, name: str = "compiler_collectives-store") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._worker: _Worker | None = None
        self._stuck: list[_Worker] = []

    def call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        """``fn``'s result or exception, or ``StoreUnresponsive`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=max(0.0, timeout_s)):
            raise StoreUnresponsive(what, timeout_s)
        try:
            worker = self._ready(what, timeout_s)
            request = _Request(fn)
            worker.requests.put(request)
            if not request.done.wait(max(0.0, deadline - time.monotonic())):
                worker.requests.put(None)  # retired: it ends once the store returns
                self._stuck.append(worker)
                self._worker = None
                raise StoreUnresponsive(what, timeout_s)
        finally:
            self._lock.release()
        if request.error is not None:
            raise request.error
        value: T = request.value
        return value

    def _ready(self, what: str, timeout_s: float) -> _Worker:
        self._stuck = [w for w in self._stuck if w.thread.is_alive()]
        if len(self._stuck) >= self.MAX_STUCK:
            raise StoreUnresponsive(f"{what} (it has not returned from {len(self._stuck)} earlier calls)", timeout_s)
        worker = self._worker
        if worker is None or not worker.thread.is_alive():  # none yet, or lost (a fork keeps no threads)
            worker = self._worker = _Worker(self._name)
        return worker

    def close(self, join_s: float = 0.0) -> bool:
        """End the worker (once its call, if any, returns); with ``join_s``, wait that long. True if it ended."""
        thread = self.end()
        if thread is None:
            return True
        if join_s > 0 and thread is not threading.current_thread():
            thread.join(join_s)
        return not thread.is_alive()

    def end(self) -> threading.Thread | None:
        """Tell the worker to end (once its call, if any, returns) without waiting: its thread, or None."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is None:
            return None
        worker.requests.put(None)
        return worker.thread


class NoticeWait:
    """Notices awaited with the store's own blocking ``wait``, on one daemon thread and a store
    connection of its own (``Store.clone``; the side channel keeps one between waits, so a
    process connects once per generation, not once per wait: ``SideChannel.notice_connection``):
    each notice costs one wait and one get however long it takes, and the wait never holds up
    the heartbeat's or any other store call (a TCPStore client runs one call at a time). The
    waiting thread asks ``done`` (no store request) and ``cancel``s when it stops waiting: that
    leaves ``GAVE_UP`` under the notice being waited for, which ends the store's wait, so this
    thread never outlives its waiter by more than a store call. Every other rank waiting for
    that notice then looks for the real post every ``GAVE_UP_POLL_S`` (it is hearing of the
    failure that made this rank give up). A store that cannot be cloned (a Python ``Store``) is
    polled at that pace instead.

    A store that fails under the wait (its host gone: the connection closed; a call that
    raised) ends it at once: ``done``, and ``result`` raises ``StoreFailureError`` naming the
    store and the notice. One that stops answering blocks this thread like a notice not yet
    posted: the waiter's bounded reads of its peers' records find it out (``SideChannel.watch``)."""

    CANCEL_JOIN_S = 1.0

    def __init__(self, side: SideChannel, keys: Sequence[str], timeout_s: float) -> None:
        self._side = side
        self.store = side.store_name
        """How messages name the store (``store_name``)."""
        self._keys = list(keys)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._values: list[bytes | None] = [None] * len(self._keys)
        self._at = 0  # the key being waited for
        self._stop = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="compiler_collectives-notices", daemon=True)
        self._thread.start()

    def done(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every notice (or the store's error): True once there."""
        return self._done.wait(timeout_s)

    def posted(self) -> list[bytes | None]:
        """Each key's notice, None where none arrived yet (``result`` raises the store's error)."""
        return list(self._values)

    def result(self) -> list[bytes]:
        """Every notice, once ``done``; ``StoreFailureError`` (the store's error its cause) if
        the store failed under the wait."""
        error = self._error
        if error is not None:
            raise StoreFailureError(
                f"rank {self._side.rank}: {self.store} failed while this rank waited on it for the notice "
                f"{self._keys[self._at]!r} ({store_error_text(error)})",
                rank=self._side.rank,
            ) from error
        values = [v for v in self._values if v is not None]
        assert len(values) == len(self._keys), "result() before done()"
        return values

    def cancel(self, why: str) -> None:
        """Stop waiting (``why`` is left with ``GAVE_UP`` for the other ranks' logs)."""
        if self._done.is_set():
            return
        self._stop.set()
        try:
            self._side.give_up_on(self._keys[self._at], why)
        except Exception as e:  # noqa: BLE001 - a store that does not answer ends the wait with an error
            log.debug("ending a wait for a notice: %s", e)
        self._thread.join(self.CANCEL_JOIN_S)

    def abandon(self) -> None:
        """Stop waiting without a word to the store (it failed, or stopped answering: asking it
        to end the wait would cost one more bounded call). This thread ends once its store call
        returns."""
        self._stop.set()

    def _run(self) -> None:
        own = None
        try:
            own = self._side.notice_connection()
            for i, key in enumerate(self._keys):
                self._at = i  # before looking at _stop: a cancel gives up on this key or finds _stop set
                value = self._wait_for(own, key)
                if value is None:
                    break
                self._values[i] = value
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            self._error = e
        finally:
            if own is not None and self._error is None:
                self._side.spare_connection(own)  # its calls all returned: the next wait takes it
            self._done.set()

    def _wait_for(self, own: Any, key: str) -> bytes | None:
        if own is not None and not self._stop.is_set():
            count_requests(2)
            own.wait([key], self._timeout)
            value: bytes = own.get(key)
            if not value.startswith(GAVE_UP):
                return value
        store = own if own is not None else self._side.store
        while not self._stop.wait(GAVE_UP_POLL_S):
            count_requests()
            if store.check([key]):
                count_requests()
                value = store.get(key)
                if not value.startswith(GAVE_UP):
                    return value
        return None


@dataclasses.dataclass
class PeerStatus:
    rank: int
    state: str  # "failed", "absent", "alive", "unknown" (``why`` says why, or the store did not answer)
    guard_seq: int | None = None
    compiler_seq: int | None = None
    frame: str | None = None
    silent_s: float | None = None  # how long this rank watched the beat counter stand still
    why: str | None = None  # for "absent" and "unknown": what showed it
    message: str | None = None
    report: dict[str, Any] | None = None  # for "failed": its failure report as the diagnosis ended
    liveness: Liveness | None = None  # the verdict the state was read from (``liveness.judge``)

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
        return f"rank {self.rank}: unknown ({self.why or 'the store did not answer'})"


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


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# How to reach the default group's c10d store. Torch offers no public
# accessor; the Dynamo seam (the one place that touches torch internals)
# supplies it at install, checked by the seam table.
_default_store: Callable[[], Any] | None = None


@process_state.wired(names=("_default_store",), what="how to reach the c10d store")
def set_default_store_source(source: Callable[[], Any]) -> None:
    global _default_store
    _default_store = source


def default_store() -> Any:
    """The default process group's c10d store."""
    if _default_store is None:
        raise RuntimeError("compiler_collectives is not installed: no way to reach the c10d store")
    return _default_store()


class PeerRecords:
    """What the watches of one wait (``SideChannel.watch``) last read of their peers on the
    store, and when: one read serves them all. The first reads every peer's failure key and
    record; later ones read only what can change: one ``multi_get`` of the records of the peers
    that beat, and the failure key of each that does not (heartbeats off: no heartbeat thread
    hears its reports)."""

    def __init__(self, side: SideChannel, ranks: Sequence[int]) -> None:
        self._side = side
        self.ranks = list(ranks)
        self.read_at: float | None = None
        self.failed: dict[int, bool] = {r: False for r in self.ranks}
        self.records: dict[int, dict[str, Any] | None] = {r: None for r in self.ranks}

    def interval(self, rank: int) -> float:
        """``rank``'s heartbeat interval as its record says (0: it beats none, or no record)."""
        record = self.records.get(rank)
        value = None if record is None else record.get("hb_s")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0

    def due(self, now: float, rank: int, doubt: bool) -> bool:
        """Whether to read the store again for ``rank``'s watch: never read; a peer without a
        heartbeat's failure key every ``RECORD_EVERY_S``; a beating one only while what was last
        read makes it look silent or wedged (``doubt``), every half of ``stale_after``: a peer
        whose beat moves is read about once per ``stale_after``."""
        if self.read_at is None:
            return True
        waited = now - self.read_at
        interval = self.interval(rank)
        if interval <= 0:
            return self.records.get(rank) is not None and waited >= RECORD_EVERY_S
        return doubt and waited >= stale_after(interval) / 2

    def read(self) -> None:
        """Read the store (bounded, on the side channel's store-call thread)."""
        self._side.call(self._read, config.settings.timeout_s, "reading a heartbeat")
        self.read_at = time.monotonic()

    def _read(self) -> None:
        side = self._side
        if self.read_at is None:
            for r in self.ranks:
                self.failed[r], self.records[r] = side._read_peer(r)
            return
        beating = [r for r in self.ranks if self.interval(r) > 0]
        self.records.update(zip(beating, side._read_records(beating)))
        for r in self.ranks:
            if r not in beating and self.records[r] is not None:
                self.failed[r] = side._reported(r)


class SideChannel:
    """One per generation of our groups (a new default group starts a new one)."""

    def __init__(
        self,
        rank: int,
        world: int,
        generation: int,
        progress: Callable[[], dict[str, Any]],
        *,
        identity: dict[str, Any] | None = None,
        probe: Probe | None = None,
        current: Callable[[], bool] = lambda: True,
        store: Any = None,
    ) -> None:
        """``store``: the c10d store to keep our keys on (None: the default group's)."""
        self.rank = rank
        self.world = world
        self.generation = generation
        # torch.distributed re-exports PrefixStore at run time, outside what its types declare.
        prefix_store = dist.PrefixStore  # type: ignore[attr-defined]
        self.store = prefix_store(f"compiler_collectives/{generation}/", default_store() if store is None else store)
        self.store_name = store_name(self.store)
        """How messages name the store ("the c10d store at host:port")."""
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
        self._caller = StoreCaller()  # the frequent store calls (``call``): one thread, not one per call
        # A NoticeWait's store connection, kept between waits (``notice_connection``).
        self._spare: Any = None
        self._spare_lock = threading.Lock()
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
            count_requests(2)
            self.store.set(f"join/{name}/{self.rank}", "1")
            try:
                self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
                return []
            except Exception:  # noqa: BLE001 - c10d raises DistStoreError/RuntimeError
                count_requests(1 + len(keys))
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
        """Write the first heartbeat record, then (heartbeats on) start the thread that beats.

        The record is written with heartbeats off too: it carries this process's
        identity, without which a peer on this host could not tell from ``/proc``
        that this process died (``liveness.judge``).
        """
        self._on_peer_failure = on_peer_failure
        interval = config.settings.heartbeat_s
        if self._thread is not None or self._beats > 0:
            return
        bounded(self._beat, config.settings.timeout_s, "the first heartbeat")
        if interval <= 0:
            return
        self._thread = threading.Thread(
            target=self._run, args=(interval,), name="compiler_collectives-heartbeat", daemon=True
        )
        self._thread.start()

    def stop(self, join_s: float = 0.0) -> bool:
        """Stop the heartbeat and the store caller's thread; with ``join_s``, wait that long
        for them. True if both ended."""
        return self.stopping()(join_s)

    def stopping(self) -> Callable[[float], bool]:
        """Tell the heartbeat and the store caller's thread to stop, without waiting: both wake
        at once (an ``Event``, a queue), and end unless inside a store call. Returns
        ``join(join_s)``, which waits up to ``join_s`` for both (True if both ended); it holds
        their threads only, not this channel or its store, which the threads let go as they end."""
        self._stop.set()
        with self._spare_lock:
            self._spare = None  # the store's last reference goes with the channel's (GROUP_ENDING)
        current = threading.current_thread()
        threads = [t for t in (self._caller.end(), self._thread) if t is not None and t is not current]

        def join(join_s: float) -> bool:
            deadline = time.monotonic() + join_s
            for thread in threads:
                if join_s > 0:
                    thread.join(max(0.0, deadline - time.monotonic()))
            return not any(thread.is_alive() for thread in threads)

        return join

    def call(self, fn: Callable[[], T], timeout_s: float, what: str) -> T:
        """Run ``fn`` (store calls) bounded by ``timeout_s`` on this channel's one store-call
        thread (``StoreCaller``): for calls made often, where ``bounded``'s thread per call adds up."""
        return self._caller.call(fn, timeout_s, what)

    def _beat(self) -> None:
        self._beats += 1
        record = dict(self._progress())
        record.update(self._identity)
        record["n"] = self._beats
        record["hb_s"] = config.settings.heartbeat_s  # 0: this counter never moves (liveness.judge)
        count_requests()
        self.store.set(f"hb/{self.rank}", json.dumps(record))

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            if not self._current():
                return  # the default group is gone (destroyed or replaced): so is our job here
            try:
                self._beat()
                count_requests()
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
        count_requests()
        if not self.store.check([key]):
            return None
        count_requests()
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
                count_requests()
                try:
                    self.store.wait([f"fail/{r}"], datetime.timedelta(seconds=wait_s))
                except Exception:  # noqa: BLE001 - c10d raises DistStoreError/RuntimeError on a timeout
                    count_requests()  # its cancel
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
            count_requests(1 if update else 2)
            self.store.set(f"fail/{self.rank}", json.dumps(record))
            if not update:
                self.store.add("failures", 1)

        bounded(report, min(config.settings.timeout_s, 2.0 + config.settings.heartbeat_s), "the failure report")

    def _read_peer(self, r: int) -> tuple[bool, dict[str, Any] | None]:
        """(reported a failure, heartbeat record or None)."""
        count_requests(2)
        failed = self.store.check([f"fail/{r}"])
        if not self.store.check([f"hb/{r}"]):
            return failed, None
        return failed, self._read_record(r)

    def _read_record(self, r: int) -> dict[str, Any] | None:
        """Rank ``r``'s heartbeat record, known to exist (a ``get`` of a missing key would block)."""
        count_requests()
        try:
            record = json.loads(self.store.get(f"hb/{r}"))
        except ValueError:
            record = None
        return record if isinstance(record, dict) else None

    def _read_records(self, ranks: Sequence[int]) -> list[dict[str, Any] | None]:
        """The heartbeat records of ``ranks``, each known to exist: one request."""
        if not ranks:
            return []
        count_requests()
        out: list[dict[str, Any] | None] = []
        for raw in self.store.multi_get([f"hb/{r}" for r in ranks]):
            try:
                record = json.loads(raw)
            except ValueError:
                record = None
            out.append(record if isinstance(record, dict) else None)
        return out

    def _reported(self, r: int) -> bool:
        count_requests()
        return bool(self.store.check([f"fail/{r}"]))

    # ------------------------------------------------------------ notices

    def post(self, name: str, value: bytes) -> None:
        """Leave ``value`` under ``name`` for the peers (bounded like every store call of ours)."""

        def post() -> None:
            count_requests()
            self.store.set(f"post/{name}", value)  # type: ignore[arg-type]  # c10d takes bytes; its stubs say str

        self.call(post, config.settings.timeout_s, "posting a notice")

    def read_post(self, name: str) -> bytes | None:
        """The value posted under ``name``, or None if nothing is posted yet (never waits)."""

        def read() -> bytes | None:
            key = f"post/{name}"
            count_requests()
            if not self.store.check([key]):
                return None
            count_requests()
            value: bytes = self.store.get(key)
            return None if value.startswith(GAVE_UP) else value

        return self.call(read, config.settings.timeout_s, "reading a notice")

    def wait_posts(self, names: Sequence[str], timeout_s: float) -> NoticeWait:
        """Start waiting for a notice under each of ``names`` (``NoticeWait``): on a store
        connection of its own, so that the heartbeat's and every other store call go on meanwhile."""
        return NoticeWait(self, [f"post/{name}" for name in names], timeout_s)

    def notice_connection(self) -> Any:
        """A store connection for one ``NoticeWait`` alone: the spare one a wait before it left
        (``spare_connection``), else a new one (``Store.clone``: it connects); None where the
        store cannot be cloned (a Python ``Store``: notices are polled)."""
        with self._spare_lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            return spare
        count_requests()  # a TCPStore's clone connects
        try:
            store: Any = self.store  # PrefixStore: its stubs lack clone
            return store.clone()
        except Exception as e:  # noqa: BLE001 - a store type without clone: polled instead
            log.debug("the store cannot be cloned (%s): notices are polled", e)
            return None

    def spare_connection(self, connection: Any) -> None:
        """A ``NoticeWait`` is done with ``connection`` (every call of its returned, none failed):
        kept for the next one, one at most, none once this channel stopped."""
        with self._spare_lock:
            if self._spare is None and not self._stop.is_set():
                self._spare = connection

    def give_up_on(self, key: str, why: str) -> None:
        """Leave ``GAVE_UP`` under ``key`` unless something is posted there (bounded): it ends a
        store wait for that key, on any rank."""

        def leave() -> None:
            count_requests()
            self.store.compare_set(key, b"", GAVE_UP + why.encode()[:200])  # type: ignore[arg-type]

        self.call(leave, min(config.settings.timeout_s, 5.0), "ending a wait for a notice")

    # ------------------------------------------------------------ liveness

    def peer_watch(self) -> PeerWatch:
        """A fresh watch of one peer's beat counter, judged from this host (``liveness``)."""
        return PeerWatch(
            here=_as_int(self._identity.get("host")), probe=self._probe, heartbeat_s=config.settings.heartbeat_s
        )

    def watch(
        self,
        rank: int,
        *,
        policy: WaitPolicy = COMPILE_WAIT,
        connection: Callable[[], str | None] | None = None,
        records: PeerRecords | None = None,
    ) -> Callable[[], str | None]:
        """A probe of peer ``rank``: each call returns why ``policy`` gives up on it (absent), or
        None while ``policy`` waits for it. Each verdict ``policy`` waits through with a warning
        (compile once's wait: a stopped or wedged peer on this host, a silent one elsewhere) is
        logged when it starts and every ``WARN_EVERY_S`` while it lasts. Peers on this host are
        looked for in ``/proc`` at each call, with heartbeats on or off. ``connection`` (transport's
        look at this rank's connection to the peer: what broke, or None) is asked about a peer
        that /proc cannot see and that is silent or beats no heartbeat, at most every
        ``CONNECTION_EVERY_S``: a process that ended on another host is known by its reset
        connection, heartbeats on or off, within about that.

        The store is read rarely (``PeerRecords``, shared by the watches of one wait where
        ``records`` is given): the verdict is judged from the record last read, its process
        looked for in ``/proc`` at each call, and the record read again only where that
        verdict says silent or wedged (about once per ``stale_after`` while the peer beats: its
        failure reports reach this rank through the heartbeat thread instead)."""
        watch = self.peer_watch()
        warned: dict[Liveness, float] = {}  # verdict -> when it was last warned of
        looked = [float("-inf")]  # when the connection was last looked at
        seen = records if records is not None else PeerRecords(self, [rank])

        def absent() -> str | None:
            now = time.monotonic()
            verdict = None
            if seen.read_at is not None:
                verdict = watch.read(seen.records[rank], failed=seen.failed[rank])
            if seen.due(now, rank, doubt=verdict is not None and verdict.liveness in _DOUBTS):
                seen.read()
                verdict = watch.read(seen.records[rank], failed=seen.failed[rank])
            assert verdict is not None
            failed, record = seen.failed[rank], seen.records[rank]
            undecided = verdict.liveness in (Liveness.SILENT, Liveness.UNKNOWN)
            if undecided and connection is not None and now - looked[0] >= CONNECTION_EVERY_S:
                looked[0] = now
                broken = connection()
                if broken is not None:
                    verdict = watch.read(record, failed=failed, broken=broken)
            if policy.gives_up(verdict):
                return verdict.why
            if verdict.liveness in policy.warn:
                last = warned.get(verdict.liveness)
                if last is None or now - last >= WARN_EVERY_S:
                    warned[verdict.liveness] = now
                    log.warning("%s", policy.warning(rank, verdict, connected=connection is not None))
            elif verdict.liveness is Liveness.ALIVE and warned:
                warned.clear()  # so that a second stop (or silence) is told as well
                log.info("rank %d runs again: %s", rank, verdict.why)
            return None

        return absent

    def diagnose(
        self, grace_s: float, *, until_absent: bool = False, broken: Mapping[int, str] | None = None
    ) -> Diagnosis:
        """Classify every peer (``liveness.DIAGNOSIS``); waits up to ``grace_s`` for undecided
        ones (with ``until_absent``, only until some peer is found absent). ``broken``: peers
        whose connection to this rank broke (rank -> what showed it): evidence of their death."""
        broken = broken or {}
        deadline = time.monotonic() + grace_s
        watches: dict[int, PeerWatch] = {}
        decided: dict[int, PeerStatus] = {}
        while True:
            peers = []
            for r in self.peers():
                if r == self.rank:
                    continue
                if r in decided:
                    peers.append(decided[r])
                    continue
                failed, record = self._read_peer(r)
                verdict = watches.setdefault(r, self.peer_watch()).read(record, failed=failed, broken=broken.get(r))
                status = PeerStatus(r, "alive", liveness=verdict.liveness)
                if record is not None:
                    status.guard_seq = _as_int(record.get("guard_seq"))
                    status.compiler_seq = _as_int(record.get("compiler_seq"))
                    status.frame = _str_or_none(record.get("frame"))
                if verdict.liveness is Liveness.FAILED:
                    status.state = "failed"
                elif DIAGNOSIS.gives_up(verdict):
                    status.state, status.why, status.silent_s = "absent", verdict.why, verdict.silent_s
                elif verdict.liveness is Liveness.UNKNOWN:  # on another host, without a heartbeat
                    status.state, status.why = "unknown", verdict.why
                if status.state in ("failed", "absent"):
                    decided[r] = status
                peers.append(status)
            undecided = [p for p in peers if p.state in ("alive", "unknown")]
            left = deadline - time.monotonic()
            if not undecided or left <= 0 or (until_absent and any(p.state == "absent" for p in peers)):
                for p in peers:  # as they read now (a report is updated once its sender diagnosed)
                    if p.state == "failed":
                        p.report = self._report(p.rank)
                return Diagnosis(peers)
            time.sleep(min(0.1, left))


def diagnose_with_deadline(
    channel: SideChannel | None,
    deadline_s: float,
    *,
    until_absent: bool = False,
    broken: Mapping[int, str] | None = None,
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
            lambda: channel.diagnose(grace_s=max(0.0, deadline_s - 0.5), until_absent=until_absent, broken=broken),
            deadline_s + 1.5,
            "during the diagnosis",
        )
    except Exception as e:  # noqa: BLE001
        log.debug("side-channel diagnosis failed: %s", e)
        return None
