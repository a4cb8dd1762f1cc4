"""Building our process groups and their store side channel, into a ``generation.Generation``.

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
(``agreements/failure.py``); this module only builds and reports. A build
that fails raises what stopped it (our error) and decides nothing: the
agreements take their groups through ``agreements/our_groups.py``, which puts
that error through the failure procedure (this rank poisoned). When the
heartbeat thread of the side channel built here hears a peer's failure
report, it hands the raw report to the handler the agreements layer
registered (``set_peer_report_handler``).

Under a scope (``compiler_collectives.scope``, ``COMPILER_COLLECTIVES_SCOPE``)
the groups span the scope's ranks only, and are made by those ranks only:
plain ``ProcessGroupGloo`` objects on our own store prefix (generation, scope,
group), not ``new_group``, because a group made by some ranks only must not
change the user's later ``new_group`` numbering, and ``new_group(...,
use_local_synchronization=True)`` names a group after the number of groups
the calling process already has (torch 2.13), which differs between ranks that
belong to different user groups: they would never meet.

Every function takes the generation it builds into, and builds under its
lock; ``generation.py`` ends what is built here, ``facade.py`` is what the
agreements call.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore

from .. import config, health
from ..errors import (
    SCOPE_HINT,
    CollectiveTimeoutError,
    PeerFailureError,
    ScopeError,
    StoreUnresponsive,
)
from ..health.diagnosis import diagnose_with_deadline
from ..store import rendezvous
from ..store.board import SideChannel
from ..store.calls import bounded
from . import scope as scope_mod
from . import segment
from .channel import GuardChannel
from .generation import Generation, register_exit
from .hierarchy import ShmGuardChannel, build_guard_channel, host_key

log = logging.getLogger("compiler_collectives.transport")


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


def side_channel(gen: Generation) -> SideChannel:
    """The store side channel of ``gen``, started (its heartbeat thread) at first use."""
    if gen.side is None:
        side = SideChannel(
            dist.get_rank(),
            dist.get_world_size(),
            gen.number,
            gen.progress,
            identity=_identity(),
            probe=segment.process_identity,
            current=gen.is_current,
        )
        register_exit()
        side.start(on_peer_failure=functools.partial(_heard_report, gen, side.rank))
        gen.side = side
    return gen.side


def compile_pg(gen: Generation) -> dist.ProcessGroup:
    """The compile group of the current generation, made on every rank together at first use;
    where compile once is on, with the store connection its waits for notices take
    (``Mailbox.connect``): a cost of the generation, not of its first graph."""
    gen.notice()
    with gen.lock:
        if gen.compile_pg is None:
            gen.compile_pg = _new_group(gen, "compiler_collectives_compile", "compiler")
            if config.settings.compile_once:
                _connect_for_notices(side_channel(gen))
        return gen.compile_pg


def _connect_for_notices(side: SideChannel) -> None:
    try:
        bounded(side.mailbox.connect, config.settings.timeout_s, "connecting for notices")
    except Exception as e:  # noqa: BLE001 - the first wait connects instead (and meets the store's trouble)
        log.debug("rank %d: connecting for notices: %s", side.rank, e)


def guard_channel(gen: Generation) -> GuardChannel:
    """The guard channel of this generation, built on every rank together at first use."""
    gen.notice()
    with gen.lock:
        if gen.guard_channel is None:
            guard_pg = gen.guard_pg = _new_group(gen, "compiler_collectives_guard", "guard")
            side = side_channel(gen)
            chosen = gen.scope
            if chosen is None:
                gen.guard_channel = build_guard_channel(guard_pg, side.store)
            else:
                # Store keys of each scope apart: two scopes on one host both have a host 0.
                store = PrefixStore(f"scope/{chosen.key}/", side.store)
                gen.guard_channel = build_guard_channel(
                    guard_pg,
                    store,
                    members=chosen.ranks,
                    subgroup=lambda ranks: _scoped_group(gen, "compiler_collectives_guard_leaders", ranks),
                )
        return gen.guard_channel


def choose_scope(gen: Generation, chosen: scope_mod.Scope | None) -> bool:
    """``compiler_collectives.scope()``: refuse after a compile (``ScopeError``); otherwise
    remember the choice. True where a setup check is due now (``agree_scope``): a scope was
    chosen and this generation has not agreed yet."""
    gen.notice()
    with gen.lock:
        rank = dist.get_rank()
        if gen.agreed or gen.compile_pg is not None or gen.guard_channel is not None:
            now_scope = gen.scope
            same = (now_scope is None and chosen is None) or (
                now_scope is not None and chosen is not None and now_scope.ranks == chosen.ranks
            )
            if same:
                return False
            now = "the whole world" if now_scope is None else f"ranks {now_scope.render()}"
            raise ScopeError(
                f"compiler_collectives.scope() on rank {rank}: called after this rank's agreements "
                f"started (they span {now}): a compile with compiler or guard collectives on, or "
                "an earlier scope() call. Call scope() on every rank before the first compile; "
                "to change it later, call compiler_collectives.reset() on every rank first.",
                kind="scope",
                rank=rank,
            )
        scope_mod.choose(chosen)
        return chosen is not None


def agree_scope(gen: Generation) -> None:
    """The setup check of ``scope()``'s choice, run now (every rank is before its first compile
    here, so nobody's first compile waits for it); nothing if this generation agreed meanwhile
    (a first group made on another thread ran it, with the same choice). Raises what stopped it."""
    gen.notice()
    with gen.lock:
        if gen.agreed:
            return
        rank = dist.get_rank()
        try:
            side = side_channel(gen)
            _agree(gen, side, scope_mod.effective(rank, dist.get_world_size()))
        except StoreUnresponsive as e:
            raise CollectiveTimeoutError(
                f"compiler_collectives.scope() on rank {rank}: {e}", kind="setup", rank=rank
            ) from None


def _agree(gen: Generation, side: SideChannel, chosen: scope_mod.Scope | None) -> None:
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
    gen.scope = chosen
    gen.agreed = True
    if chosen is not None:
        log.info("rank %d: agreements run within scope %s (%s)", side.rank, chosen.render(), chosen.source)


def _new_group(gen: Generation, tag: str, kind: str) -> Any:
    """A group of ours, after this generation's setup check or our own rendezvous; raises what
    stopped it (a timeout, absent ranks, a report this rank heard, the setup check's verdict)."""
    timeout_s = config.settings.timeout_s
    rank = dist.get_rank()
    try:
        side = side_channel(gen)
        if not gen.agreed:
            # The setup agreement is also this generation's first rendezvous.
            _agree(gen, side, scope_mod.effective(rank, dist.get_world_size()))
        else:
            # Our own rendezvous first: group creation would otherwise wait on the
            # store with whatever timeout it picks and could not say who is missing.
            absent = rendezvous.meet(
                side.store, side.rank, side.peers(), tag, timeout_s, heard=functools.partial(_stopped_by, kind, rank)
            )
            if absent:
                raise _absent_error(gen, side, absent, kind, rank, timeout_s)
    except StoreUnresponsive as e:
        raise CollectiveTimeoutError(
            f"creating the {kind}-collective process group on rank {rank}: {e} "
            "(COMPILER_COLLECTIVES_TIMEOUT). The store lives in the process that created it "
            "(rank 0 under torchrun, or the MASTER_ADDR host): is it stopped, overloaded or gone?",
            kind=kind,
            rank=rank,
        ) from None
    log.debug("creating %s gloo group (timeout %.0fs)", tag, timeout_s)
    if gen.scope is not None:
        return _scoped_group(gen, tag, gen.scope.ranks)
    try:
        # Gloo's own connection set-up waits on the store as long as the store lets it.
        return bounded(
            lambda: dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s), group_desc=tag),
            timeout_s + 5.0,
            f"while creating the {kind}-collective gloo group",
        )
    except StoreUnresponsive as e:
        raise CollectiveTimeoutError(
            f"creating the {kind}-collective process group on rank {rank}: gloo's connection set-up "
            f"did not finish within {timeout_s:.0f}s (COMPILER_COLLECTIVES_TIMEOUT; {e}). A peer "
            "stopped, or the ranks use different stores.",
            kind=kind,
            rank=rank,
        ) from None


