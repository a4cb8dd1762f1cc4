"""This generation's agreement state: one object, replaced whole when a new generation starts.

What the agreements keep from one exchange to the next within a generation (the life of our
groups under one default group, which the runtime numbers) lives in one ``Generation``, not in module
globals of each agreement:

* the compiler collective's sequence number and the frame of its latest exchange (``compiler``);
* the program audit's sequence number (``audit_verdict``);
* compile once's graph number, what its last full key exchange saw, and the compile group's
  ranks by host (``once.driver``, ``once.exchanges``).

Every moment that ends a generation (``reset()``, a destroyed default group, a fork) has the
runtime build a fresh instance and bind it here (``adopt``); nothing is zeroed in place, so an
instance a caller still holds keeps the numbers of the generation it belonged to, and the new
generation's first exchanges start from 1 again on every rank together. Callers ask
``current()`` at the moment they need it, after anything that could notice a new default group (``groups.compile_pg()``,
``groups.member_ranks``), never at import. The guard collective's state is its own
(``guard_state``): its hook reads it on every compiled call.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..transport import HostTree
    from .once.keys import Known


@dataclasses.dataclass
class Generation:
    """The agreements' state of one generation; a new generation gets a new instance."""

    # The compiler collective's latest sequence number (0: none yet) and the frame it exchanged.
    compiler_seq: int = 0
    compiler_frame: str | None = None
    # The program audit's latest sequence number.
    audit_seq: int = 0
    # Compile once's latest graph number.
    once_seq: int = 0
    # What compile once's last full key exchange saw that stays from graph to graph.
    once_known: Known | None = None
    # The compile group's ranks by host, built at the generation's first compile once graph.
    once_tree: HostTree | None = None


_current = Generation()


def current() -> Generation:
    """The current generation's agreement state (read it when needed; do not keep it across moments)."""
    return _current


def adopt(new: Generation) -> None:
    """A new generation (the runtime built it) starts from a fresh instance (its exchanges number
    from 1 again, and compile once learns its hosts and gathers every offer at its first graph,
    every rank together)."""
    global _current
    _current = new
