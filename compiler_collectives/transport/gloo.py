"""The gloo mechanism: byte all-gather for the compiler collective, and the
guard collective's all-reduce path (``COMPILER_COLLECTIVES_GUARD_TRANSPORT=gloo``,
and the fallback where shared memory cannot be used).

* ``all_gather_bytes``: variable-length byte payloads, one all-gather when
  every payload fits the inline slot, two when one does not. No pickle, no
  numpy: bytes go in through ``torch.frombuffer`` and out through ``ctypes``.
  Each slot's header carries the payload's length and the exchange's phase,
  so two ranks in different exchanges (the input exchange and the
  end-of-trace exchange of a compile) never pair up silently. The caller
  numbers its exchanges and names them (``Phases``): this layer moves the
  numbers and quotes the names, and knows no exchange of its own.
* ``wait``: every wait on a gloo operation of ours runs in slices; between
  slices it stops with ``PeerFailureError`` once this rank knows that a peer
  failed (the heartbeat thread poisons the rank on a peer's store report).
  Gloo's ``abort`` does nothing, so this is how a blocked rank learns of a
  failure within seconds instead of at ``COMPILER_COLLECTIVES_TIMEOUT``.
  Gloo ends an operation at the group's timeout itself, but only on its own
  threads (a forked child has none): ``wait`` gives up on its own a little
  after ``COMPILER_COLLECTIVES_TIMEOUT``, so no wait of ours is unbounded.
* ``GlooGuardChannel.agree``: one all-reduce (MIN) of a preallocated
  two-element int64 tensor (one element without the desync check).
* ``translate_failure``: a gloo ``RuntimeError`` turned into one of our errors,
  naming the peers whose connection broke where the caller looked
  (``probes.broken_peers``; the connection probes live in ``probes``).
* ``started``: how every operation of ours off the guard path is started:
  outside torch's Python dispatcher. Our callers exchange inside AOTAutograd
  too, where that dispatcher is on; an operation started there keeps
  the GIL while gloo's ``enqueue`` waits for the queue's lock, which a gloo
  worker holds while it waits for the GIL to free the previous operation's
  tensors: a deadlock (seen in torch's own ``_sync_decision_cross_ranks``). The Dynamo seam hands
  torch's ``no_python_dispatcher`` at install (``torch_view``). The
  guard collective starts at a compiled call, never inside a compile, and
  allocates nothing: it does not take it.

Groups live on the host, so they never queue behind the user's collectives on
other groups and never touch CUDA streams or devices.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import logging
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import config, health, torch_view
from ..errors import (
    CollectiveDesyncError,
    CollectiveError,
    CollectiveTimeoutError,
    PeerFailureError,
    WireFormatError,
    describe,
)

log = logging.getLogger("compiler_collectives.transport.gloo")

PROTOCOL_VERSION = 2
"""Bumped whenever what our transports put on the wire changes (slot headers, guard
words). Ranks compare it in the setup agreement, before any of it travels."""

_LEN = struct.Struct("<Q")  # payload length header of each slot
_PHASE = struct.Struct("<Q")  # then the exchange's phase
HEADER_BYTES = _LEN.size + _PHASE.size


def started(op: Callable[..., Any], *args: Any) -> Any:
    """``op(*args)`` (a process group's operation), started outside torch's Python dispatcher
    (``torch_view``'s ``enqueue_context``, torch's ``no_python_dispatcher``); its work."""
    with torch_view.view.enqueue_context():
        return op(*args)


# The phase of a byte all-gather whose caller named none.
PHASE_UNSPECIFIED = 0
_UNSPECIFIED_NAME = "a byte all-gather"


@dataclasses.dataclass(frozen=True)
class Phases:
    """How a caller names the exchanges it runs on one group, for the error raised where ranks
    are found in different ones (``all_gather_bytes``, ``HostTree``): each exchange's phase number
    -> what that exchange is, and what the ranks must do about it. Only the numbers travel."""

    names: Mapping[int, str] = dataclasses.field(default_factory=dict)
    advice: str = ""


WAIT_SLICE = datetime.timedelta(milliseconds=200)
WAIT_MARGIN_S = 5.0  # past COMPILER_COLLECTIVES_TIMEOUT: gloo's own timeout error comes first


def wait(work: Any, describe: Callable[[], str] | None = None) -> None:
    """Wait for a gloo work; between slices of ``WAIT_SLICE``, stop if a peer is known to have failed.

    A failed operation raises gloo's own error (callers translate it). A
    timed-out slice leaves the operation running. The operation may complete
    between the slice's timeout and our look at it: then a plain ``wait()``
    returns its own outcome at once (success, or gloo's error). The first
    slice costs what a plain ``wait()`` does. Past ``COMPILER_COLLECTIVES_TIMEOUT``
    and a margin it raises ``CollectiveTimeoutError`` whatever gloo does.
    """
    deadline = None
    while True:
        try:
            work.wait(WAIT_SLICE)
            return
        except RuntimeError:
            if work.is_completed():
                work.wait()
                return
        failure = health.latch.first_failure
        if failure is not None:
            where = describe() if describe is not None else "a collective"
            # Keeps who reported it: the failure procedure then quotes that report, never re-types it.
            raise PeerFailureError.stopped_waiting(f"{where}: stopped waiting", failure)
        now = time.monotonic()
        if deadline is None:
            deadline = now + config.settings.timeout_s + WAIT_MARGIN_S - WAIT_SLICE.total_seconds()
        elif now >= deadline:
            where = describe() if describe is not None else "a collective"
            raise CollectiveTimeoutError(
                f"{where} timed out: no answer within {config.settings.timeout_s:.0f}s "
                "(COMPILER_COLLECTIVES_TIMEOUT), and gloo did not end the operation itself (its "
                "threads are gone: is this a forked child using its parent's process group?). "
                "A rank is stuck, much slower, or took another code path."
            )


def is_connection_failure(error: BaseException) -> bool:
    """Whether gloo's ``error`` says a connection broke (not a timeout)."""
    lowered = str(error).lower()
    if "timed out" in lowered or "timeout" in lowered:
        return False
    return any(w in lowered for w in ("connection", "closed", "reset", "broken pipe"))


def translate_failure(
    error: BaseException,
    *,
    kind: str,
    describe: Callable[[], str],
    rank: int | None,
    seq: int | None,
    frame: str | None,
    broken: dict[int, str] | None = None,
) -> CollectiveError:
    """Turn a gloo RuntimeError into one of our errors with an actionable message. ``broken``:
    the peers whose connection to this rank broke (``broken_peers``), named where the error is one."""
    text = str(error)
    lowered = text.lower()
    where = describe()
    if "timed out" in lowered or "timeout" in lowered:
        return CollectiveTimeoutError(
            f"{where} timed out after {config.settings.timeout_s:.0f}s waiting for the other "
            f"ranks (gloo: {text.splitlines()[0] if text else type(error).__name__}). A rank is "
            "stuck, much slower, or took another code path. Raise COMPILER_COLLECTIVES_TIMEOUT "
            "if ranks legitimately compile at very different speeds.",
            kind=kind,
            rank=rank,
            seq=seq,
            frame=frame,
        )
    if is_connection_failure(error) and broken:
        peers = sorted(broken)
        who = f"rank {peers[0]}" if len(peers) == 1 else f"ranks {peers}"
        return PeerFailureError(
            f"{where} failed: the connection to {who} broke ({broken[peers[0]]}). {who.capitalize()} most "
            "likely crashed or was killed; check its log and exit status.",
            kind=kind,
            rank=rank,
            seq=seq,
            frame=frame,
            ranks=tuple(peers),
        )
    if is_connection_failure(error):
        return PeerFailureError(
            f"{where} failed: a peer's connection broke (gloo: {text.splitlines()[0]}). "
            "A peer process most likely crashed or was killed; check the other ranks' logs.",
            kind=kind,
            rank=rank,
            seq=seq,
            frame=frame,
        )
    return CollectiveError(
        f"{where} failed: {type(error).__name__}: {text}",
        kind=kind,
        rank=rank,
        seq=seq,
        frame=frame,
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
    phase: int = PHASE_UNSPECIFIED,
    phases: Phases | None = None,
    describe: Callable[[], str] | None = None,
    members: Sequence[int] | None = None,
) -> tuple[list[bytes], int]:
    """All-gather one byte string per rank; returns (payloads in rank order, rounds).

    Every rank sees every length and phase after the first round, so the
    decision to run a second round, and any error, is the same on every rank.
    Raises ``CollectiveDesyncError`` if the ranks are in different phases, and
    ``WireFormatError`` (naming the sender) if a rank announces more than
    ``max_bytes``; nothing of that size is ever allocated. ``phase``: this exchange's number
    (in every slot's header); ``phases``: how the caller names its exchanges in that error.
    """
    world = pg.size()
    named = list(members) if members is not None else list(range(world))  # global rank of each member
    n = len(payload)
    slot = HEADER_BYTES + slot_bytes
    buf = bytearray(slot)
    _LEN.pack_into(buf, 0, n)
    _PHASE.pack_into(buf, _LEN.size, phase)
    if n <= slot_bytes:
        buf[HEADER_BYTES : HEADER_BYTES + n] = payload
    send = torch.frombuffer(buf, dtype=torch.uint8)
    recv = [torch.empty(slot, dtype=torch.uint8) for _ in range(world)]
    wait(started(pg.allgather, [recv], [send]), describe)

    headers = [_tensor_to_bytes(t, HEADER_BYTES) for t in recv]
    lengths = [_LEN.unpack_from(h, 0)[0] for h in headers]
    at = [_PHASE.unpack_from(h, _LEN.size)[0] for h in headers]  # each rank's phase
    if len(set(at)) > 1:
        names = {PHASE_UNSPECIFIED: _UNSPECIFIED_NAME, **(phases.names if phases is not None else {})}
        lines = "\n".join(f"  rank {named[r]}: {names.get(p, f'unknown phase {p}')}" for r, p in enumerate(at))
        where = describe() if describe is not None else f"byte all-gather on rank {named[pg.rank()]}"
        advice = (
            phases.advice
            if phases is not None and phases.advice
            else "Every rank must run the same exchanges in the same order."
        )
        raise CollectiveDesyncError(
            f"{where}: the ranks are in different exchanges of a compile:\n{lines}\nNothing was applied. {advice}",
            kind="compiler",
            ranks=tuple(named[r] for r, p in enumerate(at) if p != at[pg.rank()]),
        )
    for sender, length in enumerate(lengths):
        if length > max_bytes:
            raise WireFormatError(
                f"rank {named[sender]} announced a {length}-byte compiler-collective payload, over "
                f"the limit of {max_bytes} bytes (COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES); "
                "raise the limit on every rank if the state is legitimately that large",
                kind="compiler",
                ranks=(named[sender],),
            )
    longest = max(lengths)
    if longest <= slot_bytes:
        return [_tensor_to_bytes(t, length, HEADER_BYTES) for t, length in zip(recv, lengths)], 1

    # Second round, sized exactly for the longest payload.
    big = bytearray(longest)
    big[:n] = payload
    send2 = torch.frombuffer(big, dtype=torch.uint8)
    recv2 = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    wait(started(pg.allgather, [recv2], [send2]), describe)
    return [_tensor_to_bytes(t, length) for t, length in zip(recv2, lengths)], 2


def byte_tensor(data: bytes | int) -> torch.Tensor:
    """A contiguous uint8 CPU tensor: a copy of ``data``, or ``data`` bytes to receive into.
    Its slices are what ``start_send``/``start_recv`` move piece by piece."""
    if isinstance(data, int):
        return torch.empty(data, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def start_send(pg: dist.ProcessGroup, piece: torch.Tensor, dst: int, tag: int) -> Any:
    """Start sending ``piece`` (a contiguous slice of a ``byte_tensor``) to group rank ``dst``."""
    return started(pg.send, [piece], dst, tag)


def start_recv(pg: dist.ProcessGroup, piece: torch.Tensor, src: int, tag: int) -> Any:
    """Start receiving into ``piece`` (a contiguous slice of a ``byte_tensor``) from group rank ``src``."""
    return started(pg.recv, [piece], src, tag)


def tensor_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor, without a copy (hash them; copy with ``bytes()``)."""
    n = t.numel()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B") if n else memoryview(b"")


_KEY_MASK = (1 << 61) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def guard_key(seq: int, site: int) -> int:
    """Mix the call number and the frame identity into one non-negative 61-bit key."""
    return ((site * _GOLDEN) ^ seq) & _KEY_MASK


class _Where:
    """The guard call a ``GlooGuardChannel`` is at, and how its waits describe it."""

    __slots__ = ("rank", "seq")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.seq = 0

    def describe(self) -> str:
        return describe("guard", self.rank, self.seq, None)


class GlooGuardChannel:
    """The guard collective's transport: one MIN all-reduce of two int64 per call.

    Rank r sends ``[2*key_r + hit_r, -key_r]`` where ``key`` mixes its call
    number and the identity of the compiled frame. After MIN, ``[0] >> 1`` is
    the lowest key and ``-[1]`` the highest: equal only if every rank is at
    the same call of the same frame, and then ``[0] & 1`` says whether every
    rank hit. Two elements, not five, because gloo's allreduce cost jumps
    past two or three elements (measured ~145 µs vs ~365 µs on this machine).
    """

    __slots__ = ("_at", "_describe", "_list", "_opts", "_tensor", "_view", "check_desync", "name", "pg", "rank")

    def __init__(self, pg: dist.ProcessGroup, check_desync: bool = True, rank: int | None = None) -> None:
        self.pg = pg
        self.rank = pg.rank() if rank is None else rank  # global: messages name global ranks
        self.name = "gloo"
        self._at = _Where(self.rank)
        # Made once: the fast path allocates nothing. Not a bound method of the channel: that
        # would be a reference cycle, which keeps the group and its store alive after a
        # destroy_process_group until a garbage collection, and the store's port with them.
        self._describe = self._at.describe
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
        self._opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)

    def agree(self, hit: bool, seq: int, site: int = 0) -> tuple[bool, bool]:
        """Returns (every rank hit, every rank at the same call of the same frame)."""
        view = self._view
        self._at.seq = seq
        if not self.check_desync:
            view[0] = 1 if hit else 0
            wait(self.pg.allreduce(self._list, self._opts), self._describe)
            return view[0] == 1, True
        key = ((site * _GOLDEN) ^ seq) & _KEY_MASK
        view[0] = 2 * key + (1 if hit else 0)
        view[1] = -key
        # ProcessGroup.allreduce directly: the dist.all_reduce wrapper adds
        # checks and bookkeeping we would pay on every compiled call. The wait
        # is sliced, so a peer's failure stops it (see ``wait``).
        wait(self.pg.allreduce(self._list, self._opts), self._describe)
        low, neg_high = view[0], view[1]
        in_step = (low >> 1) == -neg_high
        return in_step and bool(low & 1), in_step

    def publish_failure(self, rank: int, left: bool = False) -> None:
        """Nothing to publish on this path: peers learn through the store (see ``wait``)."""

    def describe_all(self, seq: int, site: int) -> list[tuple[int, int]]:
        """Slow path after a mismatch (every rank takes it): each rank's (seq, site)."""
        mine = torch.tensor([seq, site], dtype=torch.int64)
        out = [torch.zeros(2, dtype=torch.int64) for _ in range(self.pg.size())]
        wait(started(self.pg.allgather, [out], [mine]))
        return [(int(t[0]), int(t[1])) for t in out]
