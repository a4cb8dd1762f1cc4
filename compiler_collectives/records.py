"""The frozen records the ledger (``ledger.py``) holds: one per agreement, exchange or graph.

Each record says what one thing our collectives did on this rank, with its figures (bytes,
rounds, time). The agreements make them and hand them to the ledger (``ledger.add``); the
counters of ``stats()`` are computed from them by the ledger's one table (``ledger.COUNTS``),
so that no module names a counter. A record type the table lacks is a ``KeyError`` the first
time a test makes one, never a silent zero.

The ledger's readers (the Chrome trace, the structured-trace artifacts) write what they write
from the records alone, so a record carries what they need too (its number, frame, start,
every rank's states or summaries); those fields have defaults only so that a test can build a
record with the counted figures alone.

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
    exchange before it ("inputs"); the arrival spread and the last rank from the senders' clocks.

    For the readers: its number, frame, this rank (global) and the group's size, when it began
    (``time.time_ns``), the compile it ran in, the restart decision (None for the input
    exchange) and why, and every rank's state in rank order (the artifact's entries)."""

    phase: str
    rounds: int
    bytes_sent: int
    bytes_received: int
    elapsed_s: float
    arrival_spread_s: float
    late_rank: int
    seq: int = 0
    frame: str = ""
    rank: int = 0
    world_size: int = 1
    started_ns: int = 0
    compile_id: str | None = None
    restart: bool | None = None
    restart_why: str = ""
    states: tuple[Any, ...] = ()


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
    fingerprinting part of it.

    For the readers: its number and this rank (global); ``agreed`` when every rank's
    collectives agreed and the audit let the graph run, and then the levels whose whole graphs
    differed (report only), this rank's graph fingerprints and every rank's levels as
    exchanged."""

    frame: str
    phase: str
    exchanged: bool
    levels_not_compared: int
    elapsed_s: float
    fingerprint_s: float
    seq: int = 0
    rank: int = 0
    agreed: bool = False
    report_only: tuple[str, ...] = ()
    graphs: tuple[Any, ...] = ()
    ranks: tuple[tuple[Any, ...], ...] = ()


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
class GuardChannelBuilt:
    """The guard collective's channel was built on this rank (global ``rank``; ``world_size``:
    its group's size): its calls follow, each through ``ledger.guard_call``."""

    rank: int
    world_size: int


@dataclasses.dataclass(frozen=True, slots=True)
class PathsDiverged:
    """The ranks took different graph-break paths through one compiled frame: each went on alone
    until its next call from its own code."""

    seq: int


@dataclasses.dataclass(frozen=True, slots=True)
class ReasonsExchange:
    """The recompile reasons exchanged after an agreed guard miss (guard collective ``seq``).

    For the readers: the frame, this rank (global) and the group's size, whether this rank
    missed, every missing rank's reasons, the reasons this rank records, and the cost."""

    seq: int
    frame: str | None = None
    rank: int = 0
    world_size: int = 1
    this_rank_missed: bool = False
    missed: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    reasons: tuple[str, ...] = ()
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0
    elapsed_s: float = 0.0


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
    ended on this rank (``ended``) and the other ranks that compiled it themselves.

    For the readers (beside ``record``'s seq, frame, level, key, state, why and source): this
    rank (global; -1 when no exchange was taken), a loader's outcome and why, every rank's
    (role, source), the bytes it received, its wait unrounded, and when its compile began and
    ended (``time.time_ns``)."""

    ended: str
    peers_local: int
    record: Mapping[str, Any]
    rank: int = -1
    outcome: str = "none"
    outcome_why: str | None = None
    roles: Mapping[int, tuple[str, int | None]] = dataclasses.field(default_factory=dict)
    bytes_in: int = 0
    waited_s: float = 0.0
    started_ns: int = 0
    finished_ns: int = 0


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
