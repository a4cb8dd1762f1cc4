"""Compile once's driver: runs one graph's machine (``machine.py``) against the world.

The seam (``dynamo/once_seam.py``) opens a ``Driver`` per AOTAutograd (or fallback FX) compile
(``begin``), current in the Dynamo compile's scope (``agreements.compile_scope``) until the
compile ends, and turns torch's callbacks into its events (``lookup_began``, ``key``,
``lookup_ended``, ``compile_ended``, ``abandon``). The driver feeds each to ``machine.advance``
and runs the actions it returns over three ports: the exchanges over the host tree
(``exchanges``), the mailbox on the store (``waits``) and the artifact's files and bytes
(``artifact``, ``sidecar``, ``transfer``, ``loading``). Each action is timed here, in one place
(``Times``); an action that raises ends the graph (``events.Failed``: its record kept) and its
error goes on. The graph's record is kept once, at the machine's ``Keep``, after every wait of
the graph (``graph.keep``).

What a compile reads and writes in torch's caches (the FX graph keys, the kernel sources, the
entry its lookup hit) is noted on the driver as it happens, for its artifact and its record.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from ... import config, health
from ...errors import PeerFailureError, SetupMismatchError
from ...ledger import ledger
from ...observations import FrameId
from ...records import OncePlanned
from ...transport import groups
from .. import audit, compile_scope, generation, our_groups
from .. import failure as failure_procedure
from ..fingerprint import GraphFingerprint
from ..wire.once import WARMTH_FX, WARMTH_MAX_ENTRIES, ManifestFile, Offer, Result
from . import artifact, build, events, exchanges, loading, machine, sidecar, transfer, waits
from .graph import Cache, Graph, Times, failed, keep, once_error, where_of
from .machine import State
from .plan import LOAD, LOCAL, SERVE, decide, fallback_allowed

log = logging.getLogger("compiler_collectives.once")


class Spans(Protocol):
    """Dynamo's timed events, as the seam opens them around a run of actions (``events.Span``)."""

    def span(self, name: str, driver: Driver) -> contextlib.AbstractContextManager[None]: ...


class _NoSpans:
    def span(self, name: str, driver: Driver) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def begin(frame: FrameId, cache: Cache, level: str = "aot", digest: str = "", spans: Spans | None = None) -> Driver:
    """Open the driver of one AOTAutograd compile (``level`` "aot"), or of one inductor compile
    inside it (``level`` "fx"), current in the Dynamo compile's scope (its cache lookup may
    follow). Outside a compile scope (a unit test's) it is nobody's current graph."""
    record = audit.current()
    driver = Driver(Graph(frame, level), cache, digest, spans or _NoSpans(), len(record.graphs) if record else None)
    scope = compile_scope.current()
    if scope is not None:
        driver.outer = scope.once_graph  # a compile nested in another (a subgraph): the outer one resumes after
        scope.once_graph = driver
    return driver


def current() -> Driver | None:
    """The driver of the compile in progress in this Dynamo compile's scope (None outside one)."""
    scope = compile_scope.current()
    return None if scope is None else scope.once_graph


