"""Our own process groups and the two collectives we run on them.

Both groups are created lazily from the default group with the gloo backend,
also when the default backend is NCCL: they live on the host, so they never
queue behind the user's collectives on other groups and never touch CUDA
streams or devices. Each has the timeout from ``COMPILER_COLLECTIVES_TIMEOUT``.

* ``all_gather_bytes``: variable-length byte payloads, one all-gather when
  every payload fits the inline slot, two when one does not. No pickle, no
  numpy: bytes go in through ``torch.frombuffer`` and out through ``ctypes``.
* ``GuardChannel.agree``: the guard collective's fast path, one all-reduce
  (MIN) of a preallocated three-element int64 tensor.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import struct
import threading
from typing import Callable

import torch
import torch.distributed as dist

from . import config
from .errors import (
    CollectiveError,
    CollectiveTimeoutError,
    PeerFailureError,
    WireFormatError,
)

log = logging.getLogger("compiler_collectives.transport")

_LEN = struct.Struct("<Q")  # payload length header of each slot


class Groups:
    """Lazily created gloo groups, rebuilt if the default group changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._world: object | None = None
        self._compile_pg: dist.ProcessGroup | None = None
        self._guard_pg: dist.ProcessGroup | None = None
        self._guard_channel: GuardChannel | None = None

    def _check_world(self) -> None:
        world = dist.group.WORLD
        if world is not self._world:
            # A new init_process_group (or a destroy) invalidates our groups.
            self._world = world
            self._compile_pg = None
            self._guard_pg = None
            self._guard_channel = None

    @staticmethod
    def available() -> bool:
        return dist.is_available() and dist.is_initialized()

    def _new_group(self, tag: str) -> dist.ProcessGroup:
        timeout = datetime.timedelta(seconds=config.settings.timeout_s)
        log.debug("creating %s gloo group (timeout %.0fs)", tag, config.settings.timeout_s)
        return dist.new_group(backend="gloo", timeout=timeout, group_desc=tag)

    def compile_pg(self) -> dist.ProcessGroup:
        with self._lock:
            self._check_world()
            if self._compile_pg is None:
                self._compile_pg = self._new_group("compiler_collectives_compile")
            return self._compile_pg

    def guard_channel(self) -> "GuardChannel":
        with self._lock:
            self._check_world()
            if self._guard_channel is None:
                self._guard_pg = self._new_group("compiler_collectives_guard")
                self._guard_channel = GuardChannel(self._guard_pg)
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

    def forget(self) -> None:
        with self._lock:
            self._world = None
            self._compile_pg = None
            self._guard_pg = None
            self._guard_channel = None


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


class GuardChannel:
    """The guard collective's transport: one MIN all-reduce per call.

    The tensor holds ``[hit, seq, -seq]``; after the MIN all-reduce it holds
    ``[all hit, min seq, -max seq]``, so every rank learns both whether anyone
    missed and whether all ranks are at the same call number.
    """

    __slots__ = ("pg", "_tensor", "_opts", "_list")

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg = pg
        self._tensor = torch.zeros(3, dtype=torch.int64)
        self._list = [self._tensor]
        self._opts = dist.AllreduceOptions()
        self._opts.reduceOp = dist.ReduceOp.MIN

    def agree(self, hit: bool, seq: int) -> tuple[bool, int, int]:
        """Returns (every rank hit, lowest seq, highest seq)."""
        t = self._tensor
        t[0] = 1 if hit else 0
        t[1] = seq
        t[2] = -seq
        # ProcessGroup.allreduce directly: the dist.all_reduce wrapper adds
        # checks and bookkeeping we would pay on every compiled call.
        self.pg.allreduce(self._list, self._opts).wait()
        all_hit, lo, neg_hi = t.tolist()
        return all_hit == 1, lo, -neg_hi
