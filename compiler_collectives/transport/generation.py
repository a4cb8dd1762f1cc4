"""The current generation of our groups, and its lifecycle.

A *generation* is the life of our groups under one default group; the
runtime numbers it and builds each one (``Generation(number, ...)``), and
hands it to this layer (``facade.adopt``): ``current`` is this process's one.
``Generation`` holds what one generation built (the compile group, the guard
group and its channel, the store side channel with its heartbeat, the scope
they span: ``groups.py`` builds them into it) and ends it. An ended
generation is not reused: the runtime builds the next one.

``notice()`` is the one place that notices a new default group; every other
module calls it (the guard hook on every call: one attribute read and one
comparison), and keeps nothing of a generation that a moment does not clear.

Two changes of process model drop everything of a generation at once:

* ``default_group_destroyed``: the default group ended. Our groups, store and
  heartbeat go with it, so that a later ``init_process_group`` (on the same
  port, say) starts a new generation from nothing, as
  ``compiler_collectives.reset()`` would. The c10d seam runs that moment at
  ``destroy_process_group()``, once torch's destroy returned, and before it
  ``let_go`` (its own moment): every reference to the store goes and the
  heartbeat is told to stop, so that the store's server closes within
  torch's destroy; ``notice()`` runs the moment (``on_new_world``, which the
  runtime passes in) when it finds a default group other than the last one
  it saw (a destroy the seam did not see: code that held torch's own
  function).
* ``inherited_in_child``: a forked child (a DataLoader worker) inherits the
  parent's groups, segment mapping, store and heartbeat object, but none of
  its threads. The child is not a rank: it keeps those objects alive (so
  their destructors never run here, against the parent's sockets and
  segment) but never uses them, and its runtime builds a generation of its
  own on the inherited default group, where our collectives do not run
  (``available`` is False); compiled code in the child decides alone. A
  default group the child creates itself is its own.

At interpreter exit our heartbeat thread is stopped and our groups destroyed
(``shutdown``), so nothing of ours is left running while Python finalizes.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..store.board import SideChannel
from . import scope as scope_mod
from .channel import GuardChannel
from .probes import end_probes

log = logging.getLogger("compiler_collectives.transport")


# What a forked child inherited from its parent: kept alive, never used (see the docstring).
_inherited: list[Any] = []


class Generation:
    """What one generation built (``groups.py`` fills it), and the moments that end it.

    ``number`` names our keys on the c10d store; ``on_new_world`` is what
    ``notice()`` runs when it finds a new default group (the runtime's moment
    of a destroyed one); ``progress_sources`` is the heartbeat's, wired at
    install and shared from one generation to the next; ``inherited_world``:
    a forked child's, the parent's default group. ``lock`` guards building
    and dropping; ``groups.py`` builds under it.
    """

    def __init__(
        self,
        number: int = 0,
        *,
        on_new_world: Callable[[], None] | None = None,
        progress_sources: list[Callable[[], dict[str, Any]]] | None = None,
        inherited_world: object | None = None,
    ) -> None:
        self.number = number
        self._on_new_world = on_new_world
        self.lock = threading.Lock()
        # The default group ``notice()`` last saw, and the lock of its slow path (a new one).
        self._world: object | None = inherited_world
        self._noticing = threading.Lock()
        self.compile_pg: dist.ProcessGroup | None = None
        self.guard_pg: dist.ProcessGroup | None = None
        self.guard_channel: GuardChannel | None = None
        self.agreed = False  # the setup agreement of this generation passed
        self.scope: scope_mod.Scope | None = None  # the ranks our groups of this generation span
        # A forked child whose default group is still its parent's.
        self._on_inherited = inherited_world is not None
        self._told_child = False
        self.side: SideChannel | None = None
        # Joins of the threads of a side channel let go of (``let_go``), waited for by the moment.
        self._stopping: list[Callable[[float], bool]] = []
        # Callables returning this rank's progress for the heartbeat (``Groups.add_progress_source``).
        self.progress_sources: list[Callable[[], dict[str, Any]]] = (
            progress_sources if progress_sources is not None else []
        )

    def notice(self) -> None:
        """Notice a new default group: the one place that does (see the module docstring).

        A default group other than the last one seen, where there was one, is a
        destroy the c10d seam did not see: its moment (``GROUP_DESTROYED``) runs
        now, as the destroy would have run it, and starts a new generation, so
        store keys never meet the old ones. The guard hook calls this on every
        call: one attribute read and one comparison unless the group changed.
        """
        world = dist.group.WORLD
        if world is not self._world:
            self._new_world(world)

    def _new_world(self, world: object | None) -> None:
        with self._noticing:
            previous = self._world
            if world is previous:
                return  # another thread noticed it first
            if previous is not None:
                log.info(
                    "a new default process group replaced the one our groups were made under "
                    "(its destroy_process_group was not seen): a new generation starts"
                )
                # Outside ``self.lock``: this moment's clear of our groups takes it. The runtime
                # builds the next generation, which notices ``world`` itself.
                self._world = world
                if self._on_new_world is not None:
                    self._on_new_world()
                return
            self._world = world

    @staticmethod
    def ends_the_default_group(group: object | None) -> bool:
        """Whether ``destroy_process_group(group)`` destroys the default group (None names it)
        while there is one; a subgroup's destroy is not."""
        return dist.is_initialized() and (group is None or group is dist.group.WORLD)

    def is_current(self) -> bool:
        """Whether this is still the current generation, for another thread (the heartbeat):
        it reads, and runs no moment; the rank's own next call of ``notice()`` does that."""
        return current is self and dist.group.WORLD is self._world

    def _drop(self) -> None:
        if self.side is not None:
            self.side.stop()
        self.side = None
        self.compile_pg = None
        self.guard_pg = None
        self.guard_channel = None
        self.agreed = False
        self.scope = None

    def available(self) -> bool:
        """Whether our collectives run in this process: a default group exists and is its own."""
        if not (dist.is_available() and dist.is_initialized()):
            return False
        self.notice()  # a group the child made itself ends the inherited one (its moment runs)
        if self._on_inherited:
            if not self._told_child:
                self._told_child = True
                log.info(
                    "compiled code runs in process %d, forked from a rank: compiler and guard "
                    "collectives do not run here (a forked child is not a rank of the job)",
                    os.getpid(),
                )
            return False
        return True

    def inherited_in_child(self) -> object | None:
        """In a forked child: keep the parent's generation alive without touching any of it, and
        return the default group the child inherited (its runtime's new generation sees it as
        seen, so one the child makes itself is noticed as new)."""
        _inherited.append((self._world, self.compile_pg, self.guard_pg, self.guard_channel, self.side))
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def let_go(self) -> None:
        """``destroy_process_group()`` of the default group is about to run: let go of its store.

        Every reference of ours to it goes (our groups, the guard channel, the
        side channel and its store) and our threads are told to stop, not
        waited for: they wake at once and let go as they end. Torch's own
        teardown then drops the store's last reference, and the store's
        server closes its port there, within torch's time: a peer that
        re-initializes on the same port never meets the old store while our
        moment runs. Nothing here waits or collects: none of these objects
        sits in a reference cycle (a cycle would keep the store until a
        garbage collection, hundreds of milliseconds later).
        """
        with self.lock:
            side, self.side = self.side, None
            self._drop()
            self._world = None
            if side is not None:
                self._stopping.append(side.stopping())

    def default_group_destroyed(self) -> None:
        """``destroy_process_group()`` ended the default group: drop this generation now
        (the moment's run starts the next generation's number).

        After ``let_go`` (the c10d seam) there is nothing left to drop but the
        wait for our threads, which have ended already unless a store call held
        one. Without it (``notice()`` found a new default group) what is left
        holding the old store goes now, not at the next collective.
        """
        with self.lock:
            side, self.side = self.side, None
            self._drop()
            self._world = None
            self._on_inherited = False
            joins, self._stopping = self._stopping, []
        if side is not None:
            joins.append(side.stopping())
        if not all([join(2.0) for join in joins]):
            log.debug("the heartbeat thread did not end within 2s of destroy_process_group")

    def forget(self) -> None:
        """Drop our groups; the next collective creates new ones (all ranks must do this together;
        ``reset()``'s run of the moment starts the next generation's number)."""
        with self.lock:
            self._drop()
            self._world = None

    def progress(self) -> dict[str, Any]:
        """This rank's progress for the heartbeat: every source's, merged."""
        out: dict[str, Any] = {}
        for source in self.progress_sources:
            out.update(source())
        return out

    def existing(self) -> dict[str, dist.ProcessGroup]:
        """The groups created so far (for doctor/diagnostics)."""
        out = {}
        if self.compile_pg is not None:
            out["compile"] = self.compile_pg
        if self.guard_pg is not None:
            out["guard"] = self.guard_pg
        leaders = getattr(self.guard_channel, "leaders_pg", None)
        if leaders is not None:
            out["guard_leaders"] = leaders
        return out

    def shutdown(self, join_s: float = 2.0) -> None:
        """Interpreter exit: stop the heartbeat thread (joined) and destroy our groups."""
        side = self.side
        if side is not None and not side.stop(join_s):
            log.debug("the heartbeat thread did not end within %.1fs (a store call hangs)", join_s)
        if not end_probes(join_s):
            log.debug("a connection probe's thread did not end within %.1fs", join_s)
        if dist.is_available() and dist.is_initialized() and self.scope is None:
            # (A scope's groups are not registered with torch: dropping them below ends them.)
            for name, pg in self.existing().items():
                try:
                    dist.destroy_process_group(pg)
                except Exception as e:  # noqa: BLE001 - already destroyed with the default group
                    log.debug("destroying our %s group at exit: %s", name, e)
        self._drop()


_exit_registered = False


def register_exit() -> None:
    """Shut the current generation down at interpreter exit (once per process; ``groups.py``
    calls it when it starts a side channel, whose heartbeat thread must end first)."""
    global _exit_registered
    if not _exit_registered:
        atexit.register(_at_exit)
        _exit_registered = True


def _at_exit() -> None:
    try:
        current.shutdown()
    except Exception as e:  # noqa: BLE001 - never fail an exit
        log.debug("shutdown at exit: %s", e)


def adopt(generation: Generation) -> None:
    """Make ``generation`` (the runtime built it) the current one (``facade.adopt`` calls it)."""
    global current
    current = generation


current = Generation()
