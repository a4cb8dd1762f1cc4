"""The program audit: before a compiled graph runs, every rank checks that all ranks compiled the same collectives.

Compiler collectives make ranks agree on which dims are dynamic; the ranks can
still compile different programs (a branch on a size traced with each rank's
own size hint, Python code that depends on the rank, partitioner or inductor
decisions taken from size hints). Graphs whose collectives differ hang, crash,
or silently pair the wrong messages. The audit turns that into an error at
compile time, on every rank, before any rank runs the graph.

Flow, per graph Dynamo hands to a backend (the seams module calls in):

* ``audit_graph`` fingerprints the Dynamo graph, then runs the backend with a
  record open on this thread. AOTAutograd's compilers (forward, inference, and
  a backward compiled eagerly) and inductor's post-grad graphs add their
  fingerprints to it (``aot_compile``, ``inductor_graph``).
* After the backend returns (or raises), one all-gather on our compile group
  exchanges a summary: per graph level, an 8-byte digest of the ordered
  collective list and one of the whole graph. Levels every rank produced are
  compared (a level missing on some rank, e.g. after a cache hit there, is not).
* Collective digests differ: every rank sends that level's collective list in
  a second all-gather, and every rank raises the same ``ProgramDivergenceError``
  naming the frame, the first differing collective, each rank's version of it
  and its user source line. Only the whole-graph digest differs: logged at INFO
  and kept in ``reports()`` (report only).
* Backwards are compiled with their forward (the seam has AOTAutograd lower
  them eagerly in audited compiles), so a training graph's backward levels
  are in its one exchange and a backward that fails to compile fails the
  forward's compile, named, on every rank. A backward compiled lazily at run
  time would be compiled only on the ranks that run it first: it is never
  exchanged.

Plain Python over ``torch.distributed``; the graph walk is ``fingerprint.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from .. import health, process_state
from ..errors import (
    CollectiveError,
    CompileTimeoutError,
    ProgramDivergenceError,
    describe,
    program_divergence,
    ranks_text,
)
from ..ledger import ledger
from ..observations import FrameId
from ..records import (
    AuditDifference,
    AuditExchange,
    AuditRecompile,
    AuditRecompileWait,
    Divergence,
    Failure,
    Fingerprinted,
    ImportedGraphs,
    LazyBackward,
)
from ..transport import groups
from . import compile_wait, wire
from . import exchange as exchange_frame
from .fingerprint import Collective, GraphFingerprint, collectives_digest, fingerprint

log = logging.getLogger("compiler_collectives.audit")

T = TypeVar("T")

# Graph levels, in the order a difference is reported (the earliest is the
# closest to the user's code).
LEVELS = ("dynamo", "aot_forward", "aot_backward", "inductor_forward", "inductor_backward")
_LEVEL_NAMES = {
    "dynamo": "the graph Dynamo handed to the backend",
    "aot_forward": "the AOTAutograd forward graph(s)",
    "aot_backward": "the AOTAutograd backward graph(s)",
    "inductor_forward": "inductor's post-grad forward graph(s)",
    "inductor_backward": "inductor's post-grad backward graph(s)",
}

_seq = 0
_local = threading.local()  # record: GraphAudit | None, stage: str | None
_artifact_sink: Callable[[str, Callable[[], str]], None] | None = None


def progress() -> dict[str, Any]:
    """What the heartbeat tells of the audit (a progress source, wired at install)."""
    return {"audit_seq": _seq}


@process_state.wired(names=("_artifact_sink",), what="torch's structured trace, for the audit's artifacts")
def set_artifact_sink(sink: Callable[[str, Callable[[], str]], None] | None) -> None:
    """Where each audit's JSON summary goes (the seams module points this at torch's structured trace)."""
    global _artifact_sink
    _artifact_sink = sink


@process_state.clears(*process_state.EVERY_GENERATION, names=("_seq",), what="the audit's sequence number")
def reset_sequence() -> None:
    global _seq
    _seq = 0


def reports() -> list[dict[str, Any]]:
    """The latest report-only differences on this rank (at most 64), oldest first."""
    return [dict(x.report) for x in ledger.kept(AuditDifference)]


# ------------------------------------------------------------------ records


@dataclasses.dataclass
class AotScope:
    """One AOTAutograd compile inside an audited Dynamo graph."""

    frame: FrameId
    training: bool = False  # the forward compiler ran: there is a backward graph
    backward_compiled: bool = False  # ... and it was compiled with the forward


class GraphAudit:
    """Fingerprints gathered for one exchange: a Dynamo graph's compile."""

    def __init__(self, frame: FrameId, phase: str, graph_break: str | None = None) -> None:
        self.frame = frame
        self.phase = phase
        # "file.py:18 (reason)" when this rank's trace ends this graph at a graph break.
        self.graph_break = graph_break
        self.graphs: list[GraphFingerprint] = []
        self.broken: set[str] = set()  # levels this rank could not fingerprint
        self.scopes: list[AotScope] = []
        self.spent_s = 0.0
        self.compared: list[str] = []  # levels every rank produced, once settled

    def add(self, gm: torch.fx.GraphModule, level: str) -> None:
        started = time.perf_counter()
        try:
            self.graphs.append(fingerprint(gm, level))
            ledger.add(Fingerprinted(level))
        except Exception as e:  # noqa: BLE001 - never fail a compile over the audit itself
            # Dropping the level keeps the comparison honest: a level this rank
            # cannot describe is left out of the exchange, so it is compared nowhere.
            self.broken.add(level)
            log.warning(
                "program audit: cannot fingerprint a %s graph of %s (%s: %s); that level is "
                "not compared for this compile",
                level,
                self.frame,
                type(e).__name__,
                e,
            )
        self.spent_s += time.perf_counter() - started

    def collectives(self, level: str) -> list[Collective]:
        return [c for g in self.graphs if g.level == level for c in g.collectives]

    def levels(self) -> list[wire.AuditLevel]:
        out = []
        for level in LEVELS:
            graphs = [g for g in self.graphs if g.level == level]
            if not graphs or level in self.broken:
                continue
            collectives = [c for g in graphs for c in g.collectives]
            h = hashlib.blake2b(digest_size=8)
            for g in graphs:
                h.update(g.graph_hash)
            out.append(
                wire.AuditLevel(level, len(graphs), len(collectives), collectives_digest(collectives), h.digest())
            )
        return out


