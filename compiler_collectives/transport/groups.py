"""Our own process groups and their store side channel.

Both groups are created lazily from the default group with the gloo backend,
also when the default backend is NCCL, each with the timeout from
``COMPILER_COLLECTIVES_TIMEOUT``. The guard group carries whichever guard
mechanism ``COMPILER_COLLECTIVES_GUARD_TRANSPORT`` selects (see
``hierarchy.build_guard_channel``); the compile group carries byte all-gathers.

Before the first group of a generation exists, the ranks run the first
rendezvous wired at install (``set_first_rendezvous``: the agreements layer's
setup check, where every rank raises ``SetupMismatchError`` if they
disagree about a version or a setting that must match). What to do when an
exchange fails is policy, and lives above this layer
(``agreements/failure.py``); this module only moves bytes and reports. When
the heartbeat thread hears a peer's failure report, it hands the raw report
to the handler the agreements layer registered (``set_peer_report_handler``);
``read_peer_report`` reads one from the store on request.

Under a scope (``compiler_collectives.scope``, ``COMPILER_COLLECTIVES_SCOPE``)
the groups span the scope's ranks only, and are made by those ranks only:
plain ``ProcessGroupGloo`` objects on our own store prefix (generation, scope,
group), not ``new_group``, because a group made by some ranks only must not
change the user's later ``new_group`` numbering, and ``new_group(...,
use_local_synchronization=True)`` names a group after the number of groups
the calling process already has (torch 2.13), which differs between ranks that
belong to different user groups: they would never meet. At
interpreter exit our heartbeat thread is stopped and our groups destroyed
(``shutdown``), so nothing of ours is left running while Python finalizes.

Two changes of process model drop everything of a generation at once:

* ``default_group_destroyed``: the default group ended. Our groups, store and
  heartbeat go with it, so that a later ``init_process_group`` (on the same
  port, say) starts a new generation from nothing, as
  ``compiler_collectives.reset()`` would. The c10d seam runs that moment at
  ``destroy_process_group()``, once torch's destroy returned, and before it
  ``let_go`` (its own moment): every reference to the store goes and the
  heartbeat is told to stop, so that the store's server closes within
  torch's destroy; ``notice()`` runs the moment when it finds a default
  group other than the last one it saw (a destroy the seam did not see: code
  that held torch's own function). ``notice()`` is the one place that notices
  a new default group; every other module calls it, and keeps
  nothing of a generation that the moment does not clear.
* ``after_fork_in_child``: a forked child (a DataLoader worker) inherits the
  parent's groups, segment mapping, store and heartbeat object, but none of
  its threads. The child is not a rank: it keeps those objects alive (so
  their destructors never run here, against the parent's sockets and
  segment) but never uses them, and our collectives do not run on the
  inherited default group (``available`` is False); compiled code in the
  child decides alone. A default group the child creates itself is its own.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import hashlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

from .. import config, health, process_state
from ..errors import (
    SCOPE_HINT,
    CollectiveError,
    CollectiveTimeoutError,
    ScopeError,
    StoreUnresponsive,
)
from ..health.diagnosis import diagnose_with_deadline
from ..health.liveness import COMPILE_WAIT, WaitPolicy
from ..health.watch import watch_peer
from ..store import rendezvous
from ..store.board import PeerRecords, SideChannel
from ..store.calls import bounded
from ..store.mailbox import NoticeWait
from . import scope as scope_mod
from . import segment
from .channel import GuardChannel
from .gloo import broken_connection, broken_peers, connections_can_be_looked_at, end_probes
from .hierarchy import ShmGuardChannel, build_guard_channel, host_key

log = logging.getLogger("compiler_collectives.transport")


# What a forked child inherited from its parent: kept alive, never used (see the docstring).
_inherited: list[Any] = []


def _identity() -> dict[str, Any]:
    """This process as a peer on the same machine and pid namespace can check it in /proc, and
    the name of its host, where a peer elsewhere says where to look at it (``node``)."""
    pid = os.getpid()
    ident = segment.process_identity(pid)
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    place = hashlib.blake2b(f"{host_key()}|{pid_ns}".encode(), digest_size=7).digest()
    return {
        "pid": pid,
        "start": ident[1] if ident else 0,
        "host": int.from_bytes(place, "little"),
        "node": socket.gethostname(),
    }


class Groups:
    """Lazily created gloo groups and their side channel, rebuilt if the default group changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # The default group ``notice()`` last saw, and the lock of its slow path (a new one).
        self._world: object | None = None
        self._noticing = threading.Lock()
        self._compile_pg: dist.ProcessGroup | None = None
        self._guard_pg: dist.ProcessGroup | None = None
        self._guard_channel: GuardChannel | None = None
        self._agreed = False  # the setup agreement of this generation passed
        self._scope: scope_mod.Scope | None = None  # the ranks our groups of this generation span
        self._on_inherited = False  # a forked child whose default group is still its parent's
        self._told_child = False
        self.side: SideChannel | None = None
        # Joins of the threads of a side channel let go of (``let_go``), waited for by the moment.
        self._stopping: list[Callable[[float], bool]] = []
        # Callables returning this rank's progress for the heartbeat (``add_progress_source``).
        self.progress_sources: list[Callable[[], dict[str, Any]]] = []

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
                # Outside ``self._lock``: this moment's clear of our groups takes it.
                process_state.run(process_state.GROUP_DESTROYED)
            self._world = world

    @staticmethod
    def ends_the_default_group(group: object | None) -> bool:
        """Whether ``destroy_process_group(group)`` destroys the default group (None names it)
        while there is one; a subgroup's destroy is not."""
        return dist.is_initialized() and (group is None or group is dist.group.WORLD)

    def is_current(self, generation: int) -> bool:
        """Whether ``generation`` is still the current one, for another thread (the heartbeat):
        it reads, and runs no moment; the rank's own next call of ``notice()`` does that."""
        return process_state.generation() == generation and dist.group.WORLD is self._world

    def _drop(self) -> None:
        if self.side is not None:
            self.side.stop()
        self.side = None
        self._compile_pg = None
        self._guard_pg = None
        self._guard_channel = None
        self._agreed = False
        self._scope = None

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

    def after_fork_in_child(self) -> None:
        """In a forked child: forget the parent's generation without touching any of it."""
        _inherited.append((self._world, self._compile_pg, self._guard_pg, self._guard_channel, self.side))
        # Another thread of the parent may have held these at the fork.
        self._lock = threading.Lock()
        self._noticing = threading.Lock()
        # The parent's default group is the one seen (no moment: the fork's has run), so
        # one the child makes itself is noticed as new and starts a generation of its own.
        self._world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        self._on_inherited = self._world is not None
        self.side = None
        self._stopping = []
        self._compile_pg = self._guard_pg = self._guard_channel = None
        self._agreed = False
        self._told_child = False

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
        with self._lock:
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
        with self._lock:
            side, self.side = self.side, None
            self._drop()
            self._world = None
            self._on_inherited = False
            joins, self._stopping = self._stopping, []
        if side is not None:
            joins.append(side.stopping())
        if not all([join(2.0) for join in joins]):
            log.debug("the heartbeat thread did not end within 2s of destroy_process_group")

    def add_progress_source(self, source: Callable[[], dict[str, Any]]) -> None:
        """What the heartbeat tells of this rank's progress, merged from every source (idempotent per function)."""
        if source not in self.progress_sources:
            self.progress_sources.append(source)

    def _progress(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for source in self.progress_sources:
            out.update(source())
        return out

    def _side_channel(self) -> SideChannel:
        if self.side is None:
            generation = process_state.generation()
            side = SideChannel(
                dist.get_rank(),
                dist.get_world_size(),
                generation,
                self._progress,
                identity=_identity(),
                probe=segment.process_identity,
                current=functools.partial(self.is_current, generation),
            )
            _register_exit()
            side.start(on_peer_failure=functools.partial(_heard_report, side.rank))
            self.side = side
        return self.side

    def _agree(self, side: SideChannel, chosen: scope_mod.Scope | None) -> None:
        """The setup check of this generation (the first rendezvous), for the whole world or a scope."""
        timeout_s = config.settings.timeout_s
        prepare = _first_rendezvous
        if prepare is not None:
            # Prepared on the caller's thread (it reads switches such as Dynamo's
            # config, which can be thread-local); only the store exchange runs on
            # the bounded helper thread.
            rendezvous = prepare(chosen)
            bounded(lambda: rendezvous(side, timeout_s), timeout_s + 5.0, "during the setup check")
        side.members = chosen.ranks if chosen is not None else None
        self._scope = chosen
        self._agreed = True
        if chosen is not None:
            log.info("rank %d: agreements run within scope %s (%s)", side.rank, chosen.render(), chosen.source)

    def _new_group(self, tag: str, kind: str) -> Any:
        timeout_s = config.settings.timeout_s
        rank = dist.get_rank()
        try:
            side = self._side_channel()
            if not self._agreed:
                # The setup agreement is also this generation's first rendezvous.
                self._agree(side, scope_mod.effective(rank, dist.get_world_size()))
            else:
                # Our own rendezvous first: group creation would otherwise wait on the
                # store with whatever timeout it picks and could not say who is missing.
                absent = rendezvous.meet(side.store, side.rank, side.peers(), tag, timeout_s)
                if absent:
                    raise self._absent_error(side, absent, kind, rank, timeout_s)
        except StoreUnresponsive as e:
            err: CollectiveError = CollectiveTimeoutError(
                f"creating the {kind}-collective process group on rank {rank}: {e} "
                "(COMPILER_COLLECTIVES_TIMEOUT). The store lives in the process that created it "
                "(rank 0 under torchrun, or the MASTER_ADDR host): is it stopped, overloaded or gone?",
                kind=kind,
                rank=rank,
            )
            health.poison(err)
            raise err from None
        except CollectiveError as err:
            health.poison(err)
            raise
        log.debug("creating %s gloo group (timeout %.0fs)", tag, timeout_s)
        if self._scope is not None:
            return self._scoped_group(tag, self._scope.ranks)
        try:
            # Gloo's own connection set-up waits on the store as long as the store lets it.
            return bounded(
                lambda: dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s), group_desc=tag),
                timeout_s + 5.0,
                f"while creating the {kind}-collective gloo group",
            )
        except StoreUnresponsive as e:
            unresponsive = CollectiveTimeoutError(
                f"creating the {kind}-collective process group on rank {rank}: gloo's connection set-up "
                f"did not finish within {timeout_s:.0f}s (COMPILER_COLLECTIVES_TIMEOUT; {e}). A peer "
                "stopped, or the ranks use different stores.",
                kind=kind,
                rank=rank,
            )
            health.poison(unresponsive)
            raise unresponsive from None

    def _scoped_group(self, tag: str, ranks: tuple[int, ...] | list[int]) -> Any:
        """A gloo group of ``ranks`` (this rank among them), made by those ranks only."""
        side = self._side_channel()
        assert self._scope is not None
        prefix = f"pg/{self._scope.key}/{tag}/{'_'.join(map(str, ranks)) if len(ranks) <= 64 else len(ranks)}/"
        store = PrefixStore(prefix, side.store)
        return dist.ProcessGroupGloo(
            store, list(ranks).index(side.rank), len(ranks), datetime.timedelta(seconds=config.settings.timeout_s)
        )

    def _absent_error(
        self, side: SideChannel, absent: list[int], kind: str, rank: int, timeout_s: float
    ) -> CollectiveTimeoutError:
        """Ranks that did not come to make a group: alive ones (heartbeat moving) run other code."""
        alive: list[int] = []
        try:
            diagnosis = diagnose_with_deadline(side, deadline_s=2.5 * config.settings.heartbeat_s + 2.0)
            if diagnosis is not None:
                alive = [r for r in diagnosis.alive_elsewhere if r in absent]
        except Exception as e:  # noqa: BLE001 - the message is less precise, the error stands
            log.debug("could not tell whether the absent ranks are alive: %s", e)
        message = (
            f"creating the {kind}-collective process group on rank {rank}: rank(s) "
            f"{absent} did not arrive within {timeout_s:.0f}s (COMPILER_COLLECTIVES_TIMEOUT). "
            "They are stuck, much slower, crashed, or never compile this code (compiler "
            "collectives need every rank to compile the same frames)"
            + (
                ", or turned guard collectives on later than this rank or not at all "
                "(the switch must be the same on every rank)"
                if kind == "guard"
                else ""
            )
            + "."
        )
        if alive:
            message += (
                f" Rank(s) {alive} are alive (their heartbeat moves) but elsewhere: they run other code than this rank."
            )
            if self._scope is None:
                message += " " + SCOPE_HINT
        return CollectiveTimeoutError(message, kind=kind, rank=rank, ranks=tuple(absent))

    def compile_pg(self) -> dist.ProcessGroup:
        self.notice()
        with self._lock:
            if self._compile_pg is None:
                self._compile_pg = self._new_group("compiler_collectives_compile", "compiler")
            return self._compile_pg

    def guard_channel(self) -> GuardChannel:
        """The guard channel of this generation, built on every rank together at first use."""
        self.notice()
        with self._lock:
            if self._guard_channel is None:
                self._guard_pg = self._new_group("compiler_collectives_guard", "guard")
                side = self._side_channel()
                if self._scope is None:
                    self._guard_channel = build_guard_channel(self._guard_pg, side.store)
                else:
                    # Store keys of each scope apart: two scopes on one host both have a host 0.
                    store = PrefixStore(f"scope/{self._scope.key}/", side.store)
                    self._guard_channel = build_guard_channel(
                        self._guard_pg,
                        store,
                        members=self._scope.ranks,
                        subgroup=lambda ranks: self._scoped_group("compiler_collectives_guard_leaders", ranks),
                    )
            return self._guard_channel

    def built_guard_channel(self) -> GuardChannel | None:
        """The guard channel if this generation built one already, else None (never builds)."""
        return self._guard_channel

    def use_scope(self, chosen: scope_mod.Scope | None) -> None:
        """``compiler_collectives.scope()``: refuse after a compile; otherwise remember the choice
        and, for a scope, run this generation's setup check now (every rank is before its first
        compile here, so nobody's first compile waits for it)."""
        self.notice()
        with self._lock:
            rank = dist.get_rank()
            if self._agreed or self._compile_pg is not None or self._guard_channel is not None:
                same = (self._scope is None and chosen is None) or (
                    self._scope is not None and chosen is not None and self._scope.ranks == chosen.ranks
                )
                if same:
                    return
                now = "the whole world" if self._scope is None else f"ranks {self._scope.render()}"
                raise ScopeError(
                    f"compiler_collectives.scope() on rank {rank}: called after this rank's agreements "
                    f"started (they span {now}): a compile with compiler or guard collectives on, or "
                    "an earlier scope() call. Call scope() on every rank before the first compile; "
                    "to change it later, call compiler_collectives.reset() on every rank first.",
                    kind="scope",
                    rank=rank,
                )
            scope_mod.choose(chosen)
            if chosen is None:
                return
            try:
                side = self._side_channel()
                self._agree(side, chosen)
            except StoreUnresponsive as e:
                err = CollectiveTimeoutError(
                    f"compiler_collectives.scope() on rank {rank}: {e}", kind="setup", rank=rank
                )
                health.poison(err)
                raise err from None
            except CollectiveError as err:
                health.poison(err)
                raise

    def scope(self) -> scope_mod.Scope | None:
        """The scope our groups of this generation span (None: every rank, or none agreed yet)."""
        return self._scope

    def member_ranks(self, pg: Any) -> tuple[int, ...]:
        """The global ranks of ``pg``'s members, in group-rank order (messages name global ranks)."""
        if self._scope is not None and pg is not None and (pg is self._compile_pg or pg is self._guard_pg):
            return self._scope.ranks
        try:
            return tuple(dist.get_process_group_ranks(pg))
        except Exception:  # noqa: BLE001 - a group torch does not know (a benchmark's own)
            return tuple(range(pg.size()))

    def guard_transport(self) -> str | None:
        """The guard mechanism in use ("gloo", "shm", "shm+leaders"), or None before the first call."""
        channel = self._guard_channel
        return None if channel is None else channel.name

    def guard_pg(self) -> dist.ProcessGroup:
        return self.guard_channel().pg

    def existing(self) -> dict[str, dist.ProcessGroup]:
        """The groups created so far (for doctor/diagnostics)."""
        out = {}
        if self._compile_pg is not None:
            out["compile"] = self._compile_pg
        if self._guard_pg is not None:
            out["guard"] = self._guard_pg
        leaders = getattr(self._guard_channel, "leaders_pg", None)
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
        if dist.is_available() and dist.is_initialized() and self._scope is None:
            # (A scope's groups are not registered with torch: dropping them below ends them.)
            for name, pg in self.existing().items():
                try:
                    dist.destroy_process_group(pg)
                except Exception as e:  # noqa: BLE001 - already destroyed with the default group
                    log.debug("destroying our %s group at exit: %s", name, e)
        self._drop()

    def forget(self) -> None:
        """Drop our groups; the next collective creates new ones (all ranks must do this together;
        ``reset()``'s run of the moment starts the next generation's number)."""
        with self._lock:
            self._drop()
            self._world = None

    def leave(self, what: str, seq: int | None, kind: str = "guard") -> None:
        """This rank leaves mid-collective (its own code raised): tell the peers, in those words.

        Not a failure, and nothing is diagnosed. Same-host peers see the
        shared-memory failure word at once, its kind bit saying "left", and
        read these words from the store report; other peers hear of it
        through the store within about a heartbeat. Either way they stop
        waiting for this rank and say that it left.
        """
        side = self.side
        if side is None:
            return
        channel = self._guard_channel
        if channel is not None:
            channel.publish_failure(side.rank, left=True)
        try:
            side.report_failure(kind, seq, what, ranks=(side.rank,), left=True)
        except Exception as e:  # noqa: BLE001 - StoreUnresponsive or a store error
            log.warning("rank %d could not tell the other ranks that it left (%s)", side.rank, e)

    def post(self, name: str, value: bytes) -> None:
        """Leave a notice for the peers on the store side channel (names are this generation's;
        under a scope they are the scope's own)."""
        self._side_channel().mailbox.post(self._notice(name), value)

    def store_name(self) -> str:
        """How messages name this generation's store ("the c10d store at host:port"); no request."""
        side = self.side
        return side.store_name if side is not None else "the c10d store"

    def read_post(self, name: str) -> bytes | None:
        """A notice a peer posted (``post``), or None if there is none yet."""
        return self._side_channel().mailbox.read_post(self._notice(name))

    def wait_posts(self, names: Sequence[str], timeout_s: float) -> NoticeWait:
        """Start waiting for the notices ``names`` (``post``) on a store connection of their own
        (``store.mailbox.NoticeWait``): ``done``, ``posted``, ``result``, and ``cancel`` when the
        caller stops waiting. A few store requests per notice, however long it takes."""
        return self._side_channel().mailbox.wait_posts([self._notice(name) for name in names], timeout_s)

    def watch_peers(
        self, ranks: Sequence[int], *, policy: WaitPolicy = COMPILE_WAIT
    ) -> dict[int, Callable[[], str | None]]:
        """A probe of each global rank of ``ranks``: each call says why ``policy`` gives up on it
        (it is absent), or None while ``policy`` waits for it. The default is compile once's loader
        wait (its only caller): a gone or failed peer is absent; a stopped or wedged one on this
        host, or a silent one on another, is waited for, with a warning every 30 s
        (``health.liveness``). Cheap enough to call every poll: no thread per call, no store
        request at most calls (the probes share one read of their records, made again only where
        a record looks silent: ``store.board.PeerRecords``), ``/proc`` read for a peer on this
        host, heartbeats or not, and for one elsewhere that is silent or beats no heartbeat, this
        rank's gloo connection to it (in the compile group) looked at about once a second: a
        reset connection is how a process that ended on another host is known."""
        side = self._side_channel()
        pg = self._compile_pg
        members = self.member_ranks(pg) if pg is not None and connections_can_be_looked_at() else ()
        records = PeerRecords(side, ranks)
        probes = {}
        for rank in ranks:
            connection: Callable[[], str | None] | None = None
            if pg is not None and rank in members:
                connection = functools.partial(broken_connection, pg, members.index(rank))
            probes[rank] = watch_peer(side, rank, policy=policy, connection=connection, records=records)
        return probes

    def broken_peers(self, pg: Any) -> dict[int, str]:
        """The members of ``pg`` (global ranks) whose gloo connection to this rank broke, each with
        gloo's words: after an operation on ``pg`` failed on a broken connection, who it was."""
        try:
            return broken_peers(pg, self.member_ranks(pg))
        except Exception as e:  # noqa: BLE001 - the error then names nobody, as before
            log.debug("looking for broken connections: %s", e)
            return {}

    def _notice(self, name: str) -> str:
        return name if self._scope is None else f"scope/{self._scope.key}/{name}"

    def read_peer_report(self, peer: int, own_rank: int | None, wait_s: float) -> tuple[int, dict[str, Any]] | None:
        """Rank ``peer``'s failure report as it wrote it (a ``SideChannel.report_failure`` record),
        waiting up to ``wait_s`` for it: (the rank whose report it is, the report). Where ``peer``
        only relayed another rank's report, that rank's. None if there is none (or the store
        does not answer). What the report means is the reader's to decide."""
        side = self.side
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


