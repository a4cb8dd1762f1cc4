"""Our own process groups, their store side channel, and the failure procedure.

Both groups are created lazily from the default group with the gloo backend,
also when the default backend is NCCL, each with the timeout from
``COMPILER_COLLECTIVES_TIMEOUT``. The guard group carries whichever guard
mechanism ``COMPILER_COLLECTIVES_GUARD_TRANSPORT`` selects (see
``hierarchy.build_guard_channel``); the compile group carries byte all-gathers.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
from typing import Any, Callable

import torch.distributed as dist

from .. import config, health
from ..errors import CollectiveDesyncError, CollectiveError, CollectiveTimeoutError
from ..watchdog import Diagnosis, SideChannel, diagnose_with_deadline
from .hierarchy import build_guard_channel

log = logging.getLogger("compiler_collectives.transport")


class Groups:
    """Lazily created gloo groups and their side channel, rebuilt if the default group changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._world: object | None = None
        self._generation = 0
        self._compile_pg: dist.ProcessGroup | None = None
        self._guard_pg: dist.ProcessGroup | None = None
        self._guard_channel: Any = None  # GlooGuardChannel or ShmGuardChannel
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
            self.side = SideChannel(dist.get_rank(), dist.get_world_size(), self._generation, self._progress)
            self.side.start(on_peer_failure=_peer_failed)
        return self.side

    def _new_group(self, tag: str, kind: str) -> dist.ProcessGroup:
        timeout_s = config.settings.timeout_s
        side = self._side_channel()
        # Our own rendezvous first: group creation would otherwise wait on the
        # store with whatever timeout it picks and could not say who is missing.
        absent = side.rendezvous(tag, timeout_s)
        if absent:
            err = CollectiveTimeoutError(
                f"creating the {kind}-collective process group on rank {side.rank}: rank(s) "
                f"{absent} did not arrive within {timeout_s:.0f}s (COMPILER_COLLECTIVES_TIMEOUT). "
                "They are stuck, much slower, crashed, or never compile this code (compiler "
                "collectives need every rank to compile the same frames).",
                kind=kind, rank=side.rank, ranks=tuple(absent),
            )
            health.poison(err)
            raise err
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
        return out

    def abort(self) -> None:
        """Abort our groups so peers blocked in our collectives fail now, not at the timeout."""
        for pg in (self._compile_pg, self._guard_pg):
            if pg is not None:
                try:
                    pg.abort()
                except Exception as e:  # noqa: BLE001
                    log.debug("aborting a group failed: %s", e)

    def shutdown(self) -> None:
        """At interpreter exit: stop the heartbeat thread and wait for it (bounded).

        A daemon thread still inside a c10d store call when the interpreter
        finalizes is ended by CPython as it takes the GIL back, from inside a
        pybind11 frame that may not unwind: the process then dies of SIGABRT
        ("terminate called without an active exception") after the user's
        code finished. Joining it first avoids that.
        """
        side = self.side
        if side is not None:
            side.stop(join_s=5.0)

    def forget(self) -> None:
        """Drop our groups; the next collective creates new ones (all ranks must do this together)."""
        with self._lock:
            self._drop()
            self._world = None
            self._generation += 1

    def fail(self, error: CollectiveError, *, seq: int | None) -> CollectiveError:
        """The failure procedure: report, abort, diagnose; returns the error to raise (maybe re-typed)."""
        side = self.side
        if side is not None:
            try:
                side.report_failure(error.kind or "?", seq, str(error))
            except Exception as e:  # noqa: BLE001
                log.debug("could not report the failure on the store: %s", e)
        channel = self._guard_channel
        if channel is not None and side is not None:
            channel.publish_failure(side.rank)  # same-host peers stop waiting within microseconds
        self.abort()
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
    """Heartbeat thread: a peer reported a failure; refuse our next collective."""
    first_line = message.splitlines()[0] if message else "no message"
    health.poison(CollectiveError(f"rank {rank} reported a collective failure: {first_line}"))


groups = Groups()
atexit.register(groups.shutdown)
