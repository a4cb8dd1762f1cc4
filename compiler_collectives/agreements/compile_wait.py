"""Waiting for peers that compile: each posts to the store when its compile ended, and the
others wait for those posts until something shows a compiling rank dead (its process gone,
its connection broken: ``groups.watch_peers``; a failure it reported, which the heartbeat
thread hears; silence alone is waited through, with warnings), up to
``COMPILER_COLLECTIVES_COMPILE_TIMEOUT``.

A compile may legitimately take far longer than ``COMPILER_COLLECTIVES_TIMEOUT`` allows a
collective to wait. Wherever some ranks compile while the others are done (compile once's
source and the ranks that did not load its artifact; the audit's ranks that compile again
without caches), the others wait here, not at their next exchange: a rank that is gone, a
failure this rank heard of, or the compile timeout ends the wait with an error that names
the ranks, never a timeout that blames the collective timeout.

Waiting blocks; it asks the store nothing while it lasts (issues 37 and 43): the posts are
awaited with the store's own ``wait`` on a connection of their own (``groups.wait_posts``: a
``wait`` for all of them and a ``multi_get`` of them, two store requests per wait however long
the compile; the connection is made once per generation, with its compile group). Meanwhile
this thread looks every ``TICK_S`` for a failure this rank heard of (``health.latch.first_failure``,
fed by the heartbeat thread) and at whether the store still answers this rank's heartbeat
(``groups.watch_peers(...).store``), and every ``PROBE_EVERY_S`` at the pending ranks: their
heartbeat records as this rank's heartbeat thread last read them (in the request it makes anyway:
no request of the wait's own; without a heartbeat, read once per generation), ``/proc`` for a rank
on this host and the gloo connection to one elsewhere, neither of which costs the store anything.

The store can fail under the wait (issue 37, item 4): its host gone (the connection closed or
reset: the notice wait's own connection sees it at once), a call that raises, or a store that
stops answering. A stopped store leaves this rank's heartbeat waiting for its answer: once one
beat has waited ``COMPILER_COLLECTIVES_TIMEOUT`` (as this thread watched; its own stops not
counted), the store stopped. Each ends the wait with ``StoreFailureError`` naming the store,
published like any failure: same-host peers hear of it through shared memory, the others through
the store where it still answers. With heartbeats off nothing tells a stopped store from a long
compile: the wait goes on until the compiling rank's own post meets it (below), and its process,
once it ends, breaks its connection.

The compiling rank's side (``post``: that its compile ended, or its install) meets the same
dead store: ``StoreFailureError`` naming the store and the graph, published the same way. No
report of it crosses hosts through a store that is gone; what reaches a rank waiting on another
host is its own wait's store failure (a killed store closes its connection at once, a stopped
one its heartbeat's unanswered beat), and once the compiling rank's process ends, its broken
gloo connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from .. import config, health
from ..errors import CollectiveError, PeerFailureError, StoreFailureError, StoreUnresponsive, ranks_text
from ..store.calls import store_error_text
from ..transport import groups
from . import failure as failure_procedure

log = logging.getLogger("compiler_collectives.compile_wait")

LOG_EVERY_S = 30.0
TICK_S = 0.05  # how often the wait looks for a failure this rank heard of, and at the store (no store request)
PROBE_EVERY_S = 0.2  # how often it looks at the pending ranks (groups.watch_peers: no store request)
_STORE_FAILED = "the store failed"
_MARGIN_S = 60.0  # the store's own wait outlasts the compile timeout: this thread ends it first
STORE_ADVICE = (
    "Every rank needs that store: check that the process hosting it (rank 0 under torchrun, or "
    "whatever serves MASTER_ADDR:MASTER_PORT) still runs and answers from this host (its log and "
    "exit status, the OOM killer, the network), then restart the job."
)


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
    so that the compiling ranks hear of them at their next exchange. A store that fails under
    the wait raises ``StoreFailureError`` naming it, published the same way.
    """
    order = sorted(keys)
    started = time.monotonic()
    deadline = started + config.settings.compile_timeout_s
    next_log = started + LOG_EVERY_S
    watch = groups.watch_peers(order)
    notices = groups.wait_posts([keys[r] for r in order], config.settings.compile_timeout_s + _MARGIN_S)
    why_not = "it stopped waiting"
    pending = list(order)

    def store_failed(failed: str) -> CollectiveError:
        nonlocal why_not
        why_not = _STORE_FAILED
        return _store_failure(
            f"{what} on rank {me}: stopped waiting for {ranks_text(pending)} to {doing}: {failed}",
            kind=kind,
            rank=me,
            seq=seq,
            frame=frame,
        )

    try:
        next_probe = started
        while not notices.done(TICK_S):
            pending = [r for r, value in zip(order, notices.posted()) if value is None]
            failure_seen = health.latch.first_failure
            if failure_seen is not None:
                why_not = f"it heard of a failure: {failure_seen}"
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
            if watch.store() is not None:
                raise store_failed(
                    f"{notices.store} did not answer this rank's heartbeat within "
                    f"{config.settings.timeout_s:.0f}s (COMPILER_COLLECTIVES_TIMEOUT)"
                )
            now = time.monotonic()
            if now >= next_probe:
                next_probe = now + PROBE_EVERY_S
                for r in pending:
                    try:
                        gone = watch.peers[r]()
                        if gone is None or groups.read_post(keys[r]) is not None:
                            continue  # alive, or it posted (the wait had not got to its notice yet) and then went
                    except StoreUnresponsive as e:
                        raise store_failed(f"{notices.store} did not answer {e.what} within {e.timeout_s:.0f}s") from e
                    except (RuntimeError, OSError) as e:  # c10d's DistError is a RuntimeError
                        if isinstance(e, CollectiveError):
                            raise
                        raise store_failed(
                            f"{notices.store} failed while this rank read rank {r}'s records ({store_error_text(e)})"
                        ) from e
                    why_not = f"rank {r} is gone"
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
                    raise failure_procedure.fail(error, kind=kind, cause=failure_procedure.KNOWN)
            if now >= deadline:
                why_not = "its compile timeout passed"
                raise failure_procedure.fail(
                    on_timeout(
                        f"{what} on rank {me}: waited {now - started:.0f}s for {ranks_text(pending)} to {doing}, "
                        f"and nothing showed them dead. {advice}",
                        kind=kind,
                        rank=me,
                        seq=seq,
                        frame=frame,
                        ranks=tuple(pending),
                    ),
                    kind=kind,
                    cause=failure_procedure.KNOWN,
                )
            if now >= next_log:
                next_log = now + LOG_EVERY_S
                waited = now - started
                log.warning("rank %d: waiting for %s to %s (%s, %.0f s)", me, ranks_text(pending), doing, what, waited)
        try:
            values = notices.result()
        except StoreFailureError as e:
            cause = e.__cause__ or e
            pending = [r for r, value in zip(order, notices.posted()) if value is None]
            raise store_failed(
                f"{notices.store} failed while this rank waited on it ({store_error_text(cause)})"
            ) from cause
    finally:
        watch.close()
        if why_not == _STORE_FAILED:
            notices.abandon()  # asking the store to end the wait would cost one more bounded call
        else:
            notices.cancel(f"rank {me} stopped waiting for it: {why_not}")
    return dict(zip(order, values))


