"""Our own process groups and the two collectives we run on them.

Both groups are created lazily from the default group with the gloo backend,
also when the default backend is NCCL: they live on the host, so they never
queue behind the user's collectives on other groups and never touch CUDA
streams or devices. Each has the timeout from ``COMPILER_COLLECTIVES_TIMEOUT``.

* ``all_gather_bytes``: variable-length byte payloads, one all-gather when
  every payload fits the inline slot, two when one does not. No pickle, no
  numpy: bytes go in through ``torch.frombuffer`` and out through ``ctypes``.
* ``GuardChannel.agree``: the guard collective's fast path, one all-reduce
  (MIN) of a preallocated two-element int64 tensor (one element without the
  desync check).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import struct
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import config, health
from .errors import (
    CollectiveDesyncError,
    CollectiveError,
    CollectiveTimeoutError,
    PeerFailureError,
    WireFormatError,
)
from .watchdog import Diagnosis, SideChannel, diagnose_with_deadline

log = logging.getLogger("compiler_collectives.transport")

_LEN = struct.Struct("<Q")  # payload length header of each slot


class Groups:
    """Lazily created gloo groups and their side channel, rebuilt if the default group changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._world: object | None = None
        self._generation = 0
        self._compile_pg: dist.ProcessGroup | None = None
        self._guard_pg: dist.ProcessGroup | None = None
        self._guard_channel: GuardChannel | None = None
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

    def guard_channel(self) -> "GuardChannel":
        with self._lock:
            self._check_world()
            if self._guard_channel is None:
                self._guard_pg = self._new_group("compiler_collectives_guard", "guard")
                self._guard_channel = GuardChannel(self._guard_pg, config.settings.guard_desync_check)
            return self._guard_channel

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


def translate_failure(
    error: BaseException,
    *,
    kind: str,
    describe: Callable[[], str],
    rank: int | None,
    seq: int | None,
    frame: str | None,
) -> CollectiveError:
    """Turn a gloo RuntimeError into one of our errors with an actionable message."""
    text = str(error)
    lowered = text.lower()
    where = describe()
    if "timed out" in lowered or "timeout" in lowered:
        return CollectiveTimeoutError(
            f"{where} timed out after {config.settings.timeout_s:.0f}s waiting for the other "
            f"ranks (gloo: {text.splitlines()[0] if text else type(error).__name__}). A rank is "
            "stuck, much slower, or took another code path. Raise COMPILER_COLLECTIVES_TIMEOUT "
            "if ranks legitimately compile at very different speeds.",
            kind=kind, rank=rank, seq=seq, frame=frame,
        )
    if "connection" in lowered or "closed" in lowered or "reset" in lowered or "broken pipe" in lowered:
        return PeerFailureError(
            f"{where} failed: a peer's connection broke (gloo: {text.splitlines()[0]}). "
            "A peer process most likely crashed or was killed; check the other ranks' logs.",
            kind=kind, rank=rank, seq=seq, frame=frame,
        )
    return CollectiveError(
        f"{where} failed: {type(error).__name__}: {text}",
        kind=kind, rank=rank, seq=seq, frame=frame,
    )


def _tensor_to_bytes(t: torch.Tensor, n: int, offset: int = 0) -> bytes:
    # The tensor is contiguous uint8 on the CPU; copy n bytes out without numpy.
    return ctypes.string_at(t.data_ptr() + offset, n)


