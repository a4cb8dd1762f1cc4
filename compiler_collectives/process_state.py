"""This module holds the list of the process's global state: what each moment clears.

Every module-level mutable of the layers below the Dynamo seam (agreements,
transport, health, store, instrument) is declared here, by the module that owns it,
with a decorator on the function that clears or sets it:

* ``@clears(*moments, names=..., what=...)``: the function is that module's
  reset of ``names`` and runs at each of ``moments``;
* ``@wired(names=..., what=...)``: a setter that install (``dynamo/wiring.py``)
  fills; kept across every moment, so nothing wires again;
* ``@kept(names=..., why=...)``: held for the process's life (bounded caches,
  a thread's context of a call in progress, once-only registrations).

The moments, and who calls ``run``:

* ``RESET``: ``compiler_collectives.reset()`` on every rank together;
* ``TORCH_RESET``: ``torch.compiler.reset()`` (Dynamo's caches went);
* ``GROUP_ENDING``: ``destroy_process_group()`` of the default group is about
  to run (the c10d seam): let go of its store, and nothing else. Threads are
  signalled, not joined, and references dropped, so that torch's own teardown
  drops the store's last reference and its server closes its port then, not
  after our clears: a peer that re-initializes on the same port meanwhile
  must not meet the old store. ``GROUP_DESTROYED`` follows once torch's
  destroy returned;
* ``GROUP_DESTROYED``: the default group ended: ``destroy_process_group()``
  (the c10d seam), or a new default group found where the old one's destroy
  was not seen (``transport.groups``' ``notice()``, the one place that
  notices a new default group);
* ``FORK``: in a forked child (a DataLoader worker), before it runs anything;
* ``STATS``: ``compiler_collectives.reset_stats()``.

``describe()`` lists every declared item with what clears it.
``tests/test_process_state.py`` fails on a module-level mutable that is
declared nowhere. Declaring is the one thing a module does here when imported:
appending to a list that has no behaviour of its own (no layer is connected to
another by it; the setters and registries of ``dynamo/wiring.py`` do that).

A *generation* is the life of our groups under one default group. Its number
(``generation()``) names our keys on the c10d store. A new one starts in one
place, ``run()`` of a ``RESET`` or ``GROUP_DESTROYED`` moment, and what a
generation holds is cleared by the same run: nothing of ours keeps the
default group's identity to compare. A forked child keeps its parent's
number: it is no rank, and a group it makes is its own.

This module imports nothing of the package, so every layer may declare here.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])


class Moment(enum.Enum):
    RESET = "compiler_collectives.reset()"
    TORCH_RESET = "torch.compiler.reset()"
    GROUP_ENDING = "the start of destroy_process_group() of the default group (its store is let go)"
    GROUP_DESTROYED = "the end of the default group (destroy_process_group(), or a new one noticed)"
    FORK = "a forked child"
    STATS = "compiler_collectives.reset_stats()"


RESET = Moment.RESET
TORCH_RESET = Moment.TORCH_RESET
GROUP_ENDING = Moment.GROUP_ENDING
GROUP_DESTROYED = Moment.GROUP_DESTROYED
FORK = Moment.FORK
STATS = Moment.STATS
# The three moments that end a generation's state (a fork ends it for the child only).
EVERY_GENERATION = (RESET, GROUP_DESTROYED, FORK)
# The moments that start a new generation number (see the docstring).
_NEW_GENERATION = (RESET, GROUP_DESTROYED)


@dataclasses.dataclass(frozen=True)
class Item:
    """One declaration: ``names`` of module ``owner``, and what clears them."""

    owner: str
    names: tuple[str, ...]
    what: str
    kind: str  # "cleared", "wired" or "kept"
    moments: tuple[Moment, ...] = ()
    clear: Callable[[], object] | None = None
    first: bool = False

    def render(self, *, when: bool = True) -> str:
        line = f"{self.owner}: {', '.join(self.names)}: {self.what}"
        if not when:
            return line
        if self.kind == "cleared":
            cleared = "cleared at " + ", ".join(m.value for m in self.moments)
        elif self.kind == "wired":
            cleared = "wired by install, kept across every moment"
        else:
            cleared = "kept for the process's life"
        return f"{line} ({cleared})"


_items: list[Item] = []
_generation = 0


def clears(*moments: Moment, names: tuple[str, ...], what: str, first: bool = False) -> Callable[[F], F]:
    """Declare the decorated function the reset of its module's ``names`` at ``moments``.

    ``first``: it runs before the others of its moment (it stops threads that
    could otherwise write the others' state after they were cleared).
    """

    def declare(fn: F) -> F:
        _items.append(Item(fn.__module__, names, what, "cleared", moments, fn, first))
        return fn

    return declare


def wired(*, names: tuple[str, ...], what: str) -> Callable[[F], F]:
    """Declare the decorated setter install's wiring calls; ``names`` are what it sets."""

    def declare(fn: F) -> F:
        _items.append(Item(fn.__module__, names, what, "wired"))
        return fn

    return declare


def kept(*, names: tuple[str, ...], why: str) -> Callable[[F], F]:
    """Declare ``names``, which the decorated function fills, held for the process's life."""

    def declare(fn: F) -> F:
        _items.append(Item(fn.__module__, names, why, "kept"))
        return fn

    return declare


def items() -> list[Item]:
    """Every declaration, in the order a moment runs them."""
    return sorted(_items, key=lambda item: not item.first)  # stable: declaration order otherwise


def declared(owner: str) -> set[str]:
    """The module-level names ``owner`` declared, whatever their kind."""
    return {name for item in _items if item.owner == owner for name in item.names}


def run(moment: Moment) -> None:
    """Clear what ``moment`` clears, in ``items()``'s order; a new generation where it starts one."""
    global _generation
    # No lock: a moment runs on the thread that calls it while no collective is in
    # flight (every rank resets together), and clears take their own modules' locks.
    if moment in _NEW_GENERATION:
        _generation += 1
    for item in items():
        if moment in item.moments and item.clear is not None:
            item.clear()


def generation() -> int:
    """The number of the current generation (our keys on the c10d store carry it)."""
    return _generation


def describe() -> str:
    """Every declared item, one line each, grouped by what clears it."""
    lines = []
    for moment in Moment:
        lines.append(f"{moment.value} clears:")
        lines += [f"  {i.render(when=False)}" for i in items() if moment in i.moments]
    lines.append("wired by install (kept across every moment):")
    lines += [f"  {i.render(when=False)}" for i in items() if i.kind == "wired"]
    lines.append("kept for the process's life:")
    lines += [f"  {i.render(when=False)}" for i in items() if i.kind == "kept"]
    return "\n".join(lines)
