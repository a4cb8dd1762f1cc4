"""Whether our collectives are still usable on this rank, and errors waiting to surface.

This rank's ``latch`` (``health/latch.py``) holds the first failure on this
rank (or a peer's report of one), after which every later collective refuses
until ``compiler_collectives.reset()``, and the error the guard hook parked
for its thread's next compile to raise. The functions below are the latch's
public face for the layers above; the guard hook reads
``latch.first_failure`` directly, a plain attribute read on its fast path.

There is one latch per process; the generation moments clear it (``clear``),
wiring sets its explainer (``set_explainer``), which ``clear()`` keeps.
"""

from __future__ import annotations

from collections.abc import Callable

from .. import process_state
from ..errors import CollectiveError, PeerFailureError
from .latch import Latch

# The one latch of this process: its first failure and each thread's parked error.
latch = Latch()


@process_state.wired(names=("latch",), what="how a refusal after a peer's report names the failed rank")
def set_explainer(explain: Callable[[PeerFailureError], PeerFailureError] | None) -> None:
    """How the first refusal after a peer's report names the failed rank(s) (wired at install)."""
    latch.explainer = explain


def poison(error: CollectiveError) -> None:
    """This rank's first failure: every later collective refuses (``check``)."""
    latch.poison(error)


def poison_from_peer(error: PeerFailureError) -> None:
    """A peer's failure, heard through the store: refusals name that peer (see ``check``)."""
    latch.poison_from_peer(error)


def poisoned() -> CollectiveError | None:
    return latch.first_failure


def check(kind: str) -> None:
    """Raise if an earlier collective failed on this rank, or a peer reported a failure."""
    latch.check(kind)


def park(error: BaseException) -> None:
    """Keep an error raised where it could not propagate (the guard hook), for this thread only."""
    latch.park(error)


@process_state.clears(
    *process_state.EVERY_GENERATION,
    names=("latch",),
    what="the first failure on this rank and every thread's parked error",
)
def clear() -> None:
    latch.clear()
