"""One exchange frame for every agreement that all-gathers a payload.

The compiler collective, the program audit and the recompile reasons all do
the same five things: encode this rank's payload, all-gather every rank's
bytes on a gloo group of ours, decode each rank's payload (naming the sender
if it is bad), check that every rank is in the same exchange, and, if any of
that fails, turn the failure into our error through the failure procedure.
``gather`` is that frame; each agreement passes its decoder and its check
(``same_exchange`` builds the usual one: the same frame at the same step).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch

from .. import config, health
from ..errors import SCOPE_HINT, CollectiveDesyncError, CollectiveError, describe
from ..observations import FrameId
from ..transport import all_gather_bytes, groups
from . import failure
from .phases import ALL_GATHER

E = TypeVar("E")

# ``decode(payload, sender=rank, max_bytes=..., expected_world_size=...)``
Decoder = Callable[..., E]


@dataclasses.dataclass
class Gathered(Generic[E]):
    """Every rank's decoded envelope in rank order, and what the exchange cost."""

    envelopes: list[E]
    payloads: list[bytes]
    rounds: int
    elapsed_s: float

    @property
    def bytes_received(self) -> int:
        return sum(len(p) for p in self.payloads)


def gather(
    pg: Any,
    payload: bytes,
    *,
    kind: str,
    seq: int | None,
    frame: str | None,
    where: Callable[[], str],
    decode: Decoder[E],
    check: Callable[[Sequence[E], int], None] | None = None,
    phase: int = 0,
    profile_as: str | None = None,
) -> Gathered[E]:
    """All-gather ``payload`` on ``pg``; every rank's envelope, checked by ``check(envelopes, rank)``.

    Senders and ``rank`` are global ranks (under a scope the group's members
    are a subset of the world). Any failure raises our error (poisoning this
    rank), chained to what transport saw; a bad payload or a failed check is
    raised identically on every rank, since every rank decodes and checks
    every payload.
    """
    health.latch.check(kind)
    members = groups.member_ranks(pg)
    rank, world = members[pg.rank()], pg.size()
    settings = config.settings
    started = time.perf_counter()
    try:
        with torch.profiler.record_function(profile_as or f"compiler_collectives.{kind}"):
            payloads, rounds = all_gather_bytes(
                pg,
                payload,
                max_bytes=settings.max_payload_bytes,
                slot_bytes=settings.inline_slot_bytes,
                phase=phase,
                phases=ALL_GATHER,
                describe=where,
                members=members,
            )
        envelopes = [
            decode(p, sender=members[i], max_bytes=settings.max_payload_bytes, expected_world_size=world)
            for i, p in enumerate(payloads)
        ]
        if check is not None:
            check(envelopes, rank)
    except RuntimeError as e:  # ours (CollectiveError is one) or gloo's
        err = failure.fail(e, kind=kind, rank=rank, seq=seq, frame=frame, where=where, pg=pg)
        if err is e:
            raise
        raise err from (e.__cause__ if isinstance(e, CollectiveError) else e)
    return Gathered(envelopes, payloads, rounds, time.perf_counter() - started)


T = TypeVar("T")


def framed(
    pg: Any, op: Callable[[], T], *, kind: str, seq: int | None, frame: str | None, where: Callable[[], str]
) -> T:
    """``op()``, an exchange of ours on ``pg`` (a ``HostTree``'s), in ``gather``'s frame: a
    failure is our error, through the failure procedure (this rank poisoned)."""
    health.latch.check(kind)
    members = groups.member_ranks(pg)
    rank = members[pg.rank()]
    try:
        return op()
    except RuntimeError as e:
        err = failure.fail(e, kind=kind, rank=rank, seq=seq, frame=frame, where=where, pg=pg)
        if err is e:
            raise
        raise err from (e.__cause__ if isinstance(e, CollectiveError) else e)


class Sent(Protocol):
    """What every decoded envelope says of the exchange it was sent in."""

    @property
    def rank(self) -> int: ...

    @property
    def seq(self) -> int: ...

    @property
    def frame(self) -> FrameId: ...


S = TypeVar("S", bound=Sent)


def same_exchange(
    kind: str, key: Callable[[S], Hashable], line: Callable[[S], str], problem: str, advice: str
) -> Callable[[Sequence[S], int], None]:
    """A ``check`` for ``gather``: ``CollectiveDesyncError`` unless every envelope has the same ``key``.

    The message lists every rank's ``line`` under ``problem`` and ends with
    ``advice``; the error names the ranks whose key differs from this rank's.
    """

    def check(envelopes: Sequence[S], rank: int) -> None:
        first = key(envelopes[0])
        if all(key(e) == first for e in envelopes):
            return
        mine = next(e for e in envelopes if e.rank == rank)
        lines = "\n".join(line(e) for e in envelopes)
        raise CollectiveDesyncError(
            f"{describe(kind, rank, mine.seq, str(mine.frame))}: {problem}:\n{lines}\n{advice}"
            + ("" if groups.scope() is not None else " " + SCOPE_HINT),
            ranks=tuple(e.rank for e in envelopes if key(e) != key(mine)),
        )

    return check