def current() -> GraphAudit | None:
    return getattr(_local, "record", None)


@process_state.kept(names=("_local",), why="the graph audited on this thread, set and restored by its compile")
@contextlib.contextmanager
def _open(record: GraphAudit | None, stage: str | None) -> Iterator[None]:
    saved = (getattr(_local, "record", None), getattr(_local, "stage", None))
    _local.record, _local.stage = record, stage
    try:
        yield
    finally:
        _local.record, _local.stage = saved


# ------------------------------------------------------------------ entry points (seams)


def audit_graph(frame: FrameId, gm: torch.fx.GraphModule, compile: Callable[[], T]) -> T:
    """Run Dynamo's backend call ``compile`` for ``gm`` under audit; raises before returning a divergent graph."""
    return audit_graph_program(frame, gm, compile)[0]


def audit_graph_program(
    frame: FrameId, gm: torch.fx.GraphModule, compile: Callable[[], T], *, graph_break: str | None = None
) -> tuple[T, list[tuple[str, bytes, list[Collective]]]]:
    """``audit_graph``, also returning the program every rank agreed on for this graph:
    per level compared on every rank, (level, collectives digest, collectives), in ``LEVELS`` order.

    ``graph_break``: where this rank's trace broke the frame's graph ("file.py:18 (reason)"),
    when this graph ends there; ranks that differ in it raise (``_paths_differ``).
    """
    record = GraphAudit(frame, "forward", graph_break)
    record.add(gm, "dynamo")
    result, settled = _audited(record, compile, stage=None)
    digests = {lv.level: lv.collectives_digest for lv in settled.levels()}
    return result, [(lv, digests[lv], settled.collectives(lv)) for lv in settled.compared if lv in digests]


