"""A wait's watch of its peers and of the store: their liveness verdicts, with the wait's policy
applied, at no store request of the wait's own.

Compile once's loader waits for the rank that compiles its graph, for as long
as a compile takes (``watch_peer``, ``liveness.COMPILE_WAIT``): it waits for a
stopped, wedged or silent peer, warning when that starts and every
``liveness.WARN_EVERY_S`` while it lasts, and gives up on a gone or failed
one. The verdict (``liveness.judge``) is read from the peer's heartbeat record
(``store.board.PeerRecords``: what this rank's heartbeat thread reads at each
beat, in the request that reads the failure count; read once per generation
without a heartbeat), on this host ``/proc``, and, where the caller hands one,
the state of this rank's connection to it (a broken one is evidence of death:
transport looks, this module only asks). A failure the peer reports reaches
the wait through the heartbeat thread too (the latch), not through this watch.

Whether the store still answers is told by the same thread (``StoreWatch``):
a heartbeat the store leaves unanswered for ``COMPILER_COLLECTIVES_TIMEOUT``
of this rank's waiting means a store that stopped answering. Beat counters
and unanswered beats are timed on this rank's own monotonic clock: no two hosts'
clocks are ever compared.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from .. import config
from ..store.board import PeerRecords, SideChannel
from .liveness import COMPILE_WAIT, WARN_EVERY_S, Liveness, PeerWatch, WaitPolicy, as_int

# The name logs were filtered by before the store had a layer of its own.
log = logging.getLogger("compiler_collectives.watchdog")

CONNECTION_EVERY_S = 1.0
"""How often ``watch_peer`` looks at its connection to a peer it cannot see in /proc
(each look sends that peer one small gloo message)."""

STEP_CAP_S = 1.0
"""The most of one interval between two looks that ``StoreWatch`` counts as waiting for the
store: a longer one is this process stopped (SIGSTOP, a debugger), not the store."""


def peer_watch(side: SideChannel) -> PeerWatch:
    """A fresh watch of one peer's beat counter, judged from this host (``liveness``)."""
    return PeerWatch(here=as_int(side.identity.get("host")), probe=side.probe, heartbeat_s=config.settings.heartbeat_s)


def watch_peer(
    side: SideChannel,
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

    The record is the one ``records`` last read (``PeerRecords``, shared by the watches of one
    wait where given; this rank's heartbeat thread reads it at each beat, so until its next
    beat there may be none, and nothing is judged): a call asks the store nothing, except
    without a heartbeat thread, the first of a generation."""
    watch = peer_watch(side)
    warned: dict[Liveness, float] = {}  # verdict -> when it was last warned of
    looked = [float("-inf")]  # when the connection was last looked at
    seen = records if records is not None else PeerRecords(side, [rank])

    def absent() -> str | None:
        now = time.monotonic()
        record = seen.record(rank)
        if record is None:
            return None  # not read yet (for at most a beat): nothing tells, and nothing is asked
        verdict = watch.read(record, failed=False)
        undecided = verdict.liveness in (Liveness.SILENT, Liveness.UNKNOWN)
        if undecided and connection is not None and now - looked[0] >= CONNECTION_EVERY_S:
            looked[0] = now
            broken = connection()
            if broken is not None:
                verdict = watch.read(record, failed=False, broken=broken)
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


class StoreWatch:
    """A probe of the store: each call returns how long (s) this rank's heartbeat has waited for
    the store to answer (``SideChannel.unanswered``: one beat left unanswered, or beats whose
    calls raise), once that reached ``timeout_s``; else None. Counted only while the probe is
    called (a wait calls it every few tens of milliseconds), at most ``STEP_CAP_S`` an interval,
    so that this process stopped is not the store stopped. Without a heartbeat thread nothing
    tells, and it returns None."""

    def __init__(self, side: SideChannel, timeout_s: float) -> None:
        self._side = side
        self._timeout_s = timeout_s
        self._beat: int | None = None  # the first unanswered beat when last looked
        self._looked = time.monotonic()
        self._waited = 0.0

    def __call__(self) -> float | None:
        now = time.monotonic()
        unanswered = self._side.unanswered()
        beat = None if unanswered is None else unanswered[0]
        step = min(now - self._looked, STEP_CAP_S)
        self._waited = self._waited + step if beat is not None and beat == self._beat else 0.0
        self._beat, self._looked = beat, now
        return self._waited if self._waited >= self._timeout_s else None


class WaitWatch:
    """The watches of one wait: a probe per peer (``peers``, ``watch_peer``, sharing one
    ``PeerRecords``) and one of the store (``store``, ``StoreWatch``, bounded by
    ``COMPILER_COLLECTIVES_TIMEOUT``). ``close`` when the wait ends: this rank's heartbeat
    then stops reading those peers' records."""

    def __init__(
        self,
        side: SideChannel,
        ranks: Sequence[int],
        *,
        policy: WaitPolicy = COMPILE_WAIT,
        connections: Mapping[int, Callable[[], str | None]] | None = None,
    ) -> None:
        self.records = PeerRecords(side, ranks)
        self.peers = {
            r: watch_peer(side, r, policy=policy, connection=(connections or {}).get(r), records=self.records)
            for r in ranks
        }
        self.store = StoreWatch(side, config.settings.timeout_s)

    def close(self) -> None:
        self.records.close()
