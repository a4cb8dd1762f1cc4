"""``groups``: the one object the agreements (and the seams, tools and tests) call for our groups.

It holds nothing of a generation's own: each call goes to the current
generation (``generation.current``, which the runtime builds and hands over
through ``adopt``: what it built, and ``notice()``, which ends it when a new
default group appears) or to the builders (``groups.py``: the compile
group, the guard channel, the side channel, ``scope()``'s setup check). What
the agreements do with peers over the side channel is here too: leave a
notice, read and wait for one, watch peers, read a peer's failure report, say
which connections broke. Under a scope, notices are the scope's own.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from ..health.liveness import COMPILE_WAIT, WaitPolicy
from ..health.watch import WaitWatch
from ..store.board import SideChannel
from ..store.mailbox import NoticeWait
from . import generation as generation_mod
from . import groups as build
from . import probes
from . import scope as scope_mod
from .channel import GuardChannel
from .generation import Generation
from .probes import broken_connection, broken_peers, connections_can_be_looked_at

log = logging.getLogger("compiler_collectives.transport")


class Groups:
    """Our gloo groups and their side channel, as the agreements see them (see the module docstring)."""

    def __init__(self, generation: Generation) -> None:
        # The heartbeat's progress sources, wired at install: every generation shares this list.
        self.progress_sources: list[Callable[[], dict[str, Any]]] = generation.progress_sources
        self.bind(generation)

    def bind(self, generation: Generation) -> None:
        """Call ``generation`` from now on (``adopt``)."""
        self._gen = generation
        # Bound once per generation: the guard hook calls ``notice()`` on every call (one
        # attribute read and one comparison), and ``available()`` where it decides whether it
        # has peers.
        self.notice: Callable[[], None] = generation.notice
        self.available: Callable[[], bool] = generation.available

    def _noticed(self) -> Generation:
        """The current generation, once ``notice()`` looked for a new default group (which
        ends this one: the runtime's moment then hands over the next)."""
        self.notice()
        return self._gen

    @property
    def number(self) -> int:
        """The current generation's number (our keys on the c10d store carry it)."""
        return self._gen.number

    ends_the_default_group = staticmethod(Generation.ends_the_default_group)

    @property
    def side(self) -> SideChannel | None:
        """The side channel of this generation, or None before one is built (never builds)."""
        return self._gen.side

    def add_progress_source(self, source: Callable[[], dict[str, Any]]) -> None:
        """What the heartbeat tells of this rank's progress, merged from every source (idempotent per function)."""
        if source not in self.progress_sources:
            self.progress_sources.append(source)

    def next_generation(self, number: int, on_new_world: Callable[[], None]) -> Generation:
        """A new generation numbered ``number``, sharing the heartbeat's progress sources, for
        the runtime to hand over (``adopt``); ``on_new_world``: its moment of a destroyed
        default group, which ``notice()`` runs when it finds a new one."""
        return Generation(number, on_new_world=on_new_world, progress_sources=self.progress_sources)

    def compile_pg(self) -> dist.ProcessGroup:
        return build.compile_pg(self._noticed())

    def guard_channel(self) -> GuardChannel:
        """The guard channel of this generation, built on every rank together at first use."""
        return build.guard_channel(self._noticed())

    def built_guard_channel(self) -> GuardChannel | None:
        """The guard channel if this generation built one already, else None (never builds)."""
        return self._gen.guard_channel

    def guard_pg(self) -> dist.ProcessGroup:
        return self.guard_channel().pg

    def guard_transport(self) -> str | None:
        """The guard mechanism in use ("gloo", "shm", "shm+leaders"), or None before the first call."""
        channel = self._gen.guard_channel
        return None if channel is None else channel.name

    def choose_scope(self, chosen: scope_mod.Scope | None) -> bool:
        """``compiler_collectives.scope()``'s choice: refused after a compile; True where its setup
        check is due (``agree_scope``; see ``groups.choose_scope``)."""
        return build.choose_scope(self._noticed(), chosen)

    def agree_scope(self) -> None:
        """The setup check of ``scope()``'s choice, now (see ``groups.agree_scope``)."""
        build.agree_scope(self._noticed())

    def scope(self) -> scope_mod.Scope | None:
        """The scope our groups of this generation span (None: every rank, or none agreed yet)."""
        return self._gen.scope

    def member_ranks(self, pg: Any) -> tuple[int, ...]:
        """The global ranks of ``pg``'s members, in group-rank order (messages name global ranks)."""
        gen = self._gen
        if gen.scope is not None and pg is not None and (pg is gen.compile_pg or pg is gen.guard_pg):
            return gen.scope.ranks
        try:
            return tuple(dist.get_process_group_ranks(pg))
        except Exception:  # noqa: BLE001 - a group torch does not know (a benchmark's own)
            return tuple(range(pg.size()))

    def existing(self) -> dict[str, dist.ProcessGroup]:
        """The groups created so far (for doctor/diagnostics)."""
        return self._gen.existing()

    def forget(self) -> None:
        """Drop our groups; the next collective creates new ones (all ranks must do this together)."""
        self._gen.forget()

    def leave(self, what: str, seq: int | None, kind: str = "guard") -> None:
        """This rank leaves mid-collective (its own code raised): tell the peers, in those words.

        Not a failure, and nothing is diagnosed. Same-host peers see the
        shared-memory failure word at once, its kind bit saying "left", and
        read these words from the store report; other peers hear of it
        through the store within about a heartbeat. Either way they stop
        waiting for this rank and say that it left.
        """
        side = self._gen.side
        if side is None:
            return
        channel = self._gen.guard_channel
        if channel is not None:
            channel.publish_failure(side.rank, left=True)
        try:
            side.report_failure(kind, seq, what, ranks=(side.rank,), left=True)
        except Exception as e:  # noqa: BLE001 - StoreUnresponsive or a store error
            log.warning("rank %d could not tell the other ranks that it left (%s)", side.rank, e)

    def post(self, name: str, value: bytes) -> None:
        """Leave a notice for the peers on the store side channel (names are this generation's;
        under a scope they are the scope's own)."""
        build.side_channel(self._gen).mailbox.post(self._notice(name), value)

    def store_name(self) -> str:
        """How messages name this generation's store ("the c10d store at host:port"); no request."""
        side = self._gen.side
        return side.store_name if side is not None else "the c10d store"

    def read_post(self, name: str) -> bytes | None:
        """A notice a peer posted (``post``), or None if there is none yet."""
        return build.side_channel(self._gen).mailbox.read_post(self._notice(name))

    def wait_posts(self, names: Sequence[str], timeout_s: float) -> NoticeWait:
        """Start waiting for the notices ``names`` (``post``) on a store connection of their own
        (``store.mailbox.NoticeWait``): ``done``, ``posted``, ``result``, and ``cancel`` when the
        caller stops waiting. Two store requests (a ``wait`` and a ``multi_get``), however many
        notices and however long they take."""
        return build.side_channel(self._gen).mailbox.wait_posts([self._notice(name) for name in names], timeout_s)

    def watch_peers(self, ranks: Sequence[int], *, policy: WaitPolicy = COMPILE_WAIT) -> WaitWatch:
        """The watches of one wait for the global ranks ``ranks`` (``health.watch.WaitWatch``;
        ``close`` it when the wait ends): ``peers[rank]()`` says why ``policy`` gives up on that
        rank (it is absent), or None while ``policy`` waits for it; ``store()`` says how long
        this rank's heartbeat has waited for the store, once that reached
        COMPILER_COLLECTIVES_TIMEOUT. The default is compile once's loader wait (its only
        caller): a gone or failed peer is absent; a stopped or wedged one on this host, or a
        silent one on another, is waited for, with a warning every 30 s (``health.liveness``).
        Cheap enough to call every poll, and none asks the store anything: the peers' records
        come with this rank's heartbeat (read once per generation without one:
        ``store.board.PeerRecords``), ``/proc`` is read for a peer on this host, heartbeats or
        not, and for one elsewhere that is silent or beats no heartbeat, this rank's gloo
        connection to it (in the compile group) looked at about once a second: a reset
        connection is how a process that ended on another host is known."""
        side = build.side_channel(self._gen)
        pg = self._gen.compile_pg
        members = self.member_ranks(pg) if pg is not None and connections_can_be_looked_at() else ()
        connections: dict[int, Callable[[], str | None]] = {}
        for rank in ranks:
            if pg is not None and rank in members:
                connections[rank] = functools.partial(broken_connection, pg, members.index(rank))
        return WaitWatch(side, ranks, policy=policy, connections=connections)

    def broken_peers(self, pg: Any) -> dict[int, str]:
        """The members of ``pg`` (global ranks) whose gloo connection to this rank broke, each with
        gloo's words: after an operation on ``pg`` failed on a broken connection, who it was."""
        try:
            return broken_peers(pg, self.member_ranks(pg))
        except Exception as e:  # noqa: BLE001 - the error then names nobody, as before
            log.debug("looking for broken connections: %s", e)
            return {}

    def _notice(self, name: str) -> str:
        chosen = self._gen.scope
        return name if chosen is None else f"scope/{chosen.key}/{name}"

    def read_peer_report(self, peer: int, own_rank: int | None, wait_s: float) -> tuple[int, dict[str, Any]] | None:
        """Rank ``peer``'s failure report as it wrote it (a ``SideChannel.report_failure`` record),
        waiting up to ``wait_s`` for it: (the rank whose report it is, the report). Where ``peer``
        only relayed another rank's report, that rank's. None if there is none (or the store
        does not answer). What the report means is the reader's to decide."""
        side = self._gen.side
        if side is None:
            return None
        try:
            report = side.read_report(peer, wait_s)
            origin = report.get("heard_from") if report is not None else None
            if type(origin) is int and origin not in (peer, own_rank) and 0 <= origin < side.world:
                first = side.read_report(origin, wait_s)
                if first is not None:
                    peer, report = origin, first
        except Exception as e:  # noqa: BLE001 - StoreUnresponsive or a store error
            log.debug("reading rank %d's failure report: %s", peer, e)
            return None
        return None if report is None else (peer, report)


# What the runtime's moments do to this layer's generation; each new one is handed over
# with ``adopt``. Our groups go first: that stops the heartbeat thread, which could
# otherwise report into the old latch while the runtime builds the next one.


def forget() -> None:
    """``compiler_collectives.reset()``: drop our groups and end the pending connection probes."""
    generation_mod.current.forget()
    probes.end_probes()


def let_go() -> None:
    """The start of ``destroy_process_group()`` of the default group: let go of every reference
    to its store (our threads told to stop, not waited for; see ``Generation.let_go``)."""
    generation_mod.current.let_go()
    probes.end_probes()


def default_group_destroyed() -> None:
    """The default group ended: drop what is left of its generation, and ``scope()``'s choice,
    which was made for it."""
    generation_mod.current.default_group_destroyed()
    scope_mod.forget_choice()
    probes.end_probes()


def forked_child_generation(on_new_world: Callable[[], None]) -> Generation:
    """In a forked child: the parent's generation and probes kept alive and never used, and the
    child's own generation, for the runtime to hand over: the parent's number, the inherited
    default group seen (our collectives do not run on it)."""
    probes.after_fork_in_child()
    parent = generation_mod.current
    return Generation(
        parent.number,
        on_new_world=on_new_world,
        progress_sources=groups.progress_sources,
        inherited_world=parent.inherited_in_child(),
    )


def adopt(generation: Generation) -> None:
    """Make ``generation`` (the runtime built it: ``next_generation``, ``forked_child_generation``) the
    current one, for ``groups`` and for the exit handler alike."""
    generation_mod.adopt(generation)
    groups.bind(generation)


groups = Groups(generation_mod.current)
