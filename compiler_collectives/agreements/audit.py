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

Here: the entry points the seams call and the flow of one graph (compile under a record,
settle, compile again without caches where some ranks loaded levels from a cache). The record
of one graph is ``audit_record.py``; the exchange and the verdict every rank reaches,
``audit_verdict.py``; the graph walk, ``fingerprint.py``. Plain Python over
``torch.distributed``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .. import health
from ..errors import CollectiveError, CompileTimeoutError, describe
from ..ledger import ledger
from ..observations import FrameId
from ..records import AuditDifference, AuditRecompile, AuditRecompileWait, ImportedGraphs, LazyBackward
from ..transport import groups
from . import audit_record, audit_verdict, compile_wait, our_groups
from .audit_record import AotScope, GraphAudit
from .audit_record import current as current  # compile once reads the open record here
from .audit_verdict import settle
from .fingerprint import Collective, GraphFingerprint

log = logging.getLogger("compiler_collectives.audit")

T = TypeVar("T")


def reports() -> list[dict[str, Any]]:
    """The latest report-only differences on this rank (at most 64), oldest first."""
    return [dict(x.report) for x in ledger.kept(AuditDifference)]


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
        with audit_record.opened(record, stage):
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
        record.add(gm, "inductor_backward" if audit_record.stage() == "backward" else "inductor_forward")


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
        with audit_record.opened(record, stage):
            result = compile()
    except CollectiveError:
        if ended is not None:
            ended()
        raise  # our collectives already failed on this rank: no exchange can be trusted
    except Exception as e:
        if ended is not None:
            ended()  # before the exchange below: the ranks waiting for this compile then take it
        if health.latch.first_failure is not None:
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
        pg = our_groups.compile_pg()
        members = groups.member_ranks(pg)
        seq = audit_verdict.sequence()
        keys = {members[r]: f"audit/{seq}/again/{members[r]}" for r in missing}
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
                    what=describe("audit", None, seq, str(record.frame)),
                    telling="its compile of this graph again without caches ended",
                    kind="audit",
                    seq=seq,
                    frame=str(record.frame),
                )
                result = _run(again, compile, stage, ended=told)
            record = again
        else:
            _wait_for_recompiles(record, keys, me)
        settle(record)
    return result, record


def _wait_for_recompiles(record: GraphAudit, keys: dict[int, str], me: int) -> None:
    seq = audit_verdict.sequence()
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