def _stopped_by(kind: str, rank: int) -> PeerFailureError | None:
    """Why a rank waiting for its peers to make a group stops early: it heard of a failure (a
    peer that failed before it came reported it, or this rank's own collective failed)."""
    failure = health.latch.first_failure
    if failure is None:
        return None
    where = f"creating the {kind}-collective process group on rank {rank}: stopped waiting for the other ranks"
    return PeerFailureError.stopped_waiting(where, failure, kind=kind, rank=rank)


def _scoped_group(gen: Generation, tag: str, ranks: tuple[int, ...] | list[int]) -> Any:
    """A gloo group of ``ranks`` (this rank among them), made by those ranks only."""
    side = side_channel(gen)
    assert gen.scope is not None
    prefix = f"pg/{gen.scope.key}/{tag}/{'_'.join(map(str, ranks)) if len(ranks) <= 64 else len(ranks)}/"
    store = PrefixStore(prefix, side.store)
    return dist.ProcessGroupGloo(
        store, list(ranks).index(side.rank), len(ranks), datetime.timedelta(seconds=config.settings.timeout_s)
    )


def _absent_error(
    gen: Generation, side: SideChannel, absent: list[int], kind: str, rank: int, timeout_s: float
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
        if gen.scope is None:
            message += " " + SCOPE_HINT
    return CollectiveTimeoutError(message, kind=kind, rank=rank, ranks=tuple(absent))


# rendezvous(side, timeout_s): raises to stop group creation on every rank.
Rendezvous = Callable[[SideChannel, float], None]
_first_rendezvous: Callable[[Any], Rendezvous] | None = None


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


def set_peer_report_handler(handler: PeerReportHandler | None) -> None:
    """Who hears a peer's failure report: the heartbeat thread calls ``handler(own_rank, peer,
    report)`` with the raw ``SideChannel.report_failure`` record of rank ``peer`` (a failure,
    or that it left). The agreements layer registers its failure policy here; registering
    again replaces it. Kept across ``reset`` and into a forked child, as the module is."""
    global _peer_report_handler
    _peer_report_handler = handler


def _heard_report(gen: Generation, own_rank: int, peer: int, report: dict[str, Any]) -> None:
    """Heartbeat thread: rank ``peer`` reported; pass it on as heard, then end this rank's wait in
    the guard's leaders' exchange, if it waits there (its waits are untimed: ``hierarchy``)."""
    handler = _peer_report_handler
    if handler is None:
        log.warning("rank %d heard rank %d's failure report, but no handler is registered", own_rank, peer)
        return
    handler(own_rank, peer, report)
    channel = gen.guard_channel
    if isinstance(channel, ShmGuardChannel) and health.latch.first_failure is not None:
        try:
            channel.interrupt()
        except Exception as e:  # noqa: BLE001 - the wait then ends at the group's timeout
            log.debug("ending the leaders' exchange after rank %d's report: %s", peer, e)