def post(name: str, value: bytes, *, me: int, what: str, telling: str, kind: str, seq: int | None, frame: str) -> None:
    """``groups.post``, for a rank that others wait for here: a store that fails under it raises
    ``StoreFailureError`` naming the store and ``what`` (the graph), published through the failure
    procedure, instead of c10d's own error. ``telling`` says what the post tells the waiting ranks
    ("its compile of this graph ended")."""
    try:
        groups.post(name, value)
        return
    except StoreUnresponsive as e:
        failed = f"{groups.store_name()} did not answer {e.what} within {e.timeout_s:.0f}s"
        cause: BaseException = e
    except (RuntimeError, OSError) as e:  # c10d's DistError is a RuntimeError
        if isinstance(e, CollectiveError):
            raise
        failed = f"{groups.store_name()} failed while this rank posted it ({store_error_text(e)})"
        cause = e
    raise _store_failure(
        f"{what} on rank {me}: could not tell the ranks waiting for it that {telling}: {failed}",
        kind=kind,
        rank=me,
        seq=seq,
        frame=frame,
    ) from cause


def _store_failure(text: str, *, kind: str, rank: int, seq: int | None, frame: str) -> CollectiveError:
    """``StoreFailureError`` saying ``text`` and what to check, counted and published (``KNOWN``)."""
    error = StoreFailureError(f"{text}. {STORE_ADVICE}", kind=kind, rank=rank, seq=seq, frame=frame)
    return failure_procedure.fail(error, kind=kind, cause=failure_procedure.KNOWN)