def aot_scope() -> AotScope | None:
    """A scope for one AOTAutograd compile, if it belongs to an audited graph."""
    record = current()
    if record is None or record.phase != "forward":
        return None
    scope = AotScope(record.frame)
    record.scopes.append(scope)
    return scope


def aot_compile(scope: AotScope, stage: str, gm: torch.fx.GraphModule, compile: Callable[[], T]) -> T:
    """One call of AOTAutograd's forward/inference/backward compiler for ``gm``."""
    record = current()
    if record is not None:
        if stage == "forward":
            scope.training = True
        elif stage == "backward":
            scope.backward_compiled = True
        record.add(gm, "aot_backward" if stage == "backward" else "aot_forward")
        with _open(record, stage):
            return compile()
    # Outside the forward's compile: a backward lowered lazily at its first run,
    # on the ranks that run it first only. No exchange can pair up here.
    if stage == "backward" and scope.training and not scope.backward_compiled:
        ledger.add(LazyBackward(str(scope.frame)))
        log.debug("program audit: a backward graph of %s is compiled lazily; it is not audited", scope.frame)
    return compile()


def import_graphs(graphs: Sequence[GraphFingerprint]) -> None:
    """Levels this rank did not compile but loaded, as the rank that compiled them fingerprinted
    them (compile once): the same code runs here, so they are compared as this rank's own."""
    record = current()
    if record is not None:
        record.graphs.extend(graphs)
        ledger.add(ImportedGraphs(len(graphs)))


def inductor_graph(gm: torch.fx.GraphModule) -> None:
    """Inductor finished its post-grad passes on ``gm``: the order it will run."""
    record = current()
    if record is not None:
        stage = getattr(_local, "stage", None)
        record.add(gm, "inductor_backward" if stage == "backward" else "inductor_forward")


def failure_text(error: BaseException) -> str:
    """'ValueError: first line' of the innermost exception (backends' errors arrive wrapped)."""
    inner = error
    for _ in range(16):
        nxt = inner.__cause__ or inner.__context__
        if nxt is None:
            break
        inner = nxt
    lines = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {lines[0] if lines else ''}"[:500]


def _run(record: GraphAudit, compile: Callable[[], T], stage: str | None, ended: Callable[[], None] | None = None) -> T:
    """``compile`` under ``record``; ``ended()`` once it returned or raised, before any exchange."""
    try:
        with _open(record, stage):
            result = compile()
    except CollectiveError:
        if ended is not None:
            ended()
        raise  # our collectives already failed on this rank: no exchange can be trusted
    except Exception as e:
        if ended is not None:
            ended()  # before the exchange below: the ranks waiting for this compile then take it
        if health.poisoned() is not None:
            # A failure was published (ours, raised inside the backend, where torch wrapped it:
            # compile once's wait gave up, say): the peers will not exchange for this graph. The
            # seam around Dynamo's compile gives the user our type. (Ours that left the ranks in
            # step, such as a peer's compile that raised, still settle below: every rank takes
            # that exchange.)
            raise
        # Peers are about to exchange for this graph: take part, so that they
        # learn this rank has no program instead of waiting for it.
        settle(record, failure=failure_text(e))
        raise
    if ended is not None:
        ended()
    return result


