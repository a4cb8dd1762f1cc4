"""One graph under compile once on this rank: which graph it is (``Graph``: frame, level, number,
group, members, rank), where its time went (``Times``), compile once's own errors about it, and
the record kept when it ends.

``keep`` makes the graph's frozen record (``records()``'s item: how it ended, why, its times)
from the machine's final state (``machine.State``) and the times, once per graph, after every
wait of the graph; the ledger keeps and counts it (``tally``), and its readers write the graph's
trace event and its ``compile_once`` artifact from it. ``once_error`` and ``failed`` are compile
once's own errors about a graph, counted where they are made; ``where_of`` names the graph and
the step in messages.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from ...errors import CollectiveError, CompileOnceError
from ...ledger import ledger
from ...observations import FrameId
from ...records import OnceGraph
from .. import failure
from . import tally
from .machine import State
from .plan import COMPILE, LOAD, LOCAL, SERVE


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

    def compiler(self) -> str:
        """The C++ compiler inductor builds kernels with, and its version ("" where unknown)."""
        ...


@dataclasses.dataclass(frozen=True)
class Graph:
    """Which graph, at which level, among which ranks: fixed once its key exchange began (every
    later step of the graph uses the same group, members and rank)."""

    frame: FrameId
    level: str = "aot"  # "aot": AOTAutograd's entry; "fx": an FX graph cache entry (the fallback level)
    seq: int | None = None
    pg: Any = None
    members: tuple[int, ...] = ()
    rank: int = -1


@dataclasses.dataclass
class Times:
    """Where this rank's time in compile once went for one graph (issue 37's overhead per graph),
    added by the driver as it runs each action: the waits, the exchanges (keys with the plan,
    result, load report), the artifact's files (a source collecting and digesting them, a loader
    checking and installing them) and its bytes moving. The wall clock (``time.time``) when a
    source posted that it is done, and when a loader's wait for its sources ended: the wait's
    latency after the post, across ranks of one host."""

    started_ns: int = dataclasses.field(default_factory=time.time_ns)
    waited_s: float = 0.0
    exchange_s: float = 0.0
    install_s: float = 0.0
    transfer_s: float = 0.0
    artifact_bytes: int = 0
    bytes_in: int = 0
    posted_at: float | None = None
    wait_ended_at: float | None = None


def where_of(graph: Graph, what: str) -> Callable[[], str]:
    return lambda: f"compile once #{graph.seq} ({what}) of {graph.frame} on rank {graph.rank}"


E = TypeVar("E", bound=CollectiveError)


def failed(error: E) -> E:
    """Every error compile once raises of its own passes here: counted by the failure procedure
    (``failure.fail``, ``RAISED``: not published, this rank not poisoned)."""
    failure.fail(error, kind="compile_once", cause=failure.RAISED)
    return error


def once_error(graph: Graph, message: str, ranks: tuple[int, ...]) -> CompileOnceError:
    """Compile once's own error about ``graph``, naming ``ranks``, counted (``failed``)."""
    return failed(
        CompileOnceError(
            message, kind="compile_once", rank=graph.rank, seq=graph.seq, frame=str(graph.frame), ranks=ranks
        )
    )


def keep(graph: Graph, key: str | None, state: State, times: Times) -> dict[str, Any]:
    """The graph's record (``records()``'s item), kept by the ledger (which counts it); ``state``:
    the machine's, at the graph's end."""
    plan = state.plan
    assert plan is not None
    if plan.role == LOAD:
        loaded = state.outcome == "hit"
        name = "loaded" if loaded else "compiled locally"
        why = (state.outcome_why or plan.why) if loaded else f"{state.outcome}: {state.outcome_why}"
    else:
        name = {COMPILE: "compiled", SERVE: "served", LOCAL: "compiled locally"}[plan.role]
        why = plan.why
    finished_ns = time.time_ns()
    ended = tally.ended(plan.role, state.outcome, state.failure is not None, state.failed)
    peers_local = [r for r in state.local if r != graph.rank]
    record: dict[str, Any] = {
        "seq": graph.seq,
        "frame": str(graph.frame),
        "level": graph.level,
        "key": key,
        "state": name,
        "ended": ended,
        "why": why,
        "source": plan.source,
        "peers_local": peers_local,
        "waited_s": round(times.waited_s, 3),
        "exchange_s": round(times.exchange_s, 6),
        "install_s": round(times.install_s, 6),
        "transfer_s": round(times.transfer_s, 6),
        "span_s": round((finished_ns - times.started_ns) / 1e9, 6),
        "artifact_bytes": times.artifact_bytes,
        "posted_at": times.posted_at,
        "wait_ended_at": times.wait_ended_at,
    }
    # The ledger's readers write the graph's trace event and its artifact from this record.
    ledger.add(
        OnceGraph(
            ended,
            len(peers_local),
            MappingProxyType(dict(record)),
            rank=graph.rank,
            outcome=state.outcome,
            outcome_why=state.outcome_why,
            roles=MappingProxyType({r: (p.role, p.source) for r, p in state.plans.items()}),
            bytes_in=times.bytes_in,
            waited_s=times.waited_s,
            started_ns=times.started_ns,
            finished_ns=finished_ns,
        )
    )
    return record


def records() -> list[dict[str, Any]]:
    """Per graph, this rank's part: compiled, served, loaded, or compiled locally, and why."""
    return [dict(g.record) for g in ledger.kept(OnceGraph)]
