"""The store side channel of one generation: the heartbeat and failure-report board.

Gloo tells a survivor that "the connection was reset" or "a recv timed out",
but not which rank is gone. A ``SideChannel`` keeps, under the key prefix
``compiler_collectives/<generation>/`` of the default store:

* ``hb/<rank>``: a heartbeat every ``COMPILER_COLLECTIVES_HEARTBEAT_S`` seconds
  from a daemon thread: a beat counter, the rank's process (pid, start time,
  host) and its progress (guard-collective number, compiler-collective number
  and frame). The hot path writes nothing: the thread reads counters the
  collectives keep anyway. While a wait of this rank watches peers
  (``PeerRecords``), the same thread reads their records in the request that
  reads the failure count: a watch costs the store nothing of its own;
* ``fail/<rank>`` and the counter ``failures``: a failing rank's report. The
  heartbeat thread of every rank watches the counter and hands a peer's report
  to its caller (transport's handler poisons the rank), so a rank waiting in
  one of our collectives (which checks that between slices of its wait) or
  about to enter one raises within about one heartbeat instead of at its
  timeout. A rank whose collective stopped on a peer's report reports too
  (``heard_from`` names that peer): the heartbeat threads prefer an original
  report, and a diagnosis never takes a relayed one for a failure of its own;
* ``post/<name>``: notices (``mailbox``); ``join/<name>/<rank>``: our
  rendezvous (``rendezvous``); ``setup/...``: the agreements' setup check.

With heartbeats off (``COMPILER_COLLECTIVES_HEARTBEAT_S=0``) no thread runs,
but ``hb/<rank>`` is still written once at start: the process's identity, so
that a peer on the same host can look for it in ``/proc``.

This module writes and reads the records; what they say of a peer (alive,
stopped, gone...) is the health layer's verdict (``health.liveness``), which
reads them through ``read_peer``, ``report`` and ``PeerRecords``, and tells
from ``unanswered`` whether the store still answers this rank's heartbeat.

At interpreter exit the heartbeat thread is stopped and joined (transport's
``shutdown``): a daemon thread that is inside a store call while Python
finalizes is killed as it takes the GIL back, inside a C++ destructor, and
that aborts the process ("terminate called without an active exception").
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from .. import config
from .calls import StoreCaller, bounded, count_requests, default_store, store_name
from .mailbox import Mailbox

# The name logs were filtered by before the store had a layer of its own.
log = logging.getLogger("compiler_collectives.watchdog")

# pid -> (state letter, start time in clock ticks) from /proc/<pid>/stat, or None if it is gone:
# handed in by transport, kept for the health layer's look at peers on this host.
ProcessProbe = Callable[[int], tuple[str, int] | None]

T = TypeVar("T")


class PeerRecords:
    """The heartbeat records of the peers one wait watches (health's ``watch_peer``), at no store
    request of the wait's own: while this rank beats, its heartbeat thread reads them in the
    request that reads the failure count (``SideChannel.watch``), once a beat; without a
    heartbeat thread (``COMPILER_COLLECTIVES_HEARTBEAT_S=0``) they never change after the one
    written at start, and are read once per generation (``record``). ``close`` when the wait ends.

    Every rank of a generation's groups wrote its record before the generation's first
    rendezvous, so a wait (which follows an exchange on those groups) only watches records that
    exist: the heartbeat's ``multi_get`` never waits for a missing key."""

    def __init__(self, side: SideChannel, ranks: Sequence[int]) -> None:
        self._side = side
        self.ranks = list(ranks)
        side.watch(self.ranks)
        self._closed = False

    def record(self, rank: int) -> dict[str, Any] | None:
        """``rank``'s record as last read (None: not read yet, for at most one beat). Without a
        heartbeat thread, the first call reads those not read before this generation (bounded,
        on the side channel's store-call thread; ``StoreUnresponsive`` or the store's error)."""
        side = self._side
        if not side.beating and rank not in side.records:
            side.call(
                functools.partial(side.read_records, self.ranks), config.settings.timeout_s, "reading a heartbeat"
            )
        return side.records.get(rank)

    def close(self) -> None:
        """The wait ended: the heartbeat stops reading these records (once every wait watching them closed)."""
        if not self._closed:
            self._closed = True
            self._side.unwatch(self.ranks)


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
        probe: ProcessProbe | None = None,
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
        self.identity = dict(identity or {})
        self.probe = probe  # pid -> (state letter, start time) or None if gone
        self._current = current  # False once the default group this channel serves is gone
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_peer_failure: Callable[[int, dict[str, Any]], None] | None = None
        self._seen_failures = 0
        self._beats = 0
        self._store_failing = False
        self._counted = False  # the failure count exists on the store (its first ``add`` made it)
        # The first beat the store has not answered yet, and since when (monotonic): None once a
        # beat was answered (``unanswered``).
        self._unanswered: tuple[int, float] | None = None
        self._watch_lock = threading.Lock()
        self._watched: dict[int, int] = {}  # rank -> how many waits watch its record
        self.records: dict[int, dict[str, Any] | None] = {}
        """The latest heartbeat record read of each watched peer (``PeerRecords``): by the
        heartbeat thread at each beat, or once without one."""
        self._caller = StoreCaller()  # the frequent store calls (``call``): one thread, not one per call
        self.mailbox = Mailbox(self.store, rank, self._caller)
        """Notices for the peers (``post``, ``read_post``, ``wait_posts``)."""
        # The ranks our agreements span (a scope: compiler_collectives.scope); None: every rank.
        # Rendezvous and diagnosis cover these only, so another scope is never waited for or
        # blamed. Failure reports are watched from every rank: a job stops as a whole.
        self.members: tuple[int, ...] | None = None

    def peers(self) -> tuple[int, ...] | range:
        """The ranks this rank's agreements span (itself included)."""
        return self.members if self.members is not None else range(self.world)

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
        self.mailbox.close()  # the store's last reference goes with the channel's (GROUP_ENDING)
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
        record.update(self.identity)
        record["n"] = self._beats
        record["hb_s"] = config.settings.heartbeat_s  # 0: this counter never moves (liveness.judge)
        count_requests()
        self.store.set(f"hb/{self.rank}", json.dumps(record))

    def unanswered(self) -> tuple[int, float] | None:
        """(the first beat the store has not answered, since when by the monotonic clock) from the
        moment that beat began until a beat's store calls all return; None meanwhile, and without
        a heartbeat thread. A store that stopped answering (or whose calls raise) leaves it set
        for good (health's ``StoreWatch``)."""
        return self._unanswered

    def watch(self, ranks: Sequence[int]) -> None:
        """Read the records of ``ranks`` at each beat from now on (``PeerRecords``), until ``unwatch``."""
        with self._watch_lock:
            for r in ranks:
                self._watched[r] = self._watched.get(r, 0) + 1

    def unwatch(self, ranks: Sequence[int]) -> None:
        with self._watch_lock:
            for r in ranks:
                left = self._watched.get(r, 0) - 1
                if left > 0:
                    self._watched[r] = left
                else:
                    self._watched.pop(r, None)

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            if not self._current():
                return  # the default group is gone (destroyed or replaced): so is our job here
            if self._unanswered is None:
                self._unanswered = (self._beats + 1, time.monotonic())
            try:
                self._beat()
                failures = self._read_board()
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
            self._unanswered = None
            if self._store_failing:
                self._store_failing = False
                log.warning("heartbeat of rank %d: the c10d store answers again", self.rank)

    def _read_board(self) -> int:
        """The failure count, and the records of the peers that waits watch, in one request: the
        count's ``add`` of 0 (which makes it, the first time), or once it exists and while some
        wait watches, one ``multi_get`` of the count (kept as decimal text) and those records."""
        with self._watch_lock:
            watched = sorted(self._watched)
        count_requests()
        if not watched or not self._counted:
            failures = int(self.store.add("failures", 0))
            self._counted = True
            return failures
        values = self.store.multi_get(["failures", *(f"hb/{r}" for r in watched)])
        self.records.update(zip(watched, (_record(raw) for raw in values[1:])))
        return int(values[0])

    def _notice_failures(self) -> None:
        # The lowest rank with an original report: a relayed one (a rank that stopped on
        # another's report) only where none is readable yet.
        relayed: tuple[int, dict[str, Any]] | None = None
        for r in range(self.world):
            if r == self.rank:
                continue
            report = self.report(r)
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

    # ------------------------------------------------------------ failure reports

    def report(self, r: int) -> dict[str, Any] | None:
        """Rank ``r``'s failure report as the store holds it now, None if it wrote none (store
        calls on the caller's thread, unbounded: for callers already bounded)."""
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
            return self.report(r)

        return bounded(read, wait_s + 2.0, f"reading rank {r}'s failure report")

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

    # ------------------------------------------------------------ heartbeat records

    def read_peer(self, r: int) -> tuple[bool, dict[str, Any] | None]:
        """(reported a failure, heartbeat record or None): unbounded, for callers already bounded."""
        count_requests(2)
        failed = self.store.check([f"fail/{r}"])
        if not self.store.check([f"hb/{r}"]):
            return failed, None
        return failed, self._read_record(r)

    def _read_record(self, r: int) -> dict[str, Any] | None:
        """Rank ``r``'s heartbeat record, known to exist (a ``get`` of a missing key would block)."""
        count_requests()
        return _record(self.store.get(f"hb/{r}"))

    def read_records(self, ranks: Sequence[int]) -> None:
        """Read the records of ``ranks`` not read before into ``records`` (unbounded: for callers
        already bounded): whether all exist, then all in one request; each apart where some do
        not (one that never wrote a record reads as None)."""
        missing = [r for r in ranks if r not in self.records]
        if not missing:
            return
        keys = [f"hb/{r}" for r in missing]
        count_requests()
        if self.store.check(keys):
            count_requests()
            self.records.update(zip(missing, (_record(raw) for raw in self.store.multi_get(keys))))
            return
        for r in missing:
            count_requests()
            self.records[r] = self._read_record(r) if self.store.check([f"hb/{r}"]) else None


def _record(raw: bytes) -> dict[str, Any] | None:
    """A heartbeat record as stored (JSON), or None where it is not one."""
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
