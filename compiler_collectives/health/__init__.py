"""Whether our collectives are still usable on this rank, and errors waiting to surface.

After any collective fails, the groups may be half-broken and the ranks out of
step, so every later collective raises ``CollectivePoisonedError`` chained to
the first failure until ``compiler_collectives.reset()`` is called on every rank.

The guard hook runs inside Dynamo's C++ frame evaluation, where an exception
would abort the process; it parks its error here instead and forces a
recompile, and the compile entry point raises the parked error from the
user's own call site. Parked errors are per thread: the compile that follows
the hook on the same thread raises it, and no other thread ever sees it (a
helper thread's refused call must not surface in the thread that owns the
rank's collectives). ``clear()`` drops every thread's. A ``KeyboardInterrupt``
is parked as itself: it reaches the user as a ``KeyboardInterrupt``, and only
this rank is poisoned (nothing is reported to the other ranks).

A rank can also be poisoned by a peer: the heartbeat thread hears of another
rank's failure through the store (``poison_from_peer``), or a collective of
this rank stopped on a peer's report (an error with ``reported_by``, from the
shared-memory failure word, say). Refusing then says which rank failed and
why, as a ``PeerFailureError``, not "an earlier collective failed on this
rank": this rank's own collectives did nothing wrong. The first refusal of a
report heard through the store asks ``explainer`` (the agreements' failure
procedure's diagnosis, ``set_explainer``, wired at install) to name the failed
rank where the report itself names nobody. ``clear()`` keeps it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .. import process_state
from ..errors import CollectiveError, CollectivePoisonedError, PeerFailureError

log = logging.getLogger("compiler_collectives.health")

# The first failure on this rank, None while healthy. Public for one reason:
# the guard hook reads it on every call, where a function call costs.
first_failure: CollectiveError | None = None
# Errors the guard hook parked, per thread (``error``): each is raised by its own
# thread's next compile. Replaced, not emptied, by clear(): that drops every thread's.
_parked = threading.local()
# Whether first_failure is a peer's report (and whether it was explained yet).
_from_peer = False
_explained = False
# peer's PeerFailureError -> the same, naming the failed rank(s) (a diagnosis); ``set_explainer``.
explainer: Callable[[PeerFailureError], PeerFailureError] | None = None


@process_state.wired(names=("explainer",), what="how a refusal after a peer's report names the failed rank")
def set_explainer(explain: Callable[[PeerFailureError], PeerFailureError] | None) -> None:
    """How the first refusal after a peer's report names the failed rank(s) (wired at install)."""
    global explainer
    explainer = explain


def poison(error: CollectiveError) -> None:
    global first_failure, _from_peer, _explained
    if first_failure is None:
        first_failure = error
        # Learned from a peer's report: refusals name that peer. The failure procedure
        # that produced it has diagnosed already: nothing left to explain.
        _from_peer = isinstance(error, PeerFailureError) and bool(error.reported_by)
        _explained = True
        log.error("%s", error)


def poison_from_peer(error: PeerFailureError) -> None:
    """A peer's failure, heard through the store: refusals name that peer (see ``check``)."""
    global first_failure, _from_peer, _explained
    if first_failure is None:
        first_failure = error
        _from_peer = True
        _explained = False
        log.error("%s", error)


def poisoned() -> CollectiveError | None:
    return first_failure


def check(kind: str) -> None:
    """Raise if an earlier collective failed on this rank, or a peer reported a failure."""
    global first_failure, _explained
    first = first_failure
    if first is None:
        return
    if _from_peer and isinstance(first, PeerFailureError) and first.rank not in first.ranks:
        if not _explained and explainer is not None:
            _explained = True
            try:
                first = first_failure = explainer(first)
            except Exception as e:  # noqa: BLE001 - the report as heard still names its sender
                log.debug("explaining a peer's failure report: %s", e)
        raise PeerFailureError(
            f"{kind} collective refused on this rank: {first} Every rank's later collectives "
            "refuse; call compiler_collectives.reset() on every rank (or restart the job).",
            kind=kind,
            rank=first.rank,
            ranks=first.ranks,
            reported_by=first.reported_by,
            left=first.left,
        ) from first
    if first_failure is not None:
        raise CollectivePoisonedError(
            f"{kind} collective refused: an earlier collective failed on this rank "
            f"({type(first_failure).__name__}: {first_failure}). The ranks are no longer "
            "in step; call compiler_collectives.reset() on every rank (or restart the job).",
            kind=kind,
        ) from first_failure


def park(error: BaseException) -> None:
    """Keep an error raised where it could not propagate (the guard hook), for this thread only."""
    if getattr(_parked, "error", None) is None:
        _parked.error = error


def raise_parked() -> None:
    """Raise the error this thread parked, if any (the compile entry point calls it)."""
    error = getattr(_parked, "error", None)
    if error is not None:
        _parked.error = None
        raise error


@process_state.clears(
    *process_state.EVERY_GENERATION,
    names=("first_failure", "_parked", "_from_peer", "_explained"),
    what="the first failure on this rank and every thread's parked error",
)
def clear() -> None:
    global first_failure, _parked, _from_peer, _explained
    first_failure = None
    _parked = threading.local()  # every thread's parked error, not only the caller's
    _from_peer = _explained = False
