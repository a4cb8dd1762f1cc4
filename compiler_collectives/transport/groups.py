"""Our own process groups, their store side channel, and the failure procedure.

Both groups are created lazily from the default group with the gloo backend,
also when the default backend is NCCL, each with the timeout from
``COMPILER_COLLECTIVES_TIMEOUT``. The guard group carries whichever guard
mechanism ``COMPILER_COLLECTIVES_GUARD_TRANSPORT`` selects (see
``hierarchy.build_guard_channel``); the compile group carries byte all-gathers.

Before the first group of a generation exists, the ranks run the setup
agreement (``setup_agreement``): every rank raises ``SetupMismatchError``
there if they disagree about a version or a setting that must match.

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
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import logging
import os
import threading
from typing import Any, Callable

import torch.distributed as dist

from .. import config, health, setup_agreement
from .. import scoping as scope_mod
from ..errors import (
    SCOPE_HINT,
    CollectiveDesyncError,
    CollectiveError,
    CollectiveTimeoutError,
    PeerFailureError,
    ScopeError,
    SetupMismatchError,
    WireFormatError,
)
from ..watchdog import Diagnosis, SideChannel, StoreUnresponsive, bounded, diagnose_with_deadline
from . import shm
from .gloo import PROTOCOL_VERSION, translate_failure
from .hierarchy import build_guard_channel, host_key

log = logging.getLogger("compiler_collectives.transport")


def _identity() -> dict[str, int]:
    """This process as a peer on the same machine and pid namespace can check it in /proc."""
    pid = os.getpid()
    ident = shm.process_identity(pid)
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    place = hashlib.blake2b(f"{host_key()}|{pid_ns}".encode(), digest_size=7).digest()
    return {"pid": pid, "start": ident[1] if ident else 0, "host": int.from_bytes(place, "little")}


class Groups:
    """Lazily created gloo groups and their side channel, rebuilt if the default group changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._world: object | None = None
        self._generation = 0
        self._compile_pg: dist.ProcessGroup | None = None
        self._guard_pg: dist.ProcessGroup | None = None
        self._guard_channel: Any = None  # GlooGuardChannel or ShmGuardChannel
        self._agreed = False  # the setup agreement of this generation passed
        self._scope: scope_mod.Scope | None = None  # the ranks our groups of this generation span
        self.side: SideChannel | None = None
        # Callables returning this rank's progress for the heartbeat.
        self.progress_sources: list[Callable[[], dict[str, Any]]] = []

    def _check_world(self) -> None:
        world = dist.group.WORLD
        if world is not self._world:
            # A new init_process_group (or a destroy) invalidates our groups;
            # a new generation keeps store keys from meeting the old ones.
            if self._world is not None:
                self._generation += 1
            self._drop()
            self._world = world

    def _drop(self) -> None:
        if self.side is not None:
            self.side.stop()
        self.side = None
        self._compile_pg = None
        self._guard_pg = None
        self._guard_channel = None
        self._agreed = False
        self._scope = None

    @staticmethod
    def available() -> bool:
        return dist.is_available() and dist.is_initialized()

    def _progress(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for source in self.progress_sources:
            out.update(source())
        return out

    def _side_channel(self) -> SideChannel:
        if self.side is None:
            world = dist.group.WORLD
            side = SideChannel(
                dist.get_rank(), dist.get_world_size(), self._generation, self._progress,
                identity=_identity(), probe=shm.process_identity,
                current=lambda: dist.is_initialized() and dist.group.WORLD is world,
            )
            _register_exit()
            side.start(on_peer_failure=_peer_failed)
            self.side = side
        return self.side

    def _agree(self, side: SideChannel, chosen: scope_mod.Scope | None) -> None:
        """The setup check of this generation (the first rendezvous), for the whole world or a scope."""
        timeout_s = config.settings.timeout_s
        rank, world = side.rank, side.world
        items = {
            "transport protocol version": PROTOCOL_VERSION,
            "shared-memory layout version": shm.LAYOUT_VERSION,
            scope_mod.SCOPE_ITEM: scope_mod.record_item(chosen),
        }
        if chosen is not None:
            items.update(scope_mod.leader_items(chosen, rank))
        record = setup_agreement.local_record(items)
        try:
            if chosen is None:
                check = scope_mod.check_reference(rank, None)
                bounded(lambda: setup_agreement.agree(side.store, rank, world, timeout_s, record, check),
                        timeout_s + 5.0, "during the setup check")
            else:
                bounded(lambda: scope_mod.agree(side.store, rank, world, timeout_s, chosen, record),
                        timeout_s + 5.0, "during the setup check")
        except (ScopeError, SetupMismatchError) as err:
            if chosen is not None or isinstance(err, ScopeError):
                # Ranks of other scopes passed their own checks (or wait in another one):
                # the report stops them within a heartbeat.
                try:
                    side.report_failure("setup", None, str(err))
                except Exception as e:  # noqa: BLE001 - StoreUnresponsive or a store error
                    log.debug("could not report the setup failure: %s", e)
            raise
        side.members = chosen.ranks if chosen is not None else None
        self._scope = chosen
        self._agreed = True
        if chosen is not None:
            log.info("rank %d: agreements run within scope %s (%s)", rank, chosen.render(), chosen.source)

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
                absent = side.rendezvous(tag, timeout_s)
                if absent:
                    raise self._absent_error(side, absent, kind, rank, timeout_s)
        except StoreUnresponsive as e:
            err: CollectiveError = CollectiveTimeoutError(
                f"creating the {kind}-collective process group on rank {rank}: {e} "
                "(COMPILER_COLLECTIVES_TIMEOUT). The store lives in the process that created it "
                "(rank 0 under torchrun, or the MASTER_ADDR host): is it stopped, overloaded or gone?",
                kind=kind, rank=rank,
            )
            health.poison(err)
            raise err from None
        except CollectiveError as err:
            health.poison(err)
            raise
        log.debug("creating %s gloo group (timeout %.0fs)", tag, timeout_s)
        if self._scope is None:
            return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s), group_desc=tag)
        return self._scoped_group(tag, self._scope.ranks)

    def _scoped_group(self, tag: str, ranks: tuple[int, ...] | list[int]) -> Any:
        """A gloo group of ``ranks`` (this rank among them), made by those ranks only."""
        side = self._side_channel()
        assert self._scope is not None
        prefix = f"pg/{self._scope.key}/{tag}/{'_'.join(map(str, ranks)) if len(ranks) <= 64 else len(ranks)}/"
        store = dist.PrefixStore(prefix, side.store)
        return dist.ProcessGroupGloo(store, list(ranks).index(side.rank), len(ranks),
                                     datetime.timedelta(seconds=config.settings.timeout_s))

    def _absent_error(self, side: SideChannel, absent: list[int], kind: str, rank: int,
                      timeout_s: float) -> CollectiveTimeoutError:
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
            + (", or turned guard collectives on later than this rank or not at all "
               "(the switch must be the same on every rank)" if kind == "guard" else "") + "."
        )
        if alive:
            message += (f" Rank(s) {alive} are alive (their heartbeat moves) but elsewhere: they run "
                        "other code than this rank.")
            if self._scope is None:
                message += " " + SCOPE_HINT
        return CollectiveTimeoutError(message, kind=kind, rank=rank, ranks=tuple(absent))

    def compile_pg(self) -> dist.ProcessGroup:
        with self._lock:
            self._check_world()
            if self._compile_pg is None:
                self._compile_pg = self._new_group("compiler_collectives_compile", "compiler")
            return self._compile_pg

    def guard_channel(self) -> Any:
        """The guard channel of this generation, built on every rank together at first use."""
        with self._lock:
            self._check_world()
            if self._guard_channel is None:
                self._guard_pg = self._new_group("compiler_collectives_guard", "guard")
                side = self._side_channel()
                if self._scope is None:
                    self._guard_channel = build_guard_channel(self._guard_pg, side.store)
                else:
                    # Store keys of each scope apart: two scopes on one host both have a host 0.
                    store = dist.PrefixStore(f"scope/{self._scope.key}/", side.store)
                    self._guard_channel = build_guard_channel(
                        self._guard_pg, store, members=self._scope.ranks,
                        subgroup=lambda ranks: self._scoped_group("compiler_collectives_guard_leaders", ranks))
            return self._guard_channel

    def use_scope(self, chosen: scope_mod.Scope | None) -> None:
        """``compiler_collectives.scope()``: refuse after a compile; otherwise remember the choice
        and, for a scope, run this generation's setup check now (every rank is before its first
        compile here, so nobody's first compile waits for it)."""
        with self._lock:
            self._check_world()
            rank = dist.get_rank()
            if self._agreed or self._compile_pg is not None or self._guard_channel is not None:
                same = (self._scope is None and chosen is None) or (
                    self._scope is not None and chosen is not None and self._scope.ranks == chosen.ranks)
                if same:
                    return
                now = "the whole world" if self._scope is None else f"ranks {self._scope.render()}"
                raise ScopeError(
                    f"compiler_collectives.scope() on rank {rank}: called after this rank's agreements "
                    f"started (they span {now}): a compile with compiler or guard collectives on, or "
                    "an earlier scope() call. Call scope() on every rank before the first compile; "
                    "to change it later, call compiler_collectives.reset() on every rank first.",
                    kind="scope", rank=rank)
            scope_mod.choose(chosen)
            if chosen is None:
                return
            try:
                side = self._side_channel()
                self._agree(side, chosen)
            except StoreUnresponsive as e:
                err = CollectiveTimeoutError(f"compiler_collectives.scope() on rank {rank}: {e}",
                                             kind="setup", rank=rank)
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

    def exchange_failed(self, error: BaseException, *, kind: str, rank: int, seq: int | None,
                        frame: str | None, where: Callable[[], str]) -> CollectiveError:
        """The error a byte exchange raises after ``error``; this rank is poisoned either way.

        Our own errors take the exchange's context. A bad payload or a desync is
        seen identically by every rank, so nobody needs telling; anything else (a
        timeout, a dead peer, gloo's RuntimeError, translated) goes through the
        failure procedure, which tells the other ranks and names the culprits.
        """
        if isinstance(error, CollectiveError):
            error.kind, error.rank, error.seq, error.frame = kind, rank, seq, frame
            if isinstance(error, WireFormatError):
                error.args = (f"{where()}: {error.args[0]}",)
            if isinstance(error, (WireFormatError, CollectiveDesyncError)):
                health.poison(error)
                return error
            err = self.fail(error, seq=seq)
        else:
            translated = translate_failure(error, kind=kind, describe=where, rank=rank, seq=seq, frame=frame)
            translated.__cause__ = error
            err = self.fail(translated, seq=seq)
        health.poison(err)
        return err

    def shutdown(self, join_s: float = 2.0) -> None:
        """Interpreter exit: stop the heartbeat thread (joined) and destroy our groups."""
        side = self.side
        if side is not None and not side.stop(join_s):
            log.debug("the heartbeat thread did not end within %.1fs (a store call hangs)", join_s)
        if dist.is_available() and dist.is_initialized() and self._scope is None:
            # (A scope's groups are not registered with torch: dropping them below ends them.)
            for name, pg in self.existing().items():
                try:
                    dist.destroy_process_group(pg)
                except Exception as e:  # noqa: BLE001 - already destroyed with the default group
                    log.debug("destroying our %s group at exit: %s", name, e)
        self._drop()

    def forget(self) -> None:
        """Drop our groups; the next collective creates new ones (all ranks must do this together)."""
        with self._lock:
            self._drop()
            self._world = None
            self._generation += 1

    def fail(self, error: CollectiveError, *, seq: int | None) -> CollectiveError:
        """The failure procedure: publish, diagnose; returns the error to raise (maybe re-typed).

        Publishing is what tells the peers: same-host peers see the segment's
        failure word within microseconds, every other peer's heartbeat thread
        sees the store report within a heartbeat and poisons its rank, which
        makes a rank waiting in one of our collectives stop (gloo's own
        ``abort`` does nothing, so a blocked gloo operation cannot be ended
        from here).
        """
        side = self.side
        channel = self._guard_channel
        if channel is not None and side is not None:
            channel.publish_failure(side.rank)  # same-host peers stop waiting within microseconds
        if side is not None:
            try:
                side.report_failure(error.kind or "?", seq, str(error))
            except Exception as e:  # noqa: BLE001 - StoreUnresponsive or a store error
                log.warning("rank %d could not report its failure on the c10d store (%s); peers on "
                            "other hosts learn of it only when they time out", side.rank, e)
        diagnosis = diagnose_with_deadline(side, deadline_s=2.5 * config.settings.heartbeat_s + 2.0)
        return _explain(error, diagnosis)


def _explain(error: CollectiveError, diagnosis: Diagnosis | None) -> CollectiveError:
    if diagnosis is None:
        return error
    base = str(error)
    details = diagnosis.render()
    common = dict(kind=error.kind, rank=error.rank, seq=error.seq, frame=error.frame)
    if diagnosis.absent:
        new = type(error)(f"{base}\nRanks not in this collective:\n{details}",
                          ranks=tuple(diagnosis.absent), **common)
    elif diagnosis.alive_elsewhere:
        new = CollectiveDesyncError(
            f"{base}\nRank(s) {diagnosis.alive_elsewhere} are alive but did not enter this "
            f"collective: the ranks are out of step (desync).\n{details}",
            ranks=tuple(diagnosis.alive_elsewhere), **common,
        )
    else:
        return error
    new.__cause__ = error.__cause__
    return new


def _peer_failed(rank: int, message: str) -> None:
    """Heartbeat thread: a peer reported a failure; refuse our next collective, and make
    a wait in progress in one of our collectives stop."""
    first_line = message.splitlines()[0] if message else "no message"
    health.poison(PeerFailureError(f"rank {rank} reported a collective failure: {first_line}",
                                   ranks=(rank,)))


_exit_registered = False


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


groups = Groups()
