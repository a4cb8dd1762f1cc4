"""Compile once's ticket: one AOTAutograd (or fallback FX) compile of a graph on this rank, from
its start to its end, and the record made from it when it ends.

``Ticket`` is what every step of the protocol reads and fills (the plan, the offers, the
outcome, the times); ``Step`` is where it stands. ``keep_record`` makes the graph's frozen
record (``records()``'s item: how it ended, why, its times) once per ticket, kept and counted
by the ledger, whose readers write the graph's trace event and its ``compile_once`` artifact
from it. ``once_error`` and ``failed`` are compile once's own errors about a ticket's
graph, counted where they are made; ``where_of`` names the graph and the step in messages.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from ...errors import CollectiveError, CompileOnceError
from ...ledger import ledger
from ...observations import FrameId
from ...records import OnceGraph
from .. import failure
from ..fingerprint import GraphFingerprint
from ..wire.once import Offer
from . import sidecar, tally
from .plan import COMPILE, LOAD, LOCAL, SERVE, Plan


class Cache(Protocol):
    """Torch's compile caches as compile once needs them (the seam implements it)."""

    def root(self) -> str:
        """The inductor cache dir of this process (``TORCHINDUCTOR_CACHE_DIR``)."""
        ...

    def aot_dir(self, key: str) -> str:
        """The directory of AOTAutograd's entries for ``key``."""
        ...

    def fx_dir(self, key: str) -> str:
        """The directory of the FX graph cache's entries for ``key``."""
        ...


class Step(enum.Enum):
    """Where one graph's ticket stands; ``finish`` dispatches on it."""

    OPEN = "open"  # begun: no key exchange yet (none may follow: a compile that never looks up)
    PLANNED = "planned"  # keys settled: ``plan`` is this rank's; its result and load report are ahead
    REPORTED = "reported"  # the load report is taken; a rank that did not load still compiles, then posts
    DONE = "done"  # nothing of this graph is left to exchange or post


@dataclasses.dataclass
class Ticket:
    """One AOTAutograd compile of a graph on this thread, from its start to its end."""

    frame: FrameId
    cache: Cache
    audit_mark: int | None
    seq: int | None = None
    key: str | None = None
    plan: Plan | None = None
    plans: dict[int, Plan] = dataclasses.field(default_factory=dict)
    offers: dict[int, Offer] = dataclasses.field(default_factory=dict)
    fx_keys: list[str] = dataclasses.field(default_factory=list)
    sources: list[str] = dataclasses.field(default_factory=list)
    step: Step = Step.OPEN
    outcome: str = "none"  # a loading rank's load: "none", "hit", "miss" or "refused"
    outcome_why: str | None = None
    waited_s: float = 0.0
    # Where the rest of this rank's time in compile once went (issue 37's overhead per graph):
    # the exchanges (keys with the plan, result, load report), the artifact's files (a source
    # collecting and digesting them, a loader checking and installing them) and its bytes moving
    # (sending, receiving, or waiting for the rank that receives for this cache dir). The wall
    # clock (time.time) when a source posted that it is done, and when a loader's wait for its
    # sources ended: the wait's latency after the post, across ranks of one host.
    exchange_s: float = 0.0
    install_s: float = 0.0
    transfer_s: float = 0.0
    artifact_bytes: int = 0
    posted_at: float | None = None
    wait_ended_at: float | None = None
    fingerprints: list[GraphFingerprint] = dataclasses.field(default_factory=list)
    outer: Ticket | None = None
    level: str = "aot"  # "aot": AOTAutograd's entry; "fx": an FX graph cache entry (the fallback level)
    graph: str = ""  # digest of the graph handed to AOTAutograd (aot level)
    fx_allowed: bool = False  # aot level: its FX compiles share at the fallback level
    started_ns: int = dataclasses.field(default_factory=time.time_ns)
    bytes_in: int = 0
    # The compile group, its members (global ranks) and this rank, captured once at the key
    # exchange: every later step of this graph uses the same ones.
    pg: Any = None
    members: tuple[int, ...] = ()
    rank: int = -1
    # A loading rank: the digests of the entry files it was sent, and of the entry its lookup hit
    # (None where the seam cannot tell).
    sent_entries: frozenset[bytes] = frozenset()
    hit: bytes | None = None
    # From the load report: the ranks that did not load (a miss or a refusal) and compile the
    # graph themselves; every other rank waits for them before it leaves the graph's compile.
    local: tuple[int, ...] = ()
    # This rank's own compile of the graph raised (``finish``): its text.
    failure: str | None = None
    # The graph's record (``records()``'s item), once made: made once, and counted once (``tally``).
    record: dict[str, Any] | None = None