def _audited(record: GraphAudit, compile: Callable[[], T], *, stage: str | None) -> tuple[T, GraphAudit]:
    """Compile under audit. Returns the backend's result and the record that was compared last."""
    before = (len(record.graphs), set(record.broken))
    result = _run(record, compile, stage)
    missing = settle(record, may_recompile=True)
    if missing:
        # Some rank loaded a level from a cache (AOTAutograd's, inductor's FX
        # graph cache) that another rank compiled: the ranks without it compile
        # again with the caches off, so that every level is compared. Every
        # rank knows ``missing`` from the same summaries: all take the second
        # exchange. The others wait for them as for any compile (``compile_wait``):
        # that compile may take far longer than the exchange's timeout allows.
        pg = groups.compile_pg()
        members = groups.member_ranks(pg)
        keys = {members[r]: f"audit/{_seq}/again/{members[r]}" for r in missing}
        me = members[pg.rank()]
        if me in keys:
            again = GraphAudit(record.frame, record.phase, record.graph_break)
            again.graphs, again.broken = record.graphs[: before[0]], set(before[1])
            ledger.add(AuditRecompile(str(record.frame)))
            # torch's config modules gain patch() at run time, outside what their types declare.
            with torch.compiler.config.patch(force_disable_caches=True):  # type: ignore[attr-defined]
                told = functools.partial(
                    compile_wait.post,
                    keys[me],
                    b"1",
                    me=me,
                    what=describe("audit", None, _seq, str(record.frame)),
                    telling="its compile of this graph again without caches ended",
                    kind="audit",
                    seq=_seq,
                    frame=str(record.frame),
                )
                result = _run(again, compile, stage, ended=told)
            record = again
        else:
            _wait_for_recompiles(record, keys, me)
        settle(record)
    return result, record


def _wait_for_recompiles(record: GraphAudit, keys: dict[int, str], me: int) -> None:
    seq = _seq
    started = time.perf_counter()
    compile_wait.wait_for_posts(
        keys,
        me=me,
        doing="compile this graph again without caches",
        what=describe("audit", None, seq, str(record.frame)),
        kind="audit",
        seq=seq,
        frame=str(record.frame),
        on_timeout=CompileTimeoutError,
        advice="Raise COMPILER_COLLECTIVES_COMPILE_TIMEOUT if compiles legitimately take that long.",
    )
    ledger.add(AuditRecompileWait(time.perf_counter() - started))


# ------------------------------------------------------------------ the exchange


def settle(record: GraphAudit, *, failure: str | None = None, may_recompile: bool = False) -> list[int]:
    """Exchange ``record`` with every rank and act on the comparison (identically on every rank).

    With ``may_recompile``, returns the ranks that lack a level some other rank
    produced (a cache hit there) once the shared levels agree: the caller has
    them compile again without caches and settles once more. Otherwise [].
    """
    global _seq
    health.check("audit")
    pg = groups.compile_pg()
    members = groups.member_ranks(pg)  # global ranks name the ranks, under a scope too
    rank, world = members[pg.rank()], pg.size()
    _seq += 1
    seq = _seq
    started = time.perf_counter()
    summary = wire.AuditSummary(record.phase, failure, record.levels(), record.graph_break)
    exchanged, not_compared = False, 0
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
            ledger.add(Failure("audit"))
            health.poison(err)
            raise err
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
            ledger.add(Failure("audit"))
            health.poison(err)
            raise err
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
        _emit(record, seq, rank, summaries, report_only)
        return []
    finally:
        elapsed = time.perf_counter() - started
        ledger.add(AuditExchange(str(record.frame), record.phase, exchanged, not_compared, elapsed, record.spent_s))
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
        where=f"collective #{index + 1} of {_LEVEL_NAMES.get(level, level)}",
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
    ledger.add(Failure("audit"))
    health.poison(err)
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


def _emit(record: GraphAudit, seq: int, rank: int, summaries: list[wire.AuditSummary], report_only: list[str]) -> None:
    sink = _artifact_sink
    if sink is None:
        return

    def payload() -> str:
        return json.dumps(
            {
                "seq": seq,
                "rank": rank,
                "frame": str(record.frame),
                "phase": record.phase,
                "report_only_levels": report_only,
                "collectives": {
                    lv: [c.render() for c in record.collectives(lv)]
                    for lv in LEVELS
                    if any(g.level == lv for g in record.graphs)
                },
                "ranks": [
                    {
                        lv.level: {
                            "graphs": lv.graphs,
                            "collectives": lv.collectives,
                            "collectives_digest": lv.collectives_digest.hex(),
                            "graph_digest": lv.graph_digest.hex(),
                        }
                        for lv in s.levels
                    }
                    for s in summaries
                ],
            }
        )

    try:
        sink("compiler_collectives_audit", payload)
    except Exception as e:  # noqa: BLE001 - tracing must never fail a compile
        log.debug("could not emit the audit artifact: %s", e)
