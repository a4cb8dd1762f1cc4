"""Our own process groups and their store side channel.

Both groups are created lazily from the default group with the gloo backend,
also when the default backend is NCCL, each with the timeout from
``COMPILER_COLLECTIVES_TIMEOUT``. The guard group carries whichever guard
mechanism ``COMPILER_COLLECTIVES_GUARD_TRANSPORT`` selects (see
``hierarchy.build_guard_channel``); the compile group carries byte all-gathers.

Before the first group of a generation exists, the ranks run the first
rendezvous that the agreements layer registered (``set_first_rendezvous``:
the setup agreement, where every rank raises ``SetupMismatchError`` if they
disagree about a version or a setting that must match). What to do when an
exchange fails is policy, and lives above this layer
(``agreements/failure.py``); this module only moves bytes and reports. At
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

from .. import config, health
from ..errors import CollectiveError, CollectiveTimeoutError, PeerFailureError, StoreUnresponsive
from ..health.watchdog import SideChannel, bounded
from . import shm
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

    def _new_group(self, tag: str, kind: str) -> dist.ProcessGroup:
        timeout_s = config.settings.timeout_s
        rank = dist.get_rank()
        try:
            side = self._side_channel()
            if not self._agreed:
                # The setup agreement is also this generation's first rendezvous.
                prepare = _first_rendezvous
                if prepare is not None:
                    # Prepared on the caller's thread (it reads switches such as
                    # Dynamo's config, which can be thread-local); only the store
                    # exchange runs on the bounded helper thread.
                    rendezvous = prepare()
                    bounded(lambda: rendezvous(side.store, side.rank, side.world, timeout_s),
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
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s), group_desc=tag)

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

    def built_guard_channel(self) -> Any:
        """The guard channel if this generation built one already, else None (never builds)."""
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

Rendezvous = Callable[[Any, int, int, float], None]
_first_rendezvous: Callable[[], Rendezvous] | None = None


def set_first_rendezvous(prepare: Callable[[], Rendezvous] | None) -> None:
    """What every rank runs before the first group of a generation.

    ``prepare()`` runs on the caller's thread and returns
    ``rendezvous(store, rank, world, timeout_s)``, which runs bounded by the
    timeout. The agreements layer registers the setup agreement here; it
    raises to stop group creation on every rank.
    """
    global _first_rendezvous
    _first_rendezvous = prepare


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
