"""What an agreement does when its exchange fails: the failure procedure.

Transport moves bytes and says what it saw (gloo's error, a timeout, a peer's
failure word). This module decides what that means for the job:

* ``exchange_failed``: the error a byte exchange raises. A bad payload or a
  desync is seen identically by every rank, so nobody needs telling; anything
  else (a timeout, a dead peer, gloo's ``RuntimeError``) goes through ``fail``.
* ``fail``: publish, then diagnose. Same-host peers see the shared-memory
  failure word within microseconds; every other peer's heartbeat thread sees
  the store report within a heartbeat and poisons its rank. The diagnosis then
  names the ranks that are absent (crashed, killed, stopped) or alive
  elsewhere (a desync), and the error is re-typed to say so.

Either way this rank is poisoned (``health``): its later collectives refuse
until ``compiler_collectives.reset()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from .. import config, health
from ..errors import CollectiveDesyncError, CollectiveError, WireFormatError
from ..health.watchdog import Diagnosis, diagnose_with_deadline
from ..transport import groups, translate_failure

log = logging.getLogger("compiler_collectives.failure")


def exchange_failed(
    error: BaseException, *, kind: str, rank: int, seq: int | None, frame: str | None, where: Callable[[], str]
) -> CollectiveError:
    """The error a byte exchange raises after ``error``; this rank is poisoned either way.

    Our own errors take the exchange's context.
    """
    if isinstance(error, CollectiveError):
        error.kind, error.rank, error.seq, error.frame = kind, rank, seq, frame
        if isinstance(error, WireFormatError):
            error.args = (f"{where()}: {error.args[0]}",)
        if isinstance(error, (WireFormatError, CollectiveDesyncError)):
            health.poison(error)
            return error
        err = fail(error, seq=seq)
    else:
        translated = translate_failure(error, kind=kind, describe=where, rank=rank, seq=seq, frame=frame)
        translated.__cause__ = error
        err = fail(translated, seq=seq)
    health.poison(err)
    return err


def fail(error: CollectiveError, *, seq: int | None) -> CollectiveError:
    """Publish, diagnose; returns the error to raise (maybe re-typed to name the culprits).

    Gloo's own ``abort`` does nothing, so a blocked gloo operation cannot be
    ended from here: publishing is what makes a peer waiting in one of our
    collectives stop.
    """
    side = groups.side
    channel = groups.built_guard_channel()
    if channel is not None and side is not None:
        channel.publish_failure(side.rank)  # same-host peers stop waiting within microseconds
    if side is not None:
        try:
            side.report_failure(error.kind or "?", seq, str(error), ranks=error.ranks)
        except Exception as e:  # noqa: BLE001 - StoreUnresponsive or a store error
            log.warning(
                "rank %d could not report its failure on the c10d store (%s); peers on "
                "other hosts learn of it only when they time out",
                side.rank,
                e,
            )
    diagnosis = diagnose_with_deadline(side, deadline_s=2.5 * config.settings.heartbeat_s + 2.0)
    explained = explain(error, diagnosis)
    if side is not None and explained is not error:
        try:  # peers that read the report from now on name the ranks the diagnosis found
            side.report_failure(explained.kind or "?", seq, str(explained), ranks=explained.ranks, update=True)
        except Exception as e:  # noqa: BLE001 - the first report stands
            log.debug("rank %d could not update its failure report: %s", side.rank, e)
    return explained


def explain(error: CollectiveError, diagnosis: Diagnosis | None) -> CollectiveError:
    """``error`` re-typed and extended by what the diagnosis found (absent ranks, a desync)."""
    if diagnosis is None:
        return error
    base = str(error)
    details = diagnosis.render()
    common = dict(kind=error.kind, rank=error.rank, seq=error.seq, frame=error.frame)
    if diagnosis.absent:
        new = type(error)(f"{base}\nRanks not in this collective:\n{details}", ranks=tuple(diagnosis.absent), **common)
    elif diagnosis.alive_elsewhere:
        new = CollectiveDesyncError(
            f"{base}\nRank(s) {diagnosis.alive_elsewhere} are alive but did not enter this "
            f"collective: the ranks are out of step (desync).\n{details}",
            ranks=tuple(diagnosis.alive_elsewhere),
            **common,
        )
    else:
        return error
    new.__cause__ = error.__cause__
    return new
