"""The program audit's exchange and verdict: every rank compares one graph's summaries and acts alike.

``settle`` sends this rank's record of a graph (``audit_record.GraphAudit``: per level, a digest
of the ordered collectives and one of the whole graphs; a failure, a graph break) in one
all-gather on our compile group, and every rank reaches the same verdict from the same
summaries:

* a rank failed to compile while others compiled: ``ProgramDivergenceError`` on the others
  (the failing rank re-raises its own error);
* the ranks' traces broke the frame's graph in different places: ``ProgramDivergenceError``;
* the collective digests of a level every rank produced differ: every rank sends that level's
  collective list in a second all-gather and raises the same ``ProgramDivergenceError``, naming
  the first differing collective and each rank's version of it;
* some rank lacks a level another produced (a cache hit there): with ``may_recompile`` the
  ranks that lack it are returned, for ``audit.py`` to have them compile again;
* only whole-graph digests differ: logged at INFO and kept (``reports()``), report only.

A verdict every rank reaches alike is counted and poisons this rank through the failure
procedure (``failure.fail``, ``VERDICT``), never published: every peer raises it too. Each
audit ends in one record (``AuditExchange``): the ledger counts it, and its readers write the
audit's artifact from it when the audit let the graph run. The audit's sequence number
(``sequence``) lives here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from .. import health
from ..errors import ProgramDivergenceError, describe, program_divergence, ranks_text
from ..ledger import ledger
from ..observations import FrameId
from ..records import AuditDifference, AuditExchange, Divergence
from ..transport import groups
from . import exchange as exchange_frame
from . import failure as failure_procedure
from . import generation, our_groups, wire
from .audit_record import LEVEL_NAMES, LEVELS, GraphAudit
from .fingerprint import Collective

log = logging.getLogger("compiler_collectives.audit")


def progress() -> dict[str, Any]:
    """What the heartbeat tells of the audit (a progress source, wired at install)."""
    return {"audit_seq": generation.current().audit_seq}


def sequence() -> int:
    """The number of the latest audit exchange of this generation."""
    return generation.current().audit_seq


def settle(record: GraphAudit, *, failure: str | None = None, may_recompile: bool = False) -> list[int]:
    """Exchange ``record`` with every rank and act on the comparison (identically on every rank).

    With ``may_recompile``, returns the ranks that lack a level some other rank
    produced (a cache hit there) once the shared levels agree: the caller has
    them compile again without caches and settles once more. Otherwise [].
    """
    health.latch.check("audit")
    pg = our_groups.compile_pg()
    members = groups.member_ranks(pg)  # global ranks name the ranks, under a scope too
    rank, world = members[pg.rank()], pg.size()
    gen = generation.current()
    gen.audit_seq += 1
    seq = gen.audit_seq
    started = time.perf_counter()
    summary = wire.AuditSummary(record.phase, failure, record.levels(), record.graph_break)
    exchanged, not_compared = False, 0
    # Once the audit let the graph run: the levels reported only, and every rank's summary.
    agreed: tuple[list[str], list[wire.AuditSummary]] | None = None
    try:
        envelopes = _exchange(pg, summary, record.frame, seq, rank, world)
        exchanged = True
        # Every body is a summary: the exchange's check refused any other kind of body.
        summaries: list[wire.AuditSummary] = [e.body for e in envelopes]  # type: ignore[misc]
        failed = [e.rank for e, s in zip(envelopes, summaries) if s.failure is not None]
        if failed:
            if len(failed) < world:
                _fail_partial(record, summaries, failed, rank, seq, this_rank_failed=failure is not None)
            return []  # every rank failed: each raises its own error
        breaks = [_break_site(s.graph_break) for s in summaries]
        if len(set(breaks)) > 1:
            err = _paths_differ(record, [s.graph_break for s in summaries], members, rank, seq)
            ledger.add(Divergence("audit"))
            raise failure_procedure.fail(err, kind="audit", cause=failure_procedure.VERDICT)
        by_rank = [{lv.level: lv for lv in s.levels} for s in summaries]
        common = [lv for lv in LEVELS if all(lv in d for d in by_rank)]
        diverged = [lv for lv in common if len({d[lv].collectives_digest for d in by_rank}) > 1]
        if diverged:
            level = diverged[0]
            details = _exchange(
                pg, wire.AuditDetails(record.phase, level, record.collectives(level)), record.frame, seq, rank, world
            )
            lists = [e.body.collectives for e in details]  # type: ignore[union-attr]  # details bodies, checked
            err = _divergence(record, level, lists, rank, seq, members)
            ledger.add(Divergence("audit"))
            raise failure_procedure.fail(err, kind="audit", cause=failure_procedure.VERDICT)
        produced = set().union(*by_rank)
        missing = [r for r, d in enumerate(by_rank) if set(d) != produced]
        if missing and may_recompile:
            log.info(
                "audit #%d of %s: %s lack level(s) %s that other ranks compiled (loaded from a "
                "cache?); they compile again without caches so that every level is compared",
                seq,
                record.frame,
                ranks_text([members[r] for r in missing]),
                ", ".join(sorted(produced - set[str].intersection(*(set(d) for d in by_rank)))),
            )
            return missing
        record.compared = common
        report_only = [lv for lv in common if len({d[lv].graph_digest for d in by_rank}) > 1]
        if report_only:
            _report(record, report_only, by_rank, seq)
        skipped = sorted(produced - set(common))
        not_compared = len(skipped)
        if skipped:
            log.debug(
                "audit #%d of %s: level(s) %s not produced on every rank (a cache hit?), not compared",
                seq,
                record.frame,
                ", ".join(skipped),
            )
        agreed = report_only, summaries
        return []
    finally:
        elapsed = time.perf_counter() - started
        reported, compared = agreed if agreed is not None else ([], [])
        # The ledger's readers write the audit's artifact from this record (``agreed`` only).
        ledger.add(
            AuditExchange(
                str(record.frame),
                record.phase,
                exchanged,
                not_compared,
                elapsed,
                record.spent_s,
                seq=seq,
                rank=rank,
                agreed=agreed is not None,
                report_only=tuple(reported),
                graphs=tuple(record.graphs) if agreed is not None else (),
                ranks=tuple(tuple(s.levels) for s in compared),
            )
        )
        log.debug(
            "audit #%d of %s (%s): %d graph(s), %.3f ms fingerprinting, %.3f ms exchanging",
            seq,
            record.frame,
            record.phase,
            len(record.graphs),
            record.spent_s * 1e3,
            elapsed * 1e3,
        )


def _exchange(
    pg: Any, body: wire.AuditSummary | wire.AuditDetails, frame: FrameId, seq: int, rank: int, world: int
) -> list[wire.AuditEnvelope]:
    def where() -> str:
        return describe("audit", rank, seq, str(frame))

    payload = wire.encode_audit(body, rank=rank, world_size=world, frame=frame, seq=seq, sent_at=time.time())
    return exchange_frame.gather(
        pg,
        payload,
        kind="audit",
        seq=seq,
        frame=str(frame),
        where=where,
        decode=wire.decode_audit,
        check=_same_graph,
    ).envelopes


# Every rank audits the same graph of the same frame at the same step, in the same exchange.
_same_graph: Callable[[Sequence[wire.AuditEnvelope], int], None] = exchange_frame.same_exchange(
    "audit",
    key=lambda e: (e.frame.key(), e.seq, e.body.phase, type(e.body)),
    line=lambda e: f"  rank {e.rank}: audit #{e.seq} of a {e.body.phase} graph of frame {e.frame}",
    problem="ranks are auditing different compiled graphs",
    advice=(
        "The ranks compiled different graphs or a different number of "
        "them (e.g. a graph break on one rank only, or a backward run on some ranks only). "
        "Compiler collectives need every rank to compile and run the same code (SPMD)."
    ),
)


def _divergence(
    record: GraphAudit,
    level: str,
    lists: list[list[Collective]],
    rank: int,
    seq: int,
    members: Sequence[int] | None = None,
) -> ProgramDivergenceError:
    named = list(members) if members is not None else list(range(len(lists)))  # global rank of each list
    longest = max(len(c) for c in lists)
    index = next(
        (i for i in range(longest + 1) if len({c[i].key() if i < len(c) else None for c in lists}) > 1),
        0,  # the digests differed but the (clipped) descriptions do not: show the first
    )
    versions: dict[int, str | None] = {}
    groups_of: dict[Any, list[int]] = {}
    for i, c in enumerate(lists):
        versions[named[i]] = c[index].render() if index < len(c) else None
        groups_of.setdefault(c[index].key() if index < len(c) else None, []).append(named[i])
    shown = []
    for key, ranks in groups_of.items():
        c = lists[named.index(ranks[0])]
        text = (
            c[index].render()
            if key is not None
            else f"no collective #{index + 1} (its graph has {len(c)} collective(s) in all)"
        )
        shown.append((ranks, text))
    causes = (
        "a branch on a size (`if x.shape[0] > 32:`) traced with each rank's own size hint, Python "
        "code that depends on the rank, or a compiler decision taken from size hints"
    )
    if level.endswith("backward"):
        causes += (
            " (here in the backward: e.g. an activation-checkpointing policy or the "
            "partitioner recomputing a collective on some ranks only)"
        )
    # A backward is lowered with its forward, in the forward's exchange.
    what = "graph's backward" if level.endswith("backward") else f"{record.phase} graph"
    return program_divergence(
        kind="audit",
        rank=rank,
        seq=seq,
        frame=str(record.frame),
        problem=f"the ranks compiled different collectives for the same {what}; no rank has run it.",
        where=f"collective #{index + 1} of {LEVEL_NAMES.get(level, level)}",
        shown=shown,
        ranks=named,  # the odd ones out: every rank outside the largest group
        advice=(
            f"Run as is, these graphs would hang, crash, or pair the wrong messages. Usual causes: {causes}. "
            "Make the decision the same on every rank (branch on something every rank shares, such "
            "as a setting or a size agreed before the call, and keep rank-dependent code out of "
            "compiled regions), then rerun. "
            "COMPILER_COLLECTIVES_AUDIT=0 on every rank turns this check off."
        ),
        level=level,
        index=index,
        versions=versions,
    )


def _break_site(graph_break: str | None) -> str | None:
    """Where a graph break is (its reason's text may differ by rank, its place may not)."""
    return None if graph_break is None else graph_break.split(" (", 1)[0]


def _paths_differ(
    record: GraphAudit, breaks: list[str | None], members: Sequence[int], rank: int, seq: int
) -> ProgramDivergenceError:
    """The ranks' traces of one compile went different ways: a graph break on some ranks only."""
    groups_of: dict[str | None, list[int]] = {}
    texts: dict[str | None, str | None] = {}
    for i, graph_break in enumerate(breaks):
        site = _break_site(graph_break)
        groups_of.setdefault(site, []).append(members[i])
        texts.setdefault(site, graph_break)
    shown = [
        (ranks, f"the graph ends at a graph break at {texts[site]}" if site is not None else "no graph break there")
        for site, ranks in groups_of.items()
    ]
    return program_divergence(
        kind="audit",
        rank=rank,
        seq=seq,
        frame=str(record.frame),
        problem="the ranks traced different paths through this frame in the same compile; no rank has run it.",
        where="where each rank's trace ends this graph",
        shown=shown,
        ranks=members,
        advice=(
            "The ranks that break the graph would go on to compile and run a resume function the others "
            "never enter, and wait there for them. Usual cause: a branch on a size traced with each rank's "
            "own size hint (`if x.size(1) > 48: print(...)` with that dim dynamic), or Python code that "
            "depends on the rank. Make the branch the same on every rank (branch on something every rank "
            "shares), or move what breaks the graph (a print, .item(), an unsupported call) out of the "
            "branch or out of the compiled region. COMPILER_COLLECTIVES_AUDIT=0 on every rank turns this "
            "check off."
        ),
        level="graph_break",
        index=0,
        versions={members[i]: b for i, b in enumerate(breaks)},
    )


def _fail_partial(
    record: GraphAudit,
    summaries: list[wire.AuditSummary],
    failed: list[int],
    rank: int,
    seq: int,
    *,
    this_rank_failed: bool,
) -> None:
    first = next(s.failure for s in summaries if s.failure is not None)
    err = ProgramDivergenceError(
        f"{describe('audit', rank, seq, str(record.frame))}: {ranks_text(failed)} failed to compile "
        f"this {record.phase} graph ({first}) while the other ranks compiled it; no rank has run "
        "it. Read the failing rank's own error first; the ranks cannot go on with different programs.",
        kind="audit",
        rank=rank,
        seq=seq,
        frame=str(record.frame),
        ranks=tuple(failed),
    )
    failure_procedure.fail(err, kind="audit", cause=failure_procedure.VERDICT)
    if not this_rank_failed:
        raise err
    # This rank re-raises its own compile error; later collectives refuse to run.


def _report(record: GraphAudit, levels: list[str], by_rank: list[dict[str, wire.AuditLevel]], seq: int) -> None:
    entry: dict[str, Any] = {
        "seq": seq,
        "frame": str(record.frame),
        "phase": record.phase,
        "levels": {lv: [d[lv].graph_digest.hex() for d in by_rank] for lv in levels},
    }
    ledger.add(AuditDifference(entry))
    log.info(
        "audit #%d of %s (%s graph): the graphs differ across ranks outside their collectives at "
        "level(s) %s (per-rank digests %s); the collectives agree, so this is reported only. "
        "Usual cause: a constant that depends on the rank.",
        seq,
        record.frame,
        record.phase,
        ", ".join(levels),
        "; ".join(f"{lv}: {' '.join(d)}" for lv, d in entry["levels"].items()),
    )