# rendezvous(side, timeout_s): raises to stop group creation on every rank.
Rendezvous = Callable[[SideChannel, float], None]
_first_rendezvous: Callable[[Any], Rendezvous] | None = None


@process_state.wired(names=("_first_rendezvous",), what="the setup check, the first rendezvous of a generation")
def set_first_rendezvous(prepare: Callable[[Any], Rendezvous] | None) -> None:
    """What every rank runs before the first group of a generation.

    ``prepare(scope)`` (the ``scope.Scope`` this rank's groups will span, or
    None for the whole world) runs on the caller's thread and returns
    ``rendezvous(side, timeout_s)``, which runs bounded by the timeout.
    Install wires the agreements layer's setup check here (``dynamo/wiring.py``).
    """
    global _first_rendezvous
    _first_rendezvous = prepare


# handler(own_rank, peer, report): what this rank makes of a peer's raw failure report.
PeerReportHandler = Callable[[int, int, dict[str, Any]], None]
_peer_report_handler: PeerReportHandler | None = None


@process_state.wired(names=("_peer_report_handler",), what="the agreements' handler of a peer's failure report")
def set_peer_report_handler(handler: PeerReportHandler | None) -> None:
    """Who hears a peer's failure report: the heartbeat thread calls ``handler(own_rank, peer,
    report)`` with the raw ``SideChannel.report_failure`` record of rank ``peer`` (a failure,
    or that it left). The agreements layer registers its failure policy here; registering
    again replaces it. Kept across ``reset`` and into a forked child, as the module is."""
    global _peer_report_handler
    _peer_report_handler = handler


