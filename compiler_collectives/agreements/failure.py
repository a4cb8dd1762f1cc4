"""What an agreement does when its exchange fails: the failure procedure.

Transport moves bytes and says what it saw (gloo's error, a timeout, a peer's
failure word). This module decides what that means for the job:

* ``fail``: the one failure procedure of a collective of ours (an agreement's
  byte exchange, the guard collective, an entry check). It translates what
  transport saw into our error, counts it, publishes it, diagnoses it and
  poisons this rank; it returns the error to raise. A bad payload or a desync
  is seen identically by every rank of the collective: not diagnosed (on the
  guard channel, where every rank takes part, not even published). Anything
  else (a timeout, a dead peer, gloo's ``RuntimeError``) is published, then
  diagnosed: same-host peers see the shared-memory failure word within
  microseconds; every other peer's heartbeat thread sees the store report
  within a heartbeat and poisons its rank. The diagnosis then names the ranks
  that are absent (crashed, killed, stopped) or alive elsewhere (a desync),
  and the error is re-typed to say so.
  ``fail`` is told when the failure is ours already: a cause this rank knows
  (``KNOWN``: compile once's timeout, a compiling rank that is gone, the store
  failing under a wait) is published without a diagnosis; a verdict every
  rank reached from the same exchanged data (``VERDICT``: a program
  divergence) is neither published nor diagnosed. Either is counted and
  poisons this rank. An agreement's own error about what it decided
  (``RAISED``: compile once's errors about a graph) is only counted. Three
  ends poison this rank and count nothing: making our groups failed
  (``SETUP``), a ``KeyboardInterrupt`` inside a collective (``INTERRUPTED``:
  nobody's failure, told to nobody), and the user's own signal handler
  raising while this rank waited (``LEFT``: the peers are told it left).
  No other module counts a failure or poisons the latch
  (``tests/unit/test_error_exit.py``).

**A report keeps its type.** When this rank's collective stopped on a peer's
report (the error's ``reported_by``: the failure word, the store report its
heartbeat thread heard), the error is that report, in its sender's words: a
``PeerFailureError`` naming the rank that failed (or left) and its cause; the
diagnosis then only adds ranks that are absent. Ranks that are alive but not
in the collective are never called a desync there: they most likely stopped
on hearing of the same report. For the same reason a desync diagnosis gives
way to a peer's original report (one that peer did not relay) that does not
name the ranks found elsewhere.

Either way this rank is poisoned (``health.latch``): its later collectives refuse
until ``compiler_collectives.reset()``.

**A peer's report.** Transport only hands over what it heard: the raw store
record of a peer's failure (or that it left). This module says what that is
for this rank:

* ``report_error``: the ``PeerFailureError`` a report becomes (the rank that
  failed or left, its cause, the ranks it names, ``reported_by``);
* ``peer_reported``: the heartbeat thread heard a report (registered with
  ``transport.set_peer_report_handler``): this rank is poisoned by it, so its
  next collective refuses and a wait in progress in one of ours stops;
* ``explain_report``: the first refusal of a report that names nobody asks
  for this rank's own short diagnosis of who is absent (``health.latch.explainer``).

``connect`` registers both with the layers below. Install runs it
(``dynamo/wiring.py``); it is idempotent, and ``reset()`` and a fork keep
both (each new generation's latch takes the explainer over).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .. import config, health
from ..errors import (
    CollectiveDesyncError,
    CollectiveError,
    PeerFailureError,
    SetupMismatchError,
    WireFormatError,
    describe,
)
from ..health.diagnosis import Diagnosis, diagnose_with_deadline
from ..ledger import ledger
from ..records import Failure
from ..transport import groups, is_connection_failure, set_peer_report_handler, translate_failure

log = logging.getLogger("compiler_collectives.failure")

REPORT_WAIT_S = 2.0
"""How long a rank that saw a peer's failure word waits for that peer's store report (its
words): the peer publishes the word first, the report a store round-trip later."""


# Failures every rank of the collective sees alike (a bad payload, ranks out of step): the
# diagnosis has nothing to add. Over an agreement's exchange (a host tree's pairs) only some ranks
# see them, so they are published; the guard channel's all-gather shows them to every rank.
SEEN_ALIKE = (WireFormatError, CollectiveDesyncError)
SEEN_ALIKE_ON_GUARD_CHANNEL = (CollectiveDesyncError, SetupMismatchError)


# What ``fail`` is told about a failure (its ``cause``).
SAW = "saw"
"""Transport saw it stop a collective (the default): translated, published and diagnosed."""
KNOWN = "known"
"""This rank knows the cause (compile once's wait gave up, a compiling rank is gone, the store
failed under a wait): our error as it is, published without a diagnosis, since a peer that is
busy compiling is not out of step."""
VERDICT = "verdict"
"""Every rank of the collective reached this same error from the same exchanged data (a program
divergence): our error as it is, neither published nor diagnosed (every peer raises it too)."""
RAISED = "raised"
"""An agreement raises this error of its own about what it decided (compile once's errors about
a graph: a loader quoting its source's compile error, a setup mismatch, a report already heard):
counted only. Whatever stopped a collective under it went through ``fail`` already, and a rank
that merely relays a peer's error is not the one that failed."""
SETUP = "setup"
"""Making our groups failed (the setup check, the rendezvous before a group, gloo's connection
set-up: ``transport.groups`` raises what stopped it; ``our_groups`` tells it here): this rank
poisoned only. Not counted: no collective of an agreement ran. Not published: each rank of a
rendezvous names the absent ranks at its own timeout, and the setup check reports its own
verdict (``scope.py``)."""
INTERRUPTED = "interrupted"
"""A ``KeyboardInterrupt`` (or another exit that is no error) left a collective of this rank
half-done: this rank poisoned only, since it is no longer in step. Nobody's failure (a Ctrl-C
usually reaches every rank of a job at once): not counted, told to nobody."""
LEFT = "left"
"""The user's own code (a signal handler) raised while this rank waited in a collective: this
rank poisoned, and the peers told that it left, in the words ``told`` (``groups.leave``), so
they stop waiting for it within about a heartbeat. Not a failure of ours: not counted, not
diagnosed."""
_OURS = (KNOWN, VERDICT, RAISED, SETUP, INTERRUPTED, LEFT)  # the causes that take our own error
_COUNTED = (SAW, KNOWN, VERDICT, RAISED)


def fail(
    error: BaseException,
    *,
    kind: str,
    rank: int | None = None,
    seq: int | None = None,
    frame: str | None = None,
    where: Callable[[], str] | None = None,
    pg: Any = None,
    guard_channel: bool = False,
    cause: str = SAW,
    told: str | None = None,
) -> CollectiveError:
    """The error to raise after ``error`` stopped a collective of ours: translated, counted
    (a ``Failure`` record of ``kind``), published (and diagnosed), this rank poisoned. The one
    place any of that happens.

    Our own errors take the collective's context (on the guard channel, only where they have
    none); anything else is translated (``translate_failure``), chained to ``error``. Where gloo
    says a connection broke, this rank's connections in ``pg`` (the collective's group) are
    looked at: the error names the peers whose connection broke, and the diagnosis takes that as
    evidence of their death. ``guard_channel``: the collective is the guard channel's all-gather
    (the guard collective, an entry check), where a mismatch is seen by every rank. ``where``
    names the collective in messages (by default ``describe(kind, rank, seq, frame)``).

    ``cause``: ``SAW`` (above), ``KNOWN``, ``VERDICT``, ``RAISED``, ``SETUP``, ``INTERRUPTED``
    or ``LEFT``; for all but ``SAW`` ``error`` is our own, in its words and context, and is
    returned as it is (the context arguments are unused). ``told``: for ``LEFT``, what the
    peers are told (else the error's words).
    """
    if cause != SAW:
        if not isinstance(error, CollectiveError) or cause not in _OURS:
            raise TypeError(f"fail(cause={cause!r}) takes a CollectiveError of ours, not {type(error).__name__}")
        if cause in _COUNTED:
            ledger.add(Failure(kind))
        if cause == RAISED:
            return error
        if cause == KNOWN:
            _publish(error, error.seq)
        health.latch.poison(error)
        if cause == LEFT:
            groups.leave(told if told is not None else str(error), error.seq, kind)
        return error
    named = where if where is not None else lambda: describe(kind, rank, seq, frame)
    broken: dict[int, str] = {}
    if isinstance(error, CollectiveError):
        err = error
        if not guard_channel:
            err.kind, err.rank, err.seq, err.frame = kind, rank, seq, frame
            if isinstance(err, WireFormatError):
                err.args = (f"{named()}: {err.args[0]}",)
        elif err.kind is None:  # raised by a transport wait that knows no context
            err.kind, err.rank, err.seq = kind, rank, seq
    else:
        broken = groups.broken_peers(pg) if pg is not None and is_connection_failure(error) else {}
        err = translate_failure(error, kind=kind, describe=named, rank=rank, seq=seq, frame=frame, broken=broken)
        err.__cause__ = error
    ledger.add(Failure(kind))
    if isinstance(err, SEEN_ALIKE_ON_GUARD_CHANNEL if guard_channel else SEEN_ALIKE):
        if not guard_channel:
            # Published, not diagnosed: over a host tree only this rank's peers in the exchange
            # see the mismatch, and the others would wait for the timeout (nobody is absent).
            _publish(err, seq)
    else:
        err = _published_and_diagnosed(err, seq=seq, broken=broken)
    health.latch.poison(err)
    return err


def _published_and_diagnosed(
    error: CollectiveError, *, seq: int | None, broken: dict[int, str] | None = None
) -> CollectiveError:
    """Publish, diagnose; returns the error to raise (maybe re-typed to name the culprits).

    Gloo's own ``abort`` does nothing, so a blocked gloo operation cannot be
    ended from here: publishing is what makes a peer waiting in one of our
    collectives stop. ``broken``: peers whose connection to this rank broke (global
    rank -> what showed it), gone for the diagnosis without waiting for their silence.
    """
    side = groups.side
    heard = error.reported_by[0] if error.reported_by else None  # the peer whose report stopped us
    channel = groups.built_guard_channel()
    if channel is not None and side is not None:
        channel.publish_failure(side.rank)  # same-host peers stop waiting within microseconds
    if side is not None:
        try:
            side.report_failure(error.kind or "?", seq, str(error), ranks=error.ranks, heard_from=heard)
        except Exception as e:  # noqa: BLE001 - StoreUnresponsive or a store error
            log.warning(
                "rank %d could not report its failure on the c10d store (%s); peers on "
                "other hosts learn of it only when they time out",
                side.rank,
                e,
            )
    deadline_s = 2.5 * config.settings.heartbeat_s + 2.0
    if heard is not None:
        reported = as_reported(error, heard, seq)
        # Only absent ranks are worth adding; a rank that left names itself already (and
        # waiting for a verdict costs heartbeats).
        left = getattr(reported, "left", False)
        diagnosis = (
            None if left else diagnose_with_deadline(side, deadline_s=deadline_s, until_absent=True, broken=broken)
        )
        explained = explain(reported, diagnosis)
    else:
        explained = explain(error, diagnose_with_deadline(side, deadline_s=deadline_s, broken=broken))
    if side is not None and explained is not error:
        try:  # peers that read the report from now on name the ranks the diagnosis found
            side.report_failure(
                explained.kind or "?", seq, str(explained), ranks=explained.ranks, update=True, heard_from=heard
            )
        except Exception as e:  # noqa: BLE001 - the first report stands
            log.debug("rank %d could not update its failure report: %s", side.rank, e)
    return explained


def _publish(error: CollectiveError, seq: int | None) -> None:
    """The failure word for same-host peers, the store report for every other (no diagnosis)."""
    side = groups.side
    channel = groups.built_guard_channel()
    if channel is not None and side is not None:
        channel.publish_failure(side.rank)
    if side is not None:
        try:
            side.report_failure(error.kind or "?", seq, str(error), ranks=error.ranks)
        except Exception as e:  # noqa: BLE001 - StoreUnresponsive or a store error
            log.warning("rank %d could not report its failure on the c10d store (%s)", side.rank, e)


def as_reported(error: CollectiveError, peer: int, seq: int | None = None) -> CollectiveError:
    """``error``, which stopped on rank ``peer``'s report, as that report says it (the rank
    that failed or left, and its cause); ``error`` itself if the report cannot be read."""
    heard = groups.read_peer_report(peer, error.rank, wait_s=REPORT_WAIT_S)
    if heard is None:
        return error
    report = report_error(error.rank, *heard)
    seq = error.seq if error.seq is not None else seq
    new = PeerFailureError(
        f"{describe(error.kind, error.rank, seq, error.frame)} stopped: {report}\n"
        f"This rank only stopped on that report; rank {report.reported_by[0]}'s log has the details. "
        "Every rank's later collectives refuse; call compiler_collectives.reset() on every rank (or "
        "restart the job).",
        kind=error.kind,
        rank=error.rank,
        seq=seq,
        frame=error.frame,
        ranks=report.ranks,
        reported_by=report.reported_by,
        left=report.left,
    )
    new.__cause__ = error.__cause__
    return new


def explain(error: CollectiveError, diagnosis: Diagnosis | None) -> CollectiveError:
    """``error`` re-typed and extended by what the diagnosis found (absent ranks, a desync).

    A peer's report is never re-typed as a desync (see the module docstring)."""
    if diagnosis is None:
        return error
    base = str(error)
    details = diagnosis.render()
    kind, rank, seq, frame, reported_by = error.kind, error.rank, error.seq, error.frame, error.reported_by
    alive = diagnosis.alive_elsewhere
    new: CollectiveError
    if diagnosis.absent:
        new = type(error)(
            f"{base}\nRanks not in this collective:\n{details}",
            kind=kind,
            rank=rank,
            seq=seq,
            frame=frame,
            ranks=tuple(diagnosis.absent),
            reported_by=reported_by,
        )
    elif alive and not error.reported_by:
        reported = _unrelated_report(error, diagnosis)
        if reported is not None:
            new = PeerFailureError(
                f"{base}\n{reported}\nRank(s) {alive} are alive but did not enter this collective: "
                f"most likely they stopped on hearing of rank {reported.reported_by[0]}'s report "
                f"(not a desync).\n{details}",
                kind=error.kind,
                rank=error.rank,
                seq=error.seq,
                frame=error.frame,
                ranks=reported.ranks,
                reported_by=reported.reported_by,
                left=reported.left,
            )
        else:
            new = CollectiveDesyncError(
                f"{base}\nRank(s) {alive} are alive but did not enter this "
                f"collective: the ranks are out of step (desync).\n{details}",
                kind=kind,
                rank=rank,
                seq=seq,
                frame=frame,
                ranks=tuple(alive),
                reported_by=reported_by,
            )
    else:
        return error
    new.__cause__ = error.__cause__
    return new


def _unrelated_report(error: CollectiveError, diagnosis: Diagnosis) -> PeerFailureError | None:
    """A peer's original report that names none of the ranks the diagnosis found alive elsewhere.

    Such ranks did not run other code: they stopped on that report. A report that names
    them (a peer timed out waiting for them too) confirms the desync instead."""
    alive = set(diagnosis.alive_elsewhere)
    for peer in diagnosis.original_reports():
        reported = report_error(error.rank, peer.rank, peer.report or {})
        if not alive & set(reported.ranks):
            return reported
    return None


# ---------------------------------------------------------------- a peer's report


def report_error(own_rank: int | None, peer: int, report: dict[str, Any]) -> PeerFailureError:
    """A peer's failure report (a ``SideChannel.report_failure`` record), as this rank raises it:
    which rank failed (or left), its cause, the ranks it names (``ranks``; the peer itself
    where it names none) and who reported it (``reported_by``)."""
    message = report.get("message")
    lines = message.splitlines() if isinstance(message, str) and message else ["no message"]
    if report.get("left") is True:
        err = PeerFailureError(
            f"rank {peer} left the job: {lines[0]}", rank=own_rank, ranks=(peer,), reported_by=(peer,), left=True
        )
    else:
        named = report.get("ranks")
        culprits = tuple(r for r in named if type(r) is int and 0 <= r < 1 << 20) if isinstance(named, list) else ()
        # The lines of the report that say what became of each rank it names: the cause.
        causes = [line for line in lines[1:] if any(line.strip().startswith(f"rank {r}:") for r in culprits)]
        naming = f" naming rank(s) {list(culprits)}" if culprits else ""
        err = PeerFailureError(
            f"rank {peer} reported a collective failure{naming}: {lines[0]}" + "".join(f"\n{line}" for line in causes),
            rank=own_rank,
            ranks=culprits or (peer,),
            reported_by=(peer,),
        )
    return err


def peer_reported(own_rank: int, peer: int, report: dict[str, Any]) -> None:
    """Heartbeat thread: a peer reported a failure (or that it left); refuse our next
    collective, and make a wait in progress in one of our collectives stop."""
    health.latch.poison_from_peer(report_error(own_rank, peer, report))


def explain_report(error: PeerFailureError) -> PeerFailureError:
    """A peer's report heard through the store, naming the absent rank(s) and what became of
    them where it does not say (the reporter sends before its own diagnosis; a broken
    connection names its peer, not its fate): this rank's own short diagnosis."""
    lines = str(error).splitlines()
    # A report named for a broken connection (``translate_failure``) says who, not what became
    # of them, until its sender's diagnosis updates it: this rank diagnoses unless it has.
    untold = "broke (gloo: " in lines[0] and not any(
        line.strip().startswith(f"rank {r}:") for line in lines[1:] for r in error.ranks
    )
    if error.left or (error.ranks and error.ranks != error.reported_by and not untold):
        return error  # the report names its culprit (a rank that left names itself)
    diagnosis = diagnose_with_deadline(
        groups.side, deadline_s=2.5 * config.settings.heartbeat_s + 1.0, until_absent=True
    )
    if diagnosis is None or not diagnosis.absent:
        return error
    absent = [p for p in diagnosis.peers if p.state == "absent"]
    return PeerFailureError(
        f"{error}\nRanks not in the job:\n" + "\n".join("  " + p.describe() for p in absent),
        kind=error.kind,
        rank=error.rank,
        seq=error.seq,
        frame=error.frame,
        ranks=tuple(p.rank for p in absent),
        reported_by=error.reported_by,
    )


def connect() -> None:
    """Register the failure policy with the layers below: the heartbeat's handler of a peer's
    report (transport) and the explainer of a refusal (health). Idempotent; the wiring
    (``dynamo/wiring.py``) calls it at install."""
    set_peer_report_handler(peer_reported)
    health.latch.explainer = explain_report  # each new generation's latch takes it over
