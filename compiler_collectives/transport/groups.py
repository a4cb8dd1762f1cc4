"""Our own process groups, their store side channel, and the failure procedure.

Both groups are created lazily from the default group with the gloo backend,
also when the default backend is NCCL, each with the timeout from
``COMPILER_COLLECTIVES_TIMEOUT``. The guard group carries whichever guard
mechanism ``COMPILER_COLLECTIVES_GUARD_TRANSPORT`` selects (see
``hierarchy.build_guard_channel``); the compile group carries byte all-gathers.

Before the first group of a generation exists, the ranks run the setup
agreement (``setup_agreement``): every rank raises ``SetupMismatchError``
there if they disagree about a version or a setting that must match. At
interpreter exit our heartbeat thread is stopped and our groups destroyed
(``shutdown``), so nothing of ours is left running while Python finalizes.

Two changes of process model drop everything of a generation at once:

* ``default_group_destroyed``: ``destroy_process_group()`` of the default
  group (the c10d seam calls it). Our groups, store and heartbeat go with it,
  so that a later ``init_process_group`` (on the same port, say) starts a new
  generation from nothing, as ``compiler_collectives.reset()`` would.
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
import threading
from typing import Any, Callable

import torch.distributed as dist

from .. import config, health, setup_agreement
from ..errors import (
    CollectiveDesyncError,
    CollectiveError,
    CollectiveTimeoutError,
    PeerFailureError,
    WireFormatError,
)
from ..watchdog import Diagnosis, SideChannel, StoreUnresponsive, bounded, diagnose_with_deadline
from . import shm
from .gloo import PROTOCOL_VERSION, translate_failure
from .hierarchy import build_guard_channel, host_key

log = logging.getLogger("compiler_collectives.transport")


# What a forked child inherited from its parent: kept alive, never used (see the docstring).
_inherited: list[Any] = []


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
        self._inherited_world: object | None = None  # a forked child's parent's default group
        self._told_child = False
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

    def available(self) -> bool:
        """Whether our collectives run in this process: a default group exists and is its own."""
        if not (dist.is_available() and dist.is_initialized()):
            return False
        if self._inherited_world is not None and dist.group.WORLD is self._inherited_world:
            if not self._told_child:
                self._told_child = True
                log.info("compiled code runs in process %d, forked from a rank: compiler and guard "
                         "collectives do not run here (a forked child is not a rank of the job)", os.getpid())
            return False
        return True

    def after_fork_in_child(self) -> None:
        """In a forked child: forget the parent's generation without touching any of it."""
        _inherited.append((self._world, self._compile_pg, self._guard_pg, self._guard_channel, self.side))
        self._lock = threading.Lock()  # another thread of the parent may have held it at the fork
        self._inherited_world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        self._world = None
        self.side = None
        self._compile_pg = self._guard_pg = self._guard_channel = None
        self._agreed = False
        self._told_child = False

    def default_group_destroyed(self) -> None:
        """``destroy_process_group()`` ended the default group: drop this generation now.

        Torch has shut our groups down with it. What is left holding the old
        store (the heartbeat, our group objects) goes now, not at the next
        collective: the store's server must be gone before a new
        ``init_process_group`` binds its port again (the caller collects the
        reference cycles some of them sit in, once every holder let go).
        """
        with self._lock:
            side = self.side
            self._drop()
            self._world = None
            self._generation += 1
        if side is not None and not side.stop(join_s=2.0):
            log.debug("the heartbeat thread did not end within 2s of destroy_process_group")

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
            side.start(on_peer_failure=functools.partial(_peer_failed, side.rank))
            self.side = side
        return self.side

    def _new_group(self, tag: str, kind: str) -> dist.ProcessGroup:
        timeout_s = config.settings.timeout_s
        rank = dist.get_rank()
        try:
            side = self._side_channel()
            if not self._agreed:
                # The setup agreement is also this generation's first rendezvous.
                record = setup_agreement.local_record({
                    "transport protocol version": PROTOCOL_VERSION,
                    "shared-memory layout version": shm.LAYOUT_VERSION,
                })
                bounded(lambda: setup_agreement.agree(side.store, side.rank, side.world, timeout_s, record),
                        timeout_s + 5.0, "during the setup check")
                self._agreed = True
            else:
                # Our own rendezvous first: group creation would otherwise wait on the
                # store with whatever timeout it picks and could not say who is missing.
                absent = side.rendezvous(tag, timeout_s)
                if absent:
                    raise CollectiveTimeoutError(
                        f"creating the {kind}-collective process group on rank {rank}: rank(s) "
                        f"{absent} did not arrive within {timeout_s:.0f}s (COMPILER_COLLECTIVES_TIMEOUT). "
                        "They are stuck, much slower, crashed, or never compile this code (compiler "
                        "collectives need every rank to compile the same frames)"
                        + (", or turned guard collectives on later than this rank or not at all "
                           "(the switch must be the same on every rank)" if kind == "guard" else "") + ".",
                        kind=kind, rank=rank, ranks=tuple(absent),
                    )
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
        try:
            # Gloo's own connection set-up waits on the store as long as the store lets it.
            return bounded(lambda: dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s),
                                                  group_desc=tag),
                           timeout_s + 5.0, f"while creating the {kind}-collective gloo group")
        except StoreUnresponsive as e:
            err = CollectiveTimeoutError(
                f"creating the {kind}-collective process group on rank {rank}: gloo's connection set-up "
                f"did not finish within {timeout_s:.0f}s (COMPILER_COLLECTIVES_TIMEOUT; {e}). A peer "
                "stopped, or the ranks use different stores.", kind=kind, rank=rank)
            health.poison(err)
            raise err from None

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
                self._guard_channel = build_guard_channel(self._guard_pg, self._side_channel().store)
            return self._guard_channel

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
        if dist.is_available() and dist.is_initialized():
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
                side.report_failure(error.kind or "?", seq, str(error), ranks=error.ranks)
            except Exception as e:  # noqa: BLE001 - StoreUnresponsive or a store error
                log.warning("rank %d could not report its failure on the c10d store (%s); peers on "
                            "other hosts learn of it only when they time out", side.rank, e)
        diagnosis = diagnose_with_deadline(side, deadline_s=2.5 * config.settings.heartbeat_s + 2.0)
        explained = _explain(error, diagnosis)
        if side is not None and explained is not error:
            try:  # peers that read the report from now on name the ranks the diagnosis found
                side.report_failure(explained.kind or "?", seq, str(explained), ranks=explained.ranks, update=True)
            except Exception as e:  # noqa: BLE001 - the first report stands
                log.debug("rank %d could not update its failure report: %s", side.rank, e)
        return explained

    def leave(self, what: str, seq: int | None, kind: str = "guard") -> None:
        """This rank leaves mid-collective (its own code raised): tell the peers, in those words.

        Not a failure: nothing is published on the shared-memory failure word
        and nothing is diagnosed. Peers hear of it through the store within
        about a heartbeat and stop waiting for this rank.
        """
        side = self.side
        if side is None:
            return
        try:
            side.report_failure(kind, seq, what, ranks=(side.rank,), left=True)
        except Exception as e:  # noqa: BLE001 - StoreUnresponsive or a store error
            log.warning("rank %d could not tell the other ranks that it left (%s)", side.rank, e)

    def explain_report(self, error: PeerFailureError) -> PeerFailureError:
        """A peer's report heard through the store, naming the absent rank(s) where it names none
        (the reporter sends before its own diagnosis): this rank's own short diagnosis."""
        if error.ranks and error.ranks != getattr(error, "reported_by", ()):
            return error
        diagnosis = diagnose_with_deadline(self.side, deadline_s=2.5 * config.settings.heartbeat_s + 1.0,
                                           until_absent=True)
        if diagnosis is None or not diagnosis.absent:
            return error
        absent = [p for p in diagnosis.peers if p.state == "absent"]
        new = PeerFailureError(
            f"{error}\nRanks not in the job:\n" + "\n".join("  " + p.describe() for p in absent),
            kind=error.kind, rank=error.rank, seq=error.seq, frame=error.frame,
            ranks=tuple(p.rank for p in absent),
        )
        new.reported_by = getattr(error, "reported_by", ())  # type: ignore[attr-defined]
        return new


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


def _peer_failed(own_rank: int, peer: int, report: dict[str, Any]) -> None:
    """Heartbeat thread: a peer reported a failure (or that it left); refuse our next
    collective, and make a wait in progress in one of our collectives stop."""
    message = report.get("message")
    lines = message.splitlines() if isinstance(message, str) and message else ["no message"]
    if report.get("left") is True:
        err = PeerFailureError(f"rank {peer} left the job: {lines[0]}", rank=own_rank, ranks=(peer,))
    else:
        named = report.get("ranks")
        culprits = tuple(r for r in named if type(r) is int and 0 <= r < 1 << 20) if isinstance(named, list) else ()
        # The lines of the report that say what became of each rank it names: the cause.
        causes = [line for line in lines[1:] if any(line.strip().startswith(f"rank {r}:") for r in culprits)]
        naming = f" naming rank(s) {list(culprits)}" if culprits else ""
        err = PeerFailureError(
            f"rank {peer} reported a collective failure{naming}: {lines[0]}"
            + "".join(f"\n{line}" for line in causes),
            rank=own_rank, ranks=culprits or (peer,),
        )
    err.reported_by = (peer,)  # type: ignore[attr-defined]
    health.poison_from_peer(err)


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
health.explainer = groups.explain_report