def _heard_report(own_rank: int, peer: int, report: dict[str, Any]) -> None:
    """Heartbeat thread: rank ``peer`` reported; pass it on as heard, then end this rank's wait in
    the guard's leaders' exchange, if it waits there (its waits are untimed: ``hierarchy``)."""
    handler = _peer_report_handler
    if handler is None:
        log.warning("rank %d heard rank %d's failure report, but no handler is registered", own_rank, peer)
        return
    handler(own_rank, peer, report)
    channel = groups.built_guard_channel()
    if isinstance(channel, ShmGuardChannel) and health.poisoned() is not None:
        try:
            channel.interrupt()
        except Exception as e:  # noqa: BLE001 - the wait then ends at the group's timeout
            log.debug("ending the leaders' exchange after rank %d's report: %s", peer, e)


_exit_registered = False


@process_state.kept(names=("_exit_registered",), why="our exit handler is registered once per process")
def _register_exit() -> None:
    global _exit_registered
    if not _exit_registered:
        atexit.register(_at_exit)
        _exit_registered = True


def _at_exit() -> None:
    try:
        groups.shutdown()
    except Exception as e:  # noqa: BLE001 - never fail an exit
        log.debug("shutdown at exit: %s", e)


# Every moment drops our groups. The groups go first: that stops the heartbeat
# thread, which could otherwise poison ``health`` after it was cleared.
_GROUPS = (
    "our gloo groups, the guard channel, the side channel (its heartbeat thread and "
    "StoreCaller: store.board and store.calls) and the scope they span; the "
    "heartbeat's progress sources are wired by install and kept"
)


@process_state.clears(process_state.RESET, names=("groups",), what=_GROUPS, first=True)
def forget() -> None:
    groups.forget()


@process_state.clears(
    process_state.GROUP_ENDING,
    names=("groups",),
    what="every reference to the store: our groups, the guard channel, the side channel (its threads told to stop)",
    first=True,
)
def let_go() -> None:
    groups.let_go()


@process_state.clears(process_state.GROUP_DESTROYED, names=("groups",), what=_GROUPS, first=True)
def default_group_destroyed() -> None:
    groups.default_group_destroyed()


@process_state.clears(
    process_state.FORK, names=("groups",), what=_GROUPS + " (the parent's are kept in _inherited)", first=True
)
@process_state.kept(names=("_inherited",), why="what a forked child inherited: kept alive, never used")
def after_fork_in_child() -> None:
    groups.after_fork_in_child()


groups = Groups()