class Driver:
    """One graph on this rank: the machine's state, what the compile noted, and where the time went."""

    def __init__(self, graph: Graph, cache: Cache, digest: str, spans: Spans, audit_mark: int | None) -> None:
        self.graph = graph
        self.cache = cache
        self.digest = digest  # of the graph handed to AOTAutograd (aot level)
        self.spans = spans
        self.audit_mark = audit_mark
        self.outer: Driver | None = None
        self.state = State()
        self.times = Times()
        self.entry_key: str | None = None
        self.offers: dict[int, Offer] = {}
        self.fx_allowed = False  # aot level: its FX compiles share at the fallback level
        self.fx_keys: list[str] = []
        self.sources: list[str] = []
        self.hit: bytes | None = None  # the digest of the entry the lookup hit, where the seam saw it
        self.sent_entries: frozenset[bytes] = frozenset()
        self.record: dict[str, Any] | None = None
        self._bypass = False
        self._switches: Callable[[], Sequence[str]] = tuple

    # ------------------------------------------------------------------- torch's callbacks

    def lookup_began(self) -> None:
        self._feed(events.LookupBegan())

    def key(self, key: str | None, why: str | None, switches: Callable[[], Sequence[str]]) -> bool:
        """The lookup's key (None: it could not compute one, ``why``); True when the lookup must
        bypass the cache (this rank refused the artifact and compiles the graph itself)."""
        self._switches = switches
        self._bypass = False
        self._feed(events.KeyComputed(key, why))
        return self._bypass

    def lookup_ended(self, hit: bool | None, raised: bool = False) -> None:
        self._feed(events.LookupEnded(hit, raised))

    def compile_ended(self, failure: str | None, no_lookup: str = "") -> None:
        self._close()
        self._feed(events.CompileEnded(failure, no_lookup))

    def abandon(self) -> None:
        """Ours failed during the compile: no further exchange of this graph."""
        self._close()
        self._feed(events.Abandoned())

    def note_fx_key(self, key: str) -> None:
        if self.state.plan is not None and key not in self.fx_keys:
            self.fx_keys.append(key)

    def note_source(self, path: str) -> None:
        if self.state.plan is not None and path.endswith(".cpp") and path not in self.sources:
            self.sources.append(path)

    def note_hit(self, entry: bytes) -> None:
        self.hit = hashlib.sha256(entry).digest()

    def nests_fx(self) -> bool:
        """Whether the FX compiles inside this graph's compile share at the FX graph cache."""
        return self.graph.level == "aot" and self.fx_allowed

    def describe(self) -> dict[str, Any]:
        """What the seam adds to Dynamo's timed events about this graph."""
        plan = self.state.plan
        return {
            "role": plan.role if plan is not None else LOCAL,
            "source": plan.source if plan is not None else None,
            "seq": self.graph.seq,
            "level": self.graph.level,
            "key": self.entry_key,
        }

    def _close(self) -> None:
        """This graph is no longer current: the compile it was nested in (if any) is again."""
        scope = compile_scope.current()
        if scope is not None and scope.once_graph is self:
            scope.once_graph = self.outer

    # -------------------------------------------------------------------------- the run loop

    def _feed(self, event: events.Event) -> None:
        self.state, actions = machine.advance(self.state, event)
        if actions:
            with contextlib.ExitStack() as spans:
                self._run(list(actions), spans)

    def _run(self, actions: list[events.Action], spans: contextlib.ExitStack) -> None:
        while actions:
            action = actions.pop(0)
            if isinstance(action, events.Span):
                spans.enter_context(self.spans.span(action.name, self))
                continue
            started = time.perf_counter()
            try:
                answer = self._perform(action)
            except BaseException:
                if self.state.phase is not machine.Phase.DONE:
                    self.state, after = machine.advance(self.state, events.Failed())
                    for a in after:
                        self._perform(a)  # the record (Keep): nothing that raises
                raise
            if log.isEnabledFor(logging.DEBUG):  # where a graph's time went, action by action
                took_ms = (time.perf_counter() - started) * 1e3
                name = type(action).__name__
                log.debug("compile once #%s of %s: %s took %.1f ms", self.graph.seq, self.graph.frame, name, took_ms)
            if answer is not None:
                assert not actions, f"{action} answered with actions left: {actions}"
                self.state, more = machine.advance(self.state, answer)
                actions = list(more)

    def _perform(self, action: events.Action) -> events.Event | None:
        """Run one action; its answer, for the actions that have one (``events.ANSWERED``)."""
        g, t = self.graph, self.times
        if isinstance(action, events.SettleKeys):
            with _added(t, "exchange_s"):
                return self._settle(action.key, action.why)
        if isinstance(action, events.AwaitSources):
            pending = waits.sources(g, self.state.plans)
            if pending:  # a wait for nobody takes no time: the record says it did not wait
                with _added(t, "waited_s"):
                    waits.wait_for_posts(g, pending, waits.source_done, "compile this graph for this rank")
                t.wait_ended_at = time.time()
            return events.Posted()
        if isinstance(action, events.ExchangeResults):
            with _added(t, "exchange_s"):
                results = exchanges.exchange_results(g, self.state.plans, action.mine)
            plan = self.state.plan
            if plan is not None and plan.role == LOAD and plan.source is not None:
                t.artifact_bytes = results[plan.source].total()
            return events.ResultsIn(results)
        if isinstance(action, events.Install):
            return self._install(action.result)
        if isinstance(action, events.Bypass):
            self._bypass = True
            return None
        if isinstance(action, events.Adopt):
            return self._adopt(action.result)
        if isinstance(action, events.LookForPeers):
            heard = health.latch.first_failure
            return events.PeersHeard(heard if isinstance(heard, PeerFailureError) and heard.reported_by else None)
        if isinstance(action, events.Collect):
            with _added(t, "install_s"):
                return self._collect(action.failure)
        if isinstance(action, events.Post):
            notice, telling = waits.NOTICES[action.what]
            if action.what == "source":
                # Before the post, not after: a waiting rank may see it, and note its wait's end,
                # before this rank's post call returns (a loaded host).
                t.posted_at = time.time()
            waits.post(g, notice, action.value, telling)
            return None
        if isinstance(action, events.Serve):
            t.transfer_s += transfer.serve(self._transfer(), action.bundle, action.result)
            return events.Served()
        if isinstance(action, events.Report):
            with _added(t, "exchange_s"):
                local = exchanges.load_report(g, self.state.plans, action.loaded, action.outcome, action.why)
            return events.ReportIn(local)
        if isinstance(action, events.AwaitLocals):
            said: dict[int, bytes] = {}
            if action.local:
                doing = "compile this graph itself (it did not load the artifact)"
                with _added(t, "waited_s"):
                    said = waits.wait_for_posts(g, list(action.local), waits.compiled_itself, doing)
            return events.Posted(waits.raised_in_their_own_compile(said))
        if isinstance(action, events.Keep):
            if g.level == "aot" and self.fx_keys and self.state.plan is not None:
                sidecar.write_fx_keys(self.cache.root(), self.entry_key, self.fx_keys)
            self.record = keep(g, self.entry_key, self.state, t)
            return None
        if isinstance(action, events.Raise):
            raise self._error(action)
        raise AssertionError(f"compile once: no way to run {action!r}")

    # ---------------------------------------------------------------------------- the ports

    def _settle(self, key: str | None, why: str | None) -> events.Planned:
        """The key exchange: this rank's offer, every rank's, and the plans decided from them."""
        pg = our_groups.compile_pg()  # first: a new default group noticed here starts a new generation
        gen = generation.current()
        gen.once_seq += 1
        members = tuple(groups.member_ranks(pg))
        g = self.graph = Graph(self.graph.frame, self.graph.level, gen.once_seq, pg, members, members[pg.rank()])
        self.entry_key = key
        holds = key is not None and artifact.holds(self._entry_dir(key))
        mine = Offer(
            key,
            why,
            holds,
            artifact.dir_identity(self.cache.root()),
            sorted(self._switches()),
            config.settings.max_artifact_bytes,
            self.digest,
            0 if holds else self._warmth(key),
            build.fingerprint(self.cache.compiler()),
        )
        self.offers = exchanges.settle_keys(g, mine, gen)
        try:
            plans = decide(self.offers, gen.once_seq, me=g.rank)
        except SetupMismatchError as e:
            raise failed(e) from None
        self.fx_allowed = g.level == "aot" and fallback_allowed(self.offers)
        ledger.add(OncePlanned(gen.once_seq))
        plan = plans[g.rank]
        if plan.role == LOCAL:
            log.info("compile once #%d of %s: rank %d compiles it itself: %s", g.seq, g.frame, g.rank, plan.why)
        else:
            log.debug("compile once #%d of %s: %s", g.seq, g.frame, plan)
        return events.Planned(g.rank, plans)

    def _warmth(self, key: str | None) -> int:
        """How warm this rank's cache is for compiling ``key`` without its entry (``WARMTH_*``)."""
        root = self.cache.root()
        if self.graph.level == "aot" and key is not None:
            fx_keys = sidecar.read_fx_keys(root, key, self.graph.rank)
            if fx_keys and all(artifact.holds(self.cache.fx_dir(k)) for k in fx_keys):
                return WARMTH_FX
        # Entries of earlier graphs: the kernels they built are likely to serve this one too.
        return artifact.count_entries(os.path.join(root, "fxgraph"), WARMTH_MAX_ENTRIES)

    def _install(self, result: Result) -> events.Installed:
        """A loader: the source's files received (or found in its dir), checked and installed
        (``loading.receive_and_install``); the ranks of one dir hear of their receiver's install
        through the store."""
        g, t, plan = self.graph, self.times, self.state.plan
        assert plan is not None and plan.source is not None

        def installed(via: int) -> bytes:
            doing = "receive the artifact for this cache dir"
            return waits.wait_for_posts(g, [via], waits.dir_installed, doing)[via]

        def post(said: bytes) -> None:
            waits.post(g, waits.dir_installed, said, "it installed the artifact for this cache dir")

        prefix = self._entry_prefix()
        here = loading.Dir(self.cache.root(), prefix, self.entry_key, installed, post)
        done = loading.receive_and_install(self._transfer(), result, plan.source, here)
        t.transfer_s += done.transfer_s
        t.install_s += done.install_s
        t.bytes_in += done.bytes_in
        if done.refusal is not None:
            log.warning(
                "compile once #%d of %s: rank %d refused the artifact of rank %d (%s); it compiles the graph "
                "itself, without the cache",
                g.seq,
                g.frame,
                g.rank,
                plan.source,
                done.refusal,
            )
            return events.Installed(done.refusal)
        self.sent_entries = frozenset(f.sha256 for f in result.manifest if f.relpath.startswith(prefix))
        return events.Installed(None, done.refetched)

    def _adopt(self, result: Result) -> events.Adopted:
        """The lookup hit: the levels of the artifact count as this rank's own (the same code
        runs), or, where it hit an entry its own cache already held for its key (torch looks at
        every entry of the key, in name order), the fingerprints kept with that one."""
        root, g = self.cache.root(), self.graph
        if self.hit is None or not self.sent_entries or self.hit in self.sent_entries:
            _import_fingerprints(result.fingerprints)
            sidecar.write(root, self.entry_key, result.fingerprints)
            return events.Adopted()
        kept = sidecar.read(root, self.entry_key, g.rank)
        plan = self.state.plan
        assert plan is not None
        why = (
            f"the lookup hit an entry this rank's cache already held for its key, not the one rank {plan.source} "
            "sent; "
            + (
                "audited with the fingerprints kept with it"
                if kept
                else "no fingerprints kept with it: audited at Dynamo's level"
            )
        )
        log.info("compile once #%d of %s: rank %d: %s", g.seq, g.frame, g.rank, why)
        _import_fingerprints(kept)
        return events.Adopted(why)

    def _collect(self, failure: str | None) -> events.Collected:
        """A serving rank: its artifact (every file of the compile's entries and kernels), its
        fingerprints and the digests of its pieces; or the failure its loaders must hear of."""
        if failure is not None:
            return events.Collected(Result("failed", failure[:500], [], []))
        g, plan = self.graph, self.state.plan
        assert plan is not None
        try:
            manifest, bundle = self._files()
            fingerprints = self._own_fingerprints()
            if plan.role == SERVE and not fingerprints:
                fingerprints = sidecar.read(self.cache.root(), self.entry_key, g.rank)
                _import_fingerprints(fingerprints)
            elif fingerprints:
                sidecar.write(self.cache.root(), self.entry_key, fingerprints)
            chunk_bytes = config.settings.once_chunk_bytes if bundle else 0
            chunks = transfer.chunk_digests(bundle, chunk_bytes) if bundle else []
            mine = Result("ok", None, manifest, fingerprints, chunk_bytes, chunks)
        except Exception as e:  # noqa: BLE001 - its loaders must hear of it, never wait for it
            log.warning("compile once #%d of %s: could not gather the artifact: %s", g.seq, g.frame, e)
            return events.Collected(
                Result("failed", f"gathering the artifact failed: {type(e).__name__}: {e}"[:500], [], [])
            )
        self.times.artifact_bytes = mine.total()
        return events.Collected(mine, bundle)

    def _error(self, action: events.Raise) -> BaseException:
        g = self.graph
        if action.why == "peer failed":
            heard = action.heard
            assert isinstance(heard, PeerFailureError)
            error = failed(
                PeerFailureError(
                    f"compile once #{g.seq} of {g.frame} on rank {g.rank}: while this rank compiled, {heard}",
                    kind="compile_once",
                    rank=g.rank,
                    seq=g.seq,
                    frame=str(g.frame),
                    ranks=heard.ranks,
                    reported_by=heard.reported_by,
                )
            )
            error.__cause__ = heard
            return error
        advice = "COMPILER_COLLECTIVES_COMPILE_ONCE=0 makes every rank compile its own graphs."
        (r,) = action.ranks[:1]
        if action.why == "source raised":
            return once_error(
                g,
                f"rank {g.rank}: rank {r} compiled graph #{g.seq} of {g.frame} for this rank and its compile "
                f"raised: {action.text}. This rank does not compile it again; see rank {r}'s log for the "
                f"traceback. {advice}",
                action.ranks,
            )
        return once_error(
            g,
            f"rank {g.rank}: rank {r} compiled graph #{g.seq} of {g.frame} itself (it did not load the artifact) "
            f"and its compile raised: {action.text}. Every rank leaves a graph's compile together, so this rank "
            f"raises too; see rank {r}'s log for the traceback. {advice}",
            action.ranks,
        )

    # ---------------------------------------------------------------------- the artifact's files

    def _own_fingerprints(self) -> list[GraphFingerprint]:
        record = audit.current()
        if record is None or self.audit_mark is None:
            return []
        return [f for f in record.graphs[self.audit_mark :] if f.level != "dynamo"]

    def _entry_dir(self, key: str) -> str:
        return self.cache.aot_dir(key) if self.graph.level == "aot" else self.cache.fx_dir(key)

    def _entry_prefix(self) -> str:
        """Where the entry of this rank's own key lives, relative to its cache dir."""
        assert self.entry_key is not None
        return os.path.relpath(self._entry_dir(self.entry_key), self.cache.root()) + os.sep

    def _files(self) -> tuple[list[ManifestFile], bytes]:
        """Every file of this compile's artifact under the cache dir: the AOTAutograd and FX graph
        entries of its keys, and the kernel sources and binaries it built or found."""
        key, cache = self.entry_key, self.cache
        if self.graph.level == "aot":
            dirs = ([cache.aot_dir(key)] if key else []) + [cache.fx_dir(k) for k in self.fx_keys]
        else:
            dirs = [cache.fx_dir(key)] if key else []
        return artifact.collect(cache.root(), dirs, self.sources)

    def _transfer(self) -> transfer.Graph:
        """The graph's transfer (``transfer.Graph``); a failed piece is published and counted here."""
        g = self.graph
        where = where_of(g, "artifact")

        def failed_piece(error: Any) -> Any:  # counted by the failure procedure
            return failure_procedure.fail(
                error, kind="compile_once", rank=g.rank, seq=g.seq, frame=str(g.frame), where=where
            )

        tree = generation.current().once_tree  # each parent and child meet on it first (a desync named at once)
        link = transfer.Link(g.pg, g.members, g.rank, g.seq or 0, where, failed_piece, tree)
        return transfer.Graph(link, self.state.plans, self.offers, g.level, config.settings.once_fanout)


def _import_fingerprints(fingerprints: list[GraphFingerprint]) -> None:
    """The levels of an artifact this rank did not compile count as its own: the same code runs."""
    if fingerprints:
        audit.import_graphs(fingerprints)


@contextlib.contextmanager
def _added(times: Times, field: str) -> Iterator[None]:
    """The time the block took, added to ``times``' ``field`` (whether or not it raised)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        setattr(times, field, getattr(times, field) + time.perf_counter() - t0)
