"""Whether our collectives are still usable on this rank, and errors waiting to surface.

After any collective fails, the groups may be half-broken and the ranks out of
step, so every later collective raises ``CollectivePoisonedError`` chained to
the first failure until ``compiler_collectives.reset()`` is called on every rank.

The guard hook runs inside Dynamo's C++ frame evaluation, where an exception
would abort the process; it parks its error here instead and forces a
recompile, and the compile entry point raises the parked error from the
user's own call site. A ``KeyboardInterrupt`` is parked as itself: it reaches
the user as a ``KeyboardInterrupt``, and only this rank is poisoned (nothing
is reported to the other ranks).
"""

from __future__ import annotations

import logging

from ..errors import CollectiveError, CollectivePoisonedError

log = logging.getLogger("compiler_collectives.health")

# The first failure on this rank, None while healthy. Public for one reason:
# the guard hook reads it on every call, where a function call costs.
first_failure: CollectiveError | None = None
_pending: BaseException | None = None


def poison(error: CollectiveError) -> None:
    global first_failure
    if first_failure is None:
        first_failure = error
        log.error("%s", error)


def poisoned() -> CollectiveError | None:
    return first_failure


def check(kind: str) -> None:
    """Raise if an earlier collective failed on this rank."""
    if first_failure is not None:
        raise CollectivePoisonedError(
            f"{kind} collective refused: an earlier collective failed on this rank "
            f"({type(first_failure).__name__}: {first_failure}). The ranks are no longer "
            "in step; call compiler_collectives.reset() on every rank (or restart the job).",
            kind=kind,
        ) from first_failure


def park(error: BaseException) -> None:
    """Keep an error raised where it could not propagate (the guard hook)."""
    global _pending
    if _pending is None:
        _pending = error


def raise_parked() -> None:
    global _pending
    error, _pending = _pending, None
    if error is not None:
        raise error


def clear() -> None:
    global first_failure, _pending
    first_failure = None
    _pending = None
