"""The frozen records the ledger (``ledger.py``) holds: one per agreement, exchange or graph.

Each record says what one thing our collectives did on this rank, with its figures (bytes,
rounds, time). The agreements make them and hand them to the ledger (``ledger.add``); the
counters of ``stats()`` are computed from them by the ledger's one table (``ledger.COUNTS``),
so that no module names a counter. A record type the table lacks is a ``KeyError`` the first
time a test makes one, never a silent zero.

Plain data, no behaviour: this module imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# ------------------------------------------------------------ compiler collective


@dataclasses.dataclass(frozen=True, slots=True)
class CompilerExchange:
    """One compiler collective: at the end of a compile's first trace ("trace"), or the input
    exchange before it ("inputs"); the arrival spread and the last rank from the senders' clocks."""

    phase: str
    rounds: int
    bytes_sent: int
    bytes_received: int
    elapsed_s: float
    arrival_spread_s: float
    late_rank: int


@dataclasses.dataclass(frozen=True, slots=True)
class Restart:
    """What the Dynamo seam did with a compiler collective's restart decision: traced the frame
    again (``taken``) or went on without a restart."""

    taken: bool


# ------------------------------------------------------------ the audit


@dataclasses.dataclass(frozen=True, slots=True)
class Fingerprinted:
    """One graph level this rank fingerprinted for the audit."""

    level: str


@dataclasses.dataclass(frozen=True, slots=True)
class ImportedGraphs:
    """Graph levels taken from an artifact another rank compiled (compile once)."""

    graphs: int


@dataclasses.dataclass(frozen=True, slots=True)
class LazyBackward:
    """A backward graph lowered lazily at run time, outside an audited compile (not audited)."""

    frame: str


@dataclasses.dataclass(frozen=True, slots=True)
class AuditRecompile:
    """This rank compiled a graph again without caches: some rank loaded a level from a cache."""

    frame: str


@dataclasses.dataclass(frozen=True, slots=True)
class AuditRecompileWait:
    """This rank waited for the ranks that compile a graph again without caches."""

    waited_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class AuditExchange:
    """One audit of a graph (``settle``): whether its exchange ran, the levels left out of the
    comparison (produced by some ranks only), its time (fingerprinting included) and the
    fingerprinting part of it."""

    frame: str
    phase: str
    exchanged: bool
    levels_not_compared: int
    elapsed_s: float
    fingerprint_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class AuditDifference:
    """A graph whose whole-graph hash differed across ranks while its collectives agreed (report
    only): ``report`` is what ``audit.reports()`` lists."""

    report: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Divergence:
    """A divergence an agreement ("audit" or "entry") raised: the ranks run different programs."""

    agreement: str


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """An error of ours raised on this rank (``kind``: the agreement or wait it came from)."""

    kind: str


# ------------------------------------------------------------ guard and entry agreement


@dataclasses.dataclass(frozen=True, slots=True)
class PathsDiverged:
    """The ranks took different graph-break paths through one compiled frame: each went on alone
    until its next call from its own code."""

    seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class ReasonsExchange:
    """The recompile reasons exchanged after an agreed guard miss."""

    seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class MixedFrame:
    """A frame whose cache entries came to run different collectives (checked on every call)."""

    frame: str


@dataclasses.dataclass(frozen=True, slots=True)
class EntryCheck:
    """One entry check, on a call of a mixed frame, and its time."""

    elapsed_s: float


# ------------------------------------------------------------ compile once


@dataclasses.dataclass(frozen=True, slots=True)
class OnceGraph:
    """One graph under compile once: its record (``stats()["compile_once"]``'s item), how it
    ended on this rank (``ended``) and the other ranks that compiled it themselves."""

    ended: str
    peers_local: int
    record: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class OncePlanned:
    """A key exchange that settled a graph's plan."""

    seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class OnceKeys:
    """How a graph's keys were settled: the fixed-size reduce alone (``reduced``: every key
    matched) or, after it, a gather of every rank's offer over the host tree."""

    reduced: bool


@dataclasses.dataclass(frozen=True, slots=True)
class OnceTreeExchange:
    """One exchange over the host tree whose bytes per rank do not grow with the world (a key
    settle, the results, a load report's flags and its details)."""

    what: str


@dataclasses.dataclass(frozen=True, slots=True)
class OnceLoadReport:
    """The load-report details this rank received (only the ranks that missed or refused send any)."""

    entries: int


@dataclasses.dataclass(frozen=True, slots=True)
class OnceWait:
    """Time this rank waited in compile once (for the rank that compiles, or for ranks that
    compile the graph themselves)."""

    waited_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class ArtifactSent:
    """Copies of an artifact this rank sent (as its source, or forwarding down the tree) and
    the bytes they moved."""

    copies: int
    bytes_sent: int


@dataclasses.dataclass(frozen=True, slots=True)
class ArtifactReceived:
    """The bytes of an artifact this rank received."""

    bytes_received: int


@dataclasses.dataclass(frozen=True, slots=True)
class DigestMismatch:
    """A file whose SHA-256 did not match; ``refetched``: the receiver refused the bytes it took
    in the tree and loaded the source's own copy instead."""

    refetched: bool
