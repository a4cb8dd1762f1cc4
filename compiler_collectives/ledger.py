"""The ledger: this rank's frozen records of what our collectives did, and the counters of
``stats()`` computed from them.

Every agreement hands the ledger a record (``records.py``) of each exchange, audit, check or
graph (``ledger.add``); one table (``COUNTS``) says which counters each kind of record adds to,
and by how much. No module but this one writes a counter (``tests/unit/test_ledger.py`` checks it).
The table is applied once, as each record arrives, so that ``stats()`` costs nothing however
long the job ran; the records themselves are kept, the latest ``KEEP`` of each kind, until
``reset_stats()``: a record's figures stay readable while memory stays bounded.

Two kinds of event happen far too often for a record each, and have methods of their own that
add to preallocated fields:

* ``guard_call``: the guard hook's outcome, on every compiled call: no allocation, no lock, no
  syscall (the same attribute writes the hook made by hand before);
* ``store_requests``: requests the side channel sent to the c10d store, from any thread (a lock).

The ledger has readers: callables the composition root registers (``add_reader``), each offered
every record as it is added, once it is counted. The Chrome trace and the timing samples
(``instrument/timing.py``) and our structured-trace artifacts (``dynamo/tooling.py``) are
written by readers, from the records alone: no other module writes a trace event or one of our
artifacts (``tests/unit/test_ledger_readers.py`` checks it). A guard call reaches the one guard
reader (``read_guards``) only while one is registered, and only for a call the hook timed.

All of the ledger's state is on its instance; ``ledger`` is this process's one.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

from . import records as r

# The counters of ``stats()``, in its order, each with its zero. What each counts:
COUNTERS: dict[str, int | float] = {
    # compiler collective: one exchange at the end of every compile's first trace, plus (with
    # COMPILER_COLLECTIVES_EXCHANGE_INPUTS_FIRST) one input exchange before it; bytes, rounds
    # and time count both; restarts taken and skipped after one
    "compiler_collectives": 0,
    "compiler_input_exchanges": 0,
    "compiler_rounds": 0,
    "compiler_bytes_sent": 0,
    "compiler_bytes_received": 0,
    "compiler_time_s": 0.0,
    "restarts": 0,
    "restarts_skipped": 0,
    # arrival spread of the last compiler collective (sender wall clocks)
    "last_arrival_spread_s": 0.0,
    "last_late_rank": -1,
    # guard collective (``guard_call``)
    "guard_collectives": 0,
    "guard_local_misses": 0,
    "guard_agreed_misses": 0,
    "forced_recompiles": 0,
    "guard_time_s": 0.0,
    # program audit (agreements/audit.py): graphs fingerprinted, exchanges run (one per compiled
    # graph, backward included), graphs whose whole-graph hash differed across ranks while their
    # collectives agreed (report only), divergences raised; time in the audit (fingerprinting
    # and exchanging, the exchange including any wait for the slowest rank) and the
    # fingerprinting part of it
    "audit_graphs": 0,
    "audit_exchanges": 0,
    "audit_report_only_differences": 0,
    "audit_divergences": 0,
    "audit_time_s": 0.0,
    "audit_fingerprint_s": 0.0,
    # compiles run again without caches because some rank loaded a level from a cache that
    # another rank compiled (this rank was one of them); the wait for the ranks that do; levels
    # produced by some ranks only and left out of a comparison
    "audit_cache_recompiles": 0,
    "audit_recompile_wait_s": 0.0,
    "audit_levels_not_compared": 0,
    # backward graphs lowered lazily at run time, outside an audited compile (not audited)
    "audit_lazy_backwards": 0,
    # graph levels taken from an artifact another rank compiled (compile once)
    "audit_imported_graphs": 0,
    # entry agreement (agreements/entry.py): frames whose cache entries came to run different
    # collectives, entry checks run on calls of such frames (their time included), divergences
    "entry_mixed_frames": 0,
    "entry_checks": 0,
    "entry_check_time_s": 0.0,
    "entry_divergences": 0,
    # calls in which the ranks took different graph-break paths through one compiled frame
    "diverged_paths": 0,
    # compile once (agreements/once/): key exchanges run (one per cacheable graph lookup), of
    # which settled by the fixed-size reduce alone; exchanges over the host tree; gathers of
    # every rank's offer over the tree; load-report details received; then, from each graph's
    # record (``ONCE_ENDED``), graphs this rank compiled for others, served from its cache,
    # loaded, compiled locally, loads whose entry missed this rank's guards and artifacts
    # refused; peers that compiled locally after a miss or refusal; files whose SHA-256 did not
    # match; receivers that refused the bytes they took in the tree and loaded the source's own
    # copy instead; copies of an artifact this rank sent, bytes moved; time spent waiting
    "once_exchanges": 0,
    "once_keys_reduced": 0,
    "once_tree_exchanges": 0,
    "once_gathers": 0,
    "once_report_entries": 0,
    "once_compiled": 0,
    "once_served": 0,
    "once_loaded": 0,
    "once_local": 0,
    "once_load_misses": 0,
    "once_refused": 0,
    "once_peer_local_compiles": 0,
    "once_digest_mismatches": 0,
    "once_refetched": 0,
    "once_copies_sent": 0,
    "once_bytes_sent": 0,
    "once_bytes_received": 0,
    "once_wait_s": 0.0,
    # slow path: recompile reasons exchanged after an agreed miss
    "guard_reason_exchanges": 0,
    # requests this rank's side channel sent to the c10d store (``store_requests``: heartbeats,
    # failure reports, rendezvous, notices and the compile wait's waits and heartbeat reads; a
    # timed-out wait counts two, its cancel included); groups made on the store are not counted
    "store_requests": 0,
    # errors of ours raised on this rank
    "errors": 0,
}

# How a graph under compile once ended on this rank (its record's "ended") -> the counter it
# adds one to (``agreements/once/tally.py`` says how a graph ends).
ONCE_ENDED: dict[str, str | None] = {
    "compiled": "once_compiled",  # compiled it, for itself and the ranks that load it
    "served": "once_served",  # served the entry its cache held
    "local": "once_local",  # compiled it for itself alone (no match, not cacheable, torch's collectives)
    "loaded": "once_loaded",
    "miss": "once_load_misses",  # the entry it was sent failed its guards: it compiles the graph itself
    "refused": "once_refused",  # it refused the artifact: it compiles the graph itself
    "raised": None,  # its own compile raised: the user's error, or ours (counted in ``errors``)
    "source raised": None,  # its source's compile raised: it raises CompileOnceError (``errors``)
    "failed": None,  # an exchange, wait or transfer of ours failed and ended it (``errors``)
}


def _once_graph(g: r.OnceGraph) -> dict[str, float]:
    name = ONCE_ENDED[g.ended]
    out: dict[str, float] = {} if name is None else {name: 1}
    if g.peers_local:
        out["once_peer_local_compiles"] = g.peers_local
    if g.waited_s:
        out["once_wait_s"] = g.waited_s
    return out


def _compiler(x: r.CompilerExchange) -> dict[str, float]:
    return {
        "compiler_collectives" if x.phase == "trace" else "compiler_input_exchanges": 1,
        "compiler_rounds": x.rounds,
        "compiler_bytes_sent": x.bytes_sent,
        "compiler_bytes_received": x.bytes_received,
        "compiler_time_s": x.elapsed_s,
    }


def _audit(x: r.AuditExchange) -> dict[str, float]:
    return {
        "audit_exchanges": int(x.exchanged),
        "audit_levels_not_compared": x.levels_not_compared,
        "audit_time_s": x.elapsed_s + x.fingerprint_s,
        "audit_fingerprint_s": x.fingerprint_s,
    }


# The one table: each kind of record -> the counters it adds to, and by how much.
COUNTS: dict[type, Callable[[Any], Mapping[str, float]]] = {
    r.CompilerExchange: _compiler,
    r.Restart: lambda x: {"restarts" if x.taken else "restarts_skipped": 1},
    r.Fingerprinted: lambda x: {"audit_graphs": 1},
    r.ImportedGraphs: lambda x: {"audit_imported_graphs": x.graphs},
    r.LazyBackward: lambda x: {"audit_lazy_backwards": 1},
    r.AuditRecompile: lambda x: {"audit_cache_recompiles": 1},
    r.AuditRecompileWait: lambda x: {"audit_recompile_wait_s": x.waited_s},
    r.AuditExchange: _audit,
    r.AuditDifference: lambda x: {"audit_report_only_differences": 1},
    r.Divergence: lambda x: {f"{x.agreement}_divergences": 1},
    r.Failure: lambda x: {"errors": 1},
    r.GuardChannelBuilt: lambda x: {},
    r.PathsDiverged: lambda x: {"diverged_paths": 1},
    r.ReasonsExchange: lambda x: {"guard_reason_exchanges": 1},
    r.MixedFrame: lambda x: {"entry_mixed_frames": 1},
    r.EntryCheck: lambda x: {"entry_checks": 1, "entry_check_time_s": x.elapsed_s},
    r.OnceGraph: _once_graph,
    r.OncePlanned: lambda x: {"once_exchanges": 1},
    r.OnceKeys: lambda x: {"once_keys_reduced" if x.reduced else "once_gathers": 1},
    r.OnceTreeExchange: lambda x: {"once_tree_exchanges": 1},
    r.OnceLoadReport: lambda x: {"once_report_entries": x.entries},
    r.ArtifactSent: lambda x: {"once_copies_sent": x.copies, "once_bytes_sent": x.bytes_sent},
    r.ArtifactReceived: lambda x: {"once_bytes_received": x.bytes_received},
    r.DigestMismatch: lambda x: {"once_digest_mismatches": 1, "once_refetched": int(x.refetched)},
}

# The latest records of each kind the ledger keeps (the counters count every one).
KEEP = 256
KEEP_BY_KIND: dict[type, int] = {
    r.AuditDifference: 64,  # as many as ``audit.reports()`` promised before
    # Fewer of those that carry, for the readers, what grows with the world or the graph: every
    # rank's state, a graph's fingerprints and every rank's levels, every rank's reasons.
    r.CompilerExchange: 16,
    r.AuditExchange: 16,
    r.ReasonsExchange: 16,
}


def _without_roles(record: r.OnceGraph) -> r.OnceGraph:
    return dataclasses.replace(record, roles={}) if record.roles else record


# What is kept of a record whose part for the readers grows with the world and is kept as deep as
# stats() lists it: compile once's graphs, 256 of them, whose every rank's (role, source) would
# be 256 x the world's ranks. The readers are offered the whole record; the ledger keeps the rest.
KEPT_AS: dict[type, Callable[[Any], object]] = {r.OnceGraph: _without_roles}

# A reader: offered every record the ledger adds, once counted.
Reader = Callable[[object], None]


# The guard reader: hears of each timed guard call (when it began, ``time.time_ns``; how long
# the exchange took; its number; whether this rank hit; whether every rank did).
GuardReader = Callable[[int, float, int, bool, bool], None]


def counts(record: object) -> Mapping[str, float]:
    """The counters ``record`` adds to, and by how much (``COUNTS``)."""
    return COUNTS[type(record)](record)


class Ledger:
    """This rank's records and the counters computed from them (see the module's docstring)."""

    __slots__ = (
        "_kept",
        "_last",
        "_readers",
        "_store_lock",
        "_store_requests",
        "_totals",
        "forced_recompiles",
        "guard_agreed_misses",
        "guard_collectives",
        "guard_local_misses",
        "guard_reader",
        "guard_time_s",
    )

    def __init__(self) -> None:
        self._store_lock = threading.Lock()
        # The readers, kept across ``clear()``: a tuple, replaced whole, so that a record added
        # on another thread while one registers meets either the old readers or the new.
        self._readers: tuple[Reader, ...] = ()
        # The guard hook reads this on every call: it takes the clock only when it is not None.
        self.guard_reader: GuardReader | None = None
        self.clear()

    def clear(self) -> None:
        """Forget every record and zero every counter (``reset_stats()``)."""
        self._totals: dict[str, float] = dict(COUNTERS)
        self._kept: dict[type, collections.deque[object]] = {}
        self._last: r.CompilerExchange | None = None
        self._store_requests = 0
        # The guard hook's outcomes, preallocated (``guard_call``).
        self.guard_collectives = 0
        self.guard_local_misses = 0
        self.guard_agreed_misses = 0
        self.forced_recompiles = 0
        self.guard_time_s = 0.0

    def add(self, record: object) -> None:
        """Keep ``record`` and add it to the counters it counts in (``COUNTS``)."""
        for name, n in counts(record).items():
            self._totals[name] += n
        kind = type(record)
        kept = self._kept.get(kind)
        if kept is None:
            kept = self._kept[kind] = collections.deque(maxlen=KEEP_BY_KIND.get(kind, KEEP))
        trim = KEPT_AS.get(kind)
        kept.append(record if trim is None else trim(record))
        if kind is r.CompilerExchange:
            self._last = record  # type: ignore[assignment]
        for reader in self._readers:
            reader(record)

    def add_reader(self, reader: Reader) -> None:
        """Offer every record added from now on to ``reader`` (once however often it is added)."""
        if reader not in self._readers:
            self._readers = (*self._readers, reader)

    def remove_reader(self, reader: Reader) -> None:
        """Offer ``reader`` nothing more (nothing if it was not reading)."""
        self._readers = tuple(x for x in self._readers if x != reader)

    def readers(self) -> tuple[Reader, ...]:
        """The registered readers, in the order they are offered each record."""
        return self._readers

    def read_guards(self, reader: GuardReader | None) -> None:
        """Offer each timed guard call to ``reader`` from now on (None: to nobody; the hook then
        takes no clock)."""
        self.guard_reader = reader

    def kept(self, kind: type[Any]) -> list[Any]:
        """The latest records of ``kind``, oldest first."""
        return list(self._kept.get(kind, ()))

    def guard_call(
        self, elapsed_s: float, local_miss: bool, agreed_miss: bool, seq: int = 0, started_ns: int = 0
    ) -> None:
        """One guard collective (the guard hook, every compiled call): no allocation, no lock.

        ``started_ns``: when the call began, which the hook takes only while a guard reader is
        registered; a call with one (and only such a call) is offered to the guard reader, with
        its number ``seq``. 0: counted, offered to nobody."""
        self.guard_time_s += elapsed_s
        self.guard_collectives += 1
        if local_miss:
            self.guard_local_misses += 1
        if agreed_miss:
            self.guard_agreed_misses += 1
            if not local_miss:  # this rank hit but another missed: it compiles again
                self.forced_recompiles += 1
        if started_ns:
            reader = self.guard_reader
            if reader is not None:
                reader(started_ns, elapsed_s, seq, not local_miss, not agreed_miss)

    def store_requests(self, n: int = 1) -> None:
        """``n`` requests to the c10d store, from any thread."""
        with self._store_lock:
            self._store_requests += n

    def counters(self) -> dict[str, Any]:
        """Every counter of ``stats()``, in its order, computed from the records."""
        out: dict[str, Any] = dict(self._totals)
        for name in ("guard_collectives", "guard_local_misses", "guard_agreed_misses", "forced_recompiles"):
            out[name] = getattr(self, name)
        out["guard_time_s"] = self.guard_time_s
        out["store_requests"] = self._store_requests
        last = self._last
        if last is not None:
            out["last_arrival_spread_s"] = last.arrival_spread_s
            out["last_late_rank"] = last.late_rank
        return out


ledger = Ledger()


def reset_ledger() -> None:
    ledger.clear()
