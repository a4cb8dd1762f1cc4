"""The latch: this rank's first failure, and the error waiting to leave our code.

After any collective fails, the groups may be half-broken and the ranks out of
step, so every later collective raises ``CollectivePoisonedError`` chained to
the first failure until ``compiler_collectives.reset()`` is called on every
rank. The first failure is per process (``first_failure``: the guard hook
reads it on every call, as a plain attribute).

The guard hook runs inside Dynamo's C++ frame evaluation, where an exception
would abort the process: it parks its error here instead and forces a
recompile, and the compile entry point raises the parked error from the
user's own call site (``raise_parked``). Parked errors are per thread: the
compile that follows the hook on the same thread raises it, and no other
thread ever sees it (a helper thread's refused call must not surface in the
thread that owns the rank's collectives). A ``KeyboardInterrupt`` is parked
as itself.

A rank can also be poisoned by a peer: the heartbeat thread hears of another
rank's failure through the store (``poison_from_peer``), or a collective of
this rank stopped on a peer's report (an error with ``reported_by``). Refusing
then says which rank failed and why, as a ``PeerFailureError``. The first
refusal of a report heard through the store asks ``explainer`` (wired at
install) to name the failed rank where the report itself names nobody.

Everything is held on the instance: whoever owns a ``Latch`` owns this state.
A latch lives as long as its generation: the runtime builds the next
generation's (a healthy latch, no thread's error parked, that takes over the
explainer) and binds it (``health.adopt``). Nothing empties a latch in place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..errors import CollectiveError, CollectivePoisonedError, PeerFailureError

log = logging.getLogger("compiler_collectives.health")


class Latch:
    """The first failure on this rank, and each thread's error waiting to leave our code."""

    __slots__ = ("_explained", "_from_peer", "_parked", "explainer", "first_failure")

    def __init__(self, explainer: Callable[[PeerFailureError], PeerFailureError] | None = None) -> None:
        # None while healthy. Public for one reason: the guard hook reads it on every call.
        self.first_failure: CollectiveError | None = None
        # Whether first_failure is a peer's report (and whether it was explained yet).
        self._from_peer = False
        self._explained = False
        # Errors parked per thread (``error``): each is raised by its own thread's next compile.
        self._parked = threading.local()
        # peer's PeerFailureError -> the same, naming the failed rank(s) (a diagnosis). Set once,
        # at install (``failure.connect``); each new generation's latch takes it over.
        self.explainer = explainer

    def poison(self, error: CollectiveError) -> None:
        """This rank's first failure (a later one is only logged where it is raised)."""
        if self.first_failure is None:
            self.first_failure = error
            # Learned from a peer's report: refusals name that peer. The failure procedure
            # that produced it has diagnosed already: nothing left to explain.
            self._from_peer = isinstance(error, PeerFailureError) and bool(error.reported_by)
            self._explained = True
            log.error("%s", error)

    def poison_from_peer(self, error: PeerFailureError) -> None:
        """A peer's failure, heard through the store: refusals name that peer (see ``check``)."""
        if self.first_failure is None:
            self.first_failure = error
            self._from_peer = True
            self._explained = False
            log.error("%s", error)

    def check(self, kind: str) -> None:
        """Raise if an earlier collective failed on this rank, or a peer reported a failure."""
        first = self.first_failure
        if first is None:
            return
        if self._from_peer and isinstance(first, PeerFailureError) and first.rank not in first.ranks:
            if not self._explained and self.explainer is not None:
                self._explained = True
                try:
                    first = self.first_failure = self.explainer(first)
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
        raise CollectivePoisonedError(
            f"{kind} collective refused: an earlier collective failed on this rank "
            f"({type(first).__name__}: {first}). The ranks are no longer "
            "in step; call compiler_collectives.reset() on every rank (or restart the job).",
            kind=kind,
        ) from first

    def park(self, error: BaseException) -> None:
        """Keep an error raised where it could not propagate (the guard hook), for this thread only."""
        if getattr(self._parked, "error", None) is None:
            self._parked.error = error

    def raise_parked(self) -> None:
        """Raise the error this thread parked, if any (the compile entry point calls it)."""
        parked = self._parked
        error = getattr(parked, "error", None)
        if error is not None:
            parked.error = None
            raise error
