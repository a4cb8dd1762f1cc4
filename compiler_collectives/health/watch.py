"""A wait's watch of one peer: its liveness verdict, with the wait's policy applied.

Compile once's loader waits for the rank that compiles its graph, for as long
as a compile takes (``watch_peer``, ``liveness.COMPILE_WAIT``): it waits for a
stopped, wedged or silent peer, warning when that starts and every
``liveness.WARN_EVERY_S`` while it lasts, and gives up on a gone or failed
one. The verdict (``liveness.judge``) is read from the peer's heartbeat record
on the store (``store.board.PeerRecords``, read rarely), on this host
``/proc``, and, where the caller hands one, the state of this rank's
connection to it (a broken one is evidence of death: transport looks, this
module only asks). Beat counters are timed on this rank's own monotonic
clock: no two hosts' clocks are ever compared.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .. import config
from ..store.board import PeerRecords, SideChannel
from .liveness import COMPILE_WAIT, WARN_EVERY_S, Liveness, PeerWatch, WaitPolicy, as_int, stale_after

# The name logs were filtered by before the store had a layer of its own.
log = logging.getLogger("compiler_collectives.watchdog")

CONNECTION_EVERY_S = 1.0
"""How often ``watch_peer`` looks at its connection to a peer it cannot see in /proc
(each look sends that peer one small gloo message)."""

_DOUBTS = (Liveness.SILENT, Liveness.WEDGED)  # verdicts from an old record that a new one may undo


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

    The store is read rarely (``PeerRecords``, shared by the watches of one wait where
    ``records`` is given): the verdict is judged from the record last read, its process
    looked for in ``/proc`` at each call, and the record read again only where that
    verdict says silent or wedged, every half of ``stale_after`` (about once per
    ``stale_after`` while the peer beats: its failure reports reach this rank through the
    heartbeat thread instead)."""
    watch = peer_watch(side)
    warned: dict[Liveness, float] = {}  # verdict -> when it was last warned of
    looked = [float("-inf")]  # when the connection was last looked at
    seen = records if records is not None else PeerRecords(side, [rank])

    def absent() -> str | None:
        now = time.monotonic()
        verdict = None
        if seen.read_at is not None:
            verdict = watch.read(seen.records[rank], failed=seen.failed[rank])
        doubt = verdict is not None and verdict.liveness in _DOUBTS
        if seen.due(now, rank, again_s=stale_after(seen.interval(rank)) / 2 if doubt else None):
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
