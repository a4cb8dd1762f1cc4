"""Why every rank recompiles after the guard collective agreed on a miss.

A rank whose own guards passed but that recompiles because another rank
missed would otherwise record no reason (Dynamo finds no failing guard on it).
So, on the slow path only, once per agreed miss, at the start of the compile
that follows, every rank sends the guard-failure reasons Dynamo computed for
it (none if it hit) in one all-gather; each rank then records:

* a rank that hit: ``forced by the guard collective: rank 3 missed: <its reason>``;
* a rank that missed: its own reasons, then the other ranks that missed.

The seams module calls ``exchange`` where Dynamo computes its recompile
reasons and records the result where Dynamo records them; the exchange's
record (``ReasonsExchange``) carries what the ledger's readers write into the
``guard_collective`` artifact. The guard collective's fast path is untouched.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from .. import health
from ..errors import CollectiveDesyncError, describe
from ..ledger import ledger
from ..records import ReasonsExchange
from ..transport import groups
from . import exchange as exchange_frame
from . import wire

log = logging.getLogger("compiler_collectives.guard")

FORCED_PREFIX = "forced by the guard collective"
# How many missing ranks one reason names before "and N more".
_MAX_RANKS_NAMED = 8
# How much of each missing rank's reason goes into another rank's line.
_MAX_QUOTED_CHARS = 500


@dataclasses.dataclass
class Shared:
    """One agreed miss, as every rank saw it (but ``reasons``, which is this rank's)."""

    seq: int
    rank: int
    world_size: int
    this_rank_missed: bool
    missed: dict[int, list[str]]  # rank -> its reasons, for every rank that missed
    reasons: list[str]  # what this rank records as its recompile reasons
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    elapsed_s: float = 0.0


def _quoted(reasons: list[str]) -> str:
    if not reasons:
        return "no guard-failure reason found"
    first = reasons[0].strip()
    return first if len(first) <= _MAX_QUOTED_CHARS else first[:_MAX_QUOTED_CHARS] + "..."


def _ranks_text(missed: dict[int, list[str]], fmt: str) -> str:
    ranks = sorted(missed)
    shown = [fmt.format(rank=r, reason=_quoted(missed[r])) for r in ranks[:_MAX_RANKS_NAMED]]
    if len(ranks) > _MAX_RANKS_NAMED:
        rest = ranks[_MAX_RANKS_NAMED:]
        shown.append(f"and {len(rest)} more rank(s) missed: {rest}")
    return "; ".join(shown)


def recorded_reasons(rank: int, missed: dict[int, list[str]], own: list[str]) -> list[str]:
    """The recompile reasons this rank records, given every missing rank's reasons."""
    others = {r: v for r, v in missed.items() if r != rank}
    if rank not in missed:
        return [f"{FORCED_PREFIX}: " + _ranks_text(others, "rank {rank} missed: {reason}")]
    out = list(own)
    if others:
        out.append("the guard collective saw other ranks miss too: " + _ranks_text(others, "rank {rank}: {reason}"))
    return out


def exchange(pg: Any, *, seq: int, missed: bool, own: list[str], frame: str | None) -> Shared:
    """Every rank's reasons for the miss agreed on at guard collective ``seq``; a collective on ``pg``."""
    health.latch.check("guard")
    members = groups.member_ranks(pg)  # global ranks name the ranks, under a scope too
    rank, world = members[pg.rank()], pg.size()

    def where() -> str:
        return describe("guard", rank, seq, frame) + " (recompile reasons)"

    payload = wire.encode_reasons(rank=rank, world_size=world, seq=seq, missed=missed, reasons=own if missed else [])

    def same_miss(envelopes: Sequence[wire.ReasonsEnvelope], _rank: int) -> None:
        if any(e.seq != seq for e in envelopes):
            lines = "\n".join(f"  rank {e.rank}: guard collective #{e.seq}" for e in envelopes)
            raise CollectiveDesyncError(
                f"{where()}: ranks exchanged recompile reasons for different guard collectives:\n"
                f"{lines}\nEvery rank recompiles after the same agreed miss, so this is a bug; "
                "please report it with this message.",
                ranks=tuple(e.rank for e in envelopes if e.seq != seq),
            )

    gathered = exchange_frame.gather(
        pg,
        payload,
        kind="guard",
        seq=seq,
        frame=frame,
        where=where,
        decode=wire.decode_reasons,
        check=same_miss,
        profile_as="compiler_collectives.recompile_reasons",
    )
    envelopes, payloads, rounds, elapsed = (gathered.envelopes, gathered.payloads, gathered.rounds, gathered.elapsed_s)
    everyone = {e.rank: e.reasons for e in envelopes if e.missed}
    shared = Shared(
        seq=seq,
        rank=rank,
        world_size=world,
        this_rank_missed=missed,
        missed=everyone,
        reasons=recorded_reasons(rank, everyone, own if missed else []),
        bytes_sent=len(payload),
        bytes_received=sum(len(p) for p in payloads),
        rounds=rounds,
        elapsed_s=elapsed,
    )
    # The ledger's readers write the ``guard_collective`` artifact from this record.
    ledger.add(
        ReasonsExchange(
            seq,
            frame=frame,
            rank=rank,
            world_size=world,
            this_rank_missed=missed,
            missed=MappingProxyType({r: tuple(v) for r, v in everyone.items()}),
            reasons=tuple(shared.reasons),
            bytes_sent=shared.bytes_sent,
            bytes_received=shared.bytes_received,
            rounds=rounds,
            elapsed_s=elapsed,
        )
    )
    log.info("%s: recompiling: %s", where(), " | ".join(shared.reasons) or "no reason found")
    return shared