def where_of(ticket: Ticket, what: str) -> Callable[[], str]:
    return lambda: f"compile once #{ticket.seq} ({what}) of {ticket.frame} on rank {ticket.rank}"


E = TypeVar("E", bound=CollectiveError)


def failed(error: E) -> E:
    """Every error compile once raises of its own passes here: counted by the failure procedure
    (``failure.fail``, ``RAISED``: not published, this rank not poisoned)."""
    failure.fail(error, kind="compile_once", cause=failure.RAISED)
    return error


def once_error(ticket: Ticket, message: str, ranks: tuple[int, ...]) -> CompileOnceError:
    """Compile once's own error about this ticket's graph, naming ``ranks``, counted (``failed``)."""
    return failed(
        CompileOnceError(
            message, kind="compile_once", rank=ticket.rank, seq=ticket.seq, frame=str(ticket.frame), ranks=ranks
        )
    )


def keep_record(ticket: Ticket) -> None:
    """The graph's record (``records()``), once per ticket, kept by the ledger (which counts it)."""
    plan = ticket.plan
    if plan is None or ticket.record is not None:
        return
    if ticket.level == "aot" and ticket.fx_keys:
        sidecar.write_fx_keys(ticket.cache.root(), ticket.key, ticket.fx_keys)
    if plan.role == LOAD:
        state = "loaded" if ticket.outcome == "hit" else "compiled locally"
        why = (ticket.outcome_why or plan.why) if ticket.outcome == "hit" else f"{ticket.outcome}: {ticket.outcome_why}"
    else:
        state = {COMPILE: "compiled", SERVE: "served", LOCAL: "compiled locally"}[plan.role]
        why = plan.why
    finished_ns = time.time_ns()
    ticket.record = {
        "seq": ticket.seq,
        "frame": str(ticket.frame),
        "level": ticket.level,
        "key": ticket.key,
        "state": state,
        "ended": tally.ended(plan.role, ticket.outcome, ticket.failure is not None),
        "why": why,
        "source": plan.source,
        "peers_local": [r for r in ticket.local if r != ticket.rank],
        "waited_s": round(ticket.waited_s, 3),
        "exchange_s": round(ticket.exchange_s, 6),
        "install_s": round(ticket.install_s, 6),
        "transfer_s": round(ticket.transfer_s, 6),
        "span_s": round((finished_ns - ticket.started_ns) / 1e9, 6),
        "artifact_bytes": ticket.artifact_bytes,
        "posted_at": ticket.posted_at,
        "wait_ended_at": ticket.wait_ended_at,
    }
    # The ledger's readers write the graph's trace event and its artifact from this record.
    ledger.add(
        OnceGraph(
            ticket.record["ended"],
            len(ticket.record["peers_local"]),
            MappingProxyType(dict(ticket.record)),
            rank=ticket.rank,
            outcome=ticket.outcome,
            outcome_why=ticket.outcome_why,
            roles=MappingProxyType({r: (p.role, p.source) for r, p in ticket.plans.items()}),
            bytes_in=ticket.bytes_in,
            waited_s=ticket.waited_s,
            started_ns=ticket.started_ns,
            finished_ns=finished_ns,
        )
    )


def records() -> list[dict[str, Any]]:
    """Per graph, this rank's part: compiled, served, loaded, or compiled locally, and why."""
    return [dict(g.record) for g in ledger.kept(OnceGraph)]
