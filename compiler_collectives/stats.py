"""In-memory counters of what our collectives did on this rank.

``compiler_collectives.stats()`` returns a snapshot as a plain dict. Counters
are updated on the hot path with plain attribute arithmetic (no locks): Dynamo
compiles and guard hooks run on the thread that calls the compiled function.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import process_state


@dataclasses.dataclass
class Counters:
    # compiler collective: one exchange at the end of every compile's first
    # trace, plus (with COMPILER_COLLECTIVES_EXCHANGE_INPUTS_FIRST) one input
    # exchange before it; bytes, rounds and time count both
    compiler_collectives: int = 0
    compiler_input_exchanges: int = 0
    compiler_rounds: int = 0
    compiler_bytes_sent: int = 0
    compiler_bytes_received: int = 0
    compiler_time_s: float = 0.0
    restarts: int = 0
    restarts_skipped: int = 0
    # arrival spread of the last compiler collective (sender wall clocks)
    last_arrival_spread_s: float = 0.0
    last_late_rank: int = -1
    # guard collective
    guard_collectives: int = 0
    guard_local_misses: int = 0
    guard_agreed_misses: int = 0
    forced_recompiles: int = 0
    guard_time_s: float = 0.0
    # program audit (audit.py): graphs fingerprinted, exchanges run (one per
    # compiled graph, backward included), graphs whose
    # whole-graph hash differed across ranks while their collectives agreed
    # (report only), divergences raised; time in the audit (fingerprinting and
    # exchanging, the exchange including any wait for the slowest rank) and the
    # fingerprinting part of it
    audit_graphs: int = 0
    audit_exchanges: int = 0
    audit_report_only_differences: int = 0
    audit_divergences: int = 0
    audit_time_s: float = 0.0
    audit_fingerprint_s: float = 0.0
    # compiles run again without caches because some rank loaded a level from
    # a cache that another rank compiled (this rank was one of them); levels
    # produced by some ranks only and left out of a comparison (all ranks had
    # compiled again and still differ in levels, or a fingerprint failed)
    audit_cache_recompiles: int = 0
    audit_recompile_wait_s: float = 0.0  # waiting for the ranks that compile again without caches
    audit_levels_not_compared: int = 0
    # backward graphs lowered lazily at run time, outside an audited compile
    # (not audited; audited compiles lower backwards eagerly)
    audit_lazy_backwards: int = 0
    # graph levels taken from an artifact another rank compiled (compile once)
    audit_imported_graphs: int = 0
    # entry agreement (agreements/entry.py): frames whose cache entries came to
    # run different collectives, entry checks run on calls of such frames
    # (their time included), divergences raised
    entry_mixed_frames: int = 0
    entry_checks: int = 0
    entry_check_time_s: float = 0.0
    entry_divergences: int = 0
    # calls in which the ranks took different graph-break paths through one
    # compiled frame (entries that communicate nothing): each went on alone
    # until its next call from its own code (agreements/guard.py, paths_diverged)
    diverged_paths: int = 0
    # compile once (agreements/once.py): key exchanges run (one per cacheable
    # graph lookup), of which settled by the fixed-size reduce alone (every key
    # matched: no all-gather of offers); graphs this rank compiled for others, served from its
    # cache, loaded from another rank, compiled locally (no match, not
    # cacheable, torch's compile-time collectives); loads whose entry missed
    # this rank's guards and artifacts refused (digest, layout, size): both
    # then compiled here (these six are added from each graph's record,
    # agreements/once/tally.py; a graph whose own compile raised counts in
    # none); peers that compiled locally after a miss or refusal;
    # files whose SHA-256 did not match; receivers that refused the bytes they took in the
    # tree and loaded the source's own copy instead (once_refetched); copies of an artifact this rank sent
    # (as its source, or forwarding down the tree), bytes moved; time spent waiting.
    # once_tree_exchanges: exchanges over the host tree (transport/hosttree.py) whose bytes per
    # rank do not grow with the world (a key settle, the results, a load report's flags and its
    # details); once_gathers: gathers over the tree of every rank's offer (a generation's first
    # graph, keys that differ); once_report_entries: load-report details this rank received (only
    # the ranks that missed or refused send any)
    once_exchanges: int = 0
    once_keys_reduced: int = 0
    once_tree_exchanges: int = 0
    once_gathers: int = 0
    once_report_entries: int = 0
    once_compiled: int = 0
    once_served: int = 0
    once_loaded: int = 0
    once_local: int = 0
    once_load_misses: int = 0
    once_refused: int = 0
    once_peer_local_compiles: int = 0
    once_digest_mismatches: int = 0
    once_refetched: int = 0
    once_copies_sent: int = 0
    once_bytes_sent: int = 0
    once_bytes_received: int = 0
    once_wait_s: float = 0.0
    # slow path: recompile reasons exchanged after an agreed miss
    guard_reason_exchanges: int = 0
    # requests this rank's side channel sent to the c10d store (store/: heartbeats,
    # failure reports, rendezvous, notices and the compile wait's waits and heartbeat reads; a
    # timed-out wait counts two, its cancel included); groups made on the store are not counted
    store_requests: int = 0
    # failures
    errors: int = 0

    def snapshot(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


counters = Counters()


@process_state.clears(process_state.STATS, names=("counters",), what="every counter of stats()")
def reset_counters() -> None:
    global counters
    fresh = Counters()
    for field in dataclasses.fields(Counters):
        setattr(counters, field.name, getattr(fresh, field.name))
