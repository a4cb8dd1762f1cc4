"""Ranks taking different graph-break paths through one call: when each goes on alone.

After guard collective #p every rank entered a cache entry of the same frame,
each as its own guards chose; the entries may differ in where they break the
graph, so the ranks' next guard calls come from different compiled frames.
``paths_diverged`` tells that apart from a real desync, from the slow path's
all-gather alone (the same answer on every rank); ``go_apart`` then lets each
rank go on alone (``apart()``: no collective runs) until it calls compiled
code from its own code again (``apart_call``, ``at_compile``), where every
rank meets. The guard hook and entry agreement (``agreements/entry.py``)
both decide this way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..ledger import ledger
from ..records import PathsDiverged
from . import guard_state
from .guard_frames import in_compiled_code

log = logging.getLogger("compiler_collectives.guard")

# Flags on the slow path's (seq, site) all-gather. A guard call made from inside
# compiled code (a resume function after a graph break) sends its site with
# NESTED; an entry check (agreements/entry.py) sends (-seq, entry index), with
# EMPTY when its entry runs no collective.
NESTED = 1 << 46  # above the 46-bit frame id, which the channels' keys use alone
EMPTY = 1 << 40  # above any entry index


def apart() -> bool:
    """Whether this rank is on its own path through a call (``paths_diverged``): no collective runs."""
    return guard_state.state.apart


def paths_diverged(everyone: Sequence[tuple[int, int]]) -> bool:
    """Whether a mismatch is the ranks taking different graph-break paths through one call of a frame.

    After guard collective #p every rank entered a cache entry of the same
    frame, each as its own guards chose. An entry whose code calls a resume
    function (a graph break) has its rank's next guard call come from inside
    compiled code, at #p+1 (NESTED); a rank in an entry whose programs differ
    checks the entry at -p. When no rank is at a call of its own code, and every
    checking rank's entry runs no collective, the ranks merely run different
    compiled frames inside one call that communicates nothing: a job without
    this service runs it correctly, so each rank goes on alone
    (``go_apart``) until it calls compiled code from its own code again,
    where all ranks meet. Decided from the all-gather alone: the same on every
    rank.
    """
    checks = [f for s, f in everyone if s < 0]
    nested = [s for s, f in everyone if s > 0 and f & NESTED]
    if not nested or len(checks) + len(nested) != len(everyone):
        return False
    parents = {-s for s, _ in everyone if s < 0} | {s - 1 for s in nested}
    return len(parents) == 1 and all(f & EMPTY for f in checks)


def go_apart(parent_seq: int) -> None:
    """Every rank agreed that their paths through this call differ: go on alone (``paths_diverged``)."""
    guard_state.state.seq = parent_seq  # where every rank stands: the next call of the user's own code is #p+1
    guard_state.state.apart = True
    ledger.add(PathsDiverged(parent_seq))
    log.debug(
        "after guard collective #%d the ranks run different compiled frames of one call; "
        "each goes on alone until its next call from its own code",
        parent_seq,
    )


def apart_call(caller: Any) -> bool:
    """While apart: True for a call from inside compiled code (decided alone); else the ranks meet here again."""
    if in_compiled_code(caller):
        return True
    guard_state.state.apart = False
    return False


def at_compile(caller: Any) -> None:
    """A frame compile starts: one called from the user's own code ends going apart (all ranks meet there)."""
    if guard_state.state.apart:
        apart_call(caller)
