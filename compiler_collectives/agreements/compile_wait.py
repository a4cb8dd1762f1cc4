"""Waiting for peers that compile: each posts to the store when its compile ended, and the
others wait for those posts while the compiling ranks are alive, up to
``COMPILER_COLLECTIVES_COMPILE_TIMEOUT``.

A compile may legitimately take far longer than ``COMPILER_COLLECTIVES_TIMEOUT`` allows a
collective to wait. Wherever some ranks compile while the others are done (compile once's
source and the ranks that did not load its artifact; the audit's ranks that compile again
without caches), the others wait here, not at their next exchange: a rank that is gone, a
failure this rank heard of, or the compile timeout ends the wait with an error that names
the ranks, never a timeout that blames the collective timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from .. import config, health
from ..errors import CollectiveError, PeerFailureError, ranks_text
from ..stats import counters
from ..transport import groups
from . import failure as failure_procedure

log = logging.getLogger("compiler_collectives.compile_wait")

LOG_EVERY_S = 30.0
_POLL_S = (0.005, 0.2)  # first and longest sleep between looks at the store while waiting


def wait_for_posts(
    keys: Mapping[int, str],
    *,
    me: int,
    doing: str,
    what: str,
    kind: str,
    seq: int | None,
    frame: str,
    on_timeout: type[CollectiveError],
    advice: str,
) -> dict[int, bytes]:
    """What each rank of ``keys`` (global rank -> store key) posted, once all have.

    ``what`` names the graph for messages ("compile once #3 of f at a.py:7"); ``doing`` says
    what the ranks were to do ("compile this graph for this rank"). A rank that is gone raises
    ``PeerFailureError`` naming it (in its own report's words when it left one), a failure this
    rank heard of raises ``PeerFailureError`` quoting it, and the compile timeout raises
    ``on_timeout`` with ``advice``; the first two are published through the failure procedure
    so that the compiling ranks hear of them at their next exchange.
    """
    pending = sorted(keys)
    posted: dict[int, bytes] = {}
    started = time.monotonic()
    deadline = started + config.settings.compile_timeout_s
    next_log = started + LOG_EVERY_S
    probes = {r: groups.watch_peer(r) for r in pending}
    sleep = _POLL_S[0]
    while pending:
        for r in pending:
            value = groups.read_post(keys[r])
            if value is not None:
                posted[r] = value
        pending = [r for r in pending if r not in posted]
        if not pending:
            break
        failure_seen = health.poisoned()
        if failure_seen is not None:
            stopped: CollectiveError = PeerFailureError(
                f"{what} on rank {me}: stopped waiting for {ranks_text(pending)} to {doing}: {failure_seen}",
                kind=kind,
                rank=me,
                seq=seq,
                frame=frame,
                ranks=failure_seen.ranks,
                reported_by=failure_seen.reported_by,
            )
            if len(pending) == 1 and pending[0] not in failure_seen.reported_by:
                # The first report heard may be a bystander's (a rank whose own exchange broke on
                # the same failure, in words that name no one yet). The one rank this one waits
                # for stops on it too, and its words say what happened where this rank waited.
                stopped = failure_procedure.as_reported(stopped, pending[0], seq)
            raise stopped
        for r in pending:
            gone = probes[r]()
            if gone is not None:
                counters.errors += 1
                error: CollectiveError = PeerFailureError(
                    f"{what} on rank {me}: rank {r} was to {doing} and is gone: {gone}. Check rank {r}'s "
                    "log and exit status (killed by the OOM killer?).",
                    kind=kind,
                    rank=me,
                    seq=seq,
                    frame=frame,
                    ranks=(r,),
                )
                if groups.read_peer_report(r, me, wait_s=0.0) is not None:
                    # It stopped on a failure of its own or one it heard of: its words name the rank.
                    error = failure_procedure.as_reported(error, r, seq)
                raise failure_procedure.known(error, seq=seq)
        now = time.monotonic()
        if now >= deadline:
            counters.errors += 1
            raise failure_procedure.known(
                on_timeout(
                    f"{what} on rank {me}: waited {now - started:.0f}s for {ranks_text(pending)} to {doing}, "
                    f"and they are alive. {advice}",
                    kind=kind,
                    rank=me,
                    seq=seq,
                    frame=frame,
                    ranks=tuple(pending),
                ),
                seq=seq,
            )
        if now >= next_log:
            next_log = now + LOG_EVERY_S
            waited = now - started
            log.warning("rank %d: waiting for %s to %s (%s, %.0f s)", me, ranks_text(pending), doing, what, waited)
        time.sleep(sleep)
        sleep = min(sleep * 2, _POLL_S[1])
    return posted