def all_gather_bytes(
    pg: dist.ProcessGroup,
    payload: bytes,
    *,
    max_bytes: int,
    slot_bytes: int,
) -> tuple[list[bytes], int]:
    """All-gather one byte string per rank; returns (payloads in rank order, rounds).

    Every rank sees every length after the first round, so the decision to run
    a second round, and any oversize error, is the same on every rank.
    Raises ``WireFormatError`` (naming the sender) if a rank announces more
    than ``max_bytes``; nothing of that size is ever allocated.
    """
    world = pg.size()
    n = len(payload)
    slot = _LEN.size + slot_bytes
    buf = bytearray(slot)
    _LEN.pack_into(buf, 0, n)
    if n <= slot_bytes:
        buf[_LEN.size : _LEN.size + n] = payload
    send = torch.frombuffer(buf, dtype=torch.uint8)
    recv = [torch.empty(slot, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(recv, send, group=pg)

    lengths = [_LEN.unpack(_tensor_to_bytes(t, _LEN.size))[0] for t in recv]
    for sender, length in enumerate(lengths):
        if length > max_bytes:
            raise WireFormatError(
                f"rank {sender} announced a {length}-byte compiler-collective payload, over "
                f"the limit of {max_bytes} bytes (COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES); "
                "raise the limit on every rank if the state is legitimately that large",
                kind="compiler", ranks=(sender,),
            )
    longest = max(lengths)
    if longest <= slot_bytes:
        return [_tensor_to_bytes(t, length, _LEN.size) for t, length in zip(recv, lengths)], 1

    # Second round, sized exactly for the longest payload.
    big = bytearray(longest)
    big[:n] = payload
    send2 = torch.frombuffer(big, dtype=torch.uint8)
    recv2 = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(recv2, send2, group=pg)
    return [_tensor_to_bytes(t, length) for t, length in zip(recv2, lengths)], 2


_KEY_MASK = (1 << 61) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def guard_key(seq: int, site: int) -> int:
    """Mix the call number and the frame identity into one non-negative 61-bit key."""
    return ((site * _GOLDEN) ^ seq) & _KEY_MASK


class GuardChannel:
    """The guard collective's transport: one MIN all-reduce of two int64 per call.

    Rank r sends ``[2*key_r + hit_r, -key_r]`` where ``key`` mixes its call
    number and the identity of the compiled frame. After MIN, ``[0] >> 1`` is
    the lowest key and ``-[1]`` the highest: equal only if every rank is at
    the same call of the same frame, and then ``[0] & 1`` says whether every
    rank hit. Two elements, not five, because gloo's allreduce cost jumps
    past two or three elements (measured ~145 µs vs ~365 µs on this machine).
    """

    __slots__ = ("pg", "check_desync", "_tensor", "_view", "_opts", "_list")

    def __init__(self, pg: dist.ProcessGroup, check_desync: bool = True) -> None:
        self.pg = pg
        # Without the desync check only [hit] travels: one int64.
        self.check_desync = check_desync
        n = 2 if check_desync else 1
        self._tensor = torch.zeros(n, dtype=torch.int64)
        # A ctypes view of the tensor's memory: setting and reading the ints
        # through it costs well under a microsecond, where tensor indexing or
        # torch.tensor(...) + copy_ costs microseconds to tens of them.
        self._view = (ctypes.c_int64 * n).from_address(self._tensor.data_ptr())
        self._list = [self._tensor]
        self._opts = dist.AllreduceOptions()
        self._opts.reduceOp = dist.ReduceOp.MIN

    def agree(self, hit: bool, seq: int, site: int = 0) -> tuple[bool, bool]:
        """Returns (every rank hit, every rank at the same call of the same frame)."""
        view = self._view
        if not self.check_desync:
            view[0] = 1 if hit else 0
            self.pg.allreduce(self._list, self._opts).wait()
            return view[0] == 1, True
        key = ((site * _GOLDEN) ^ seq) & _KEY_MASK
        view[0] = 2 * key + (1 if hit else 0)
        view[1] = -key
        # ProcessGroup.allreduce directly: the dist.all_reduce wrapper adds
        # checks and bookkeeping we would pay on every compiled call.
        self.pg.allreduce(self._list, self._opts).wait()
        low, neg_high = view[0], view[1]
        in_step = (low >> 1) == -neg_high
        return in_step and bool(low & 1), in_step

    def describe_all(self, seq: int, site: int) -> list[tuple[int, int]]:
        """Slow path after a mismatch (every rank takes it): each rank's (seq, site)."""
        mine = torch.tensor([seq, site], dtype=torch.int64)
        out = [torch.zeros(2, dtype=torch.int64) for _ in range(self.pg.size())]
        self.pg.allgather([out], [mine]).wait()
        return [(int(t[0]), int(t[1])) for t in out]
