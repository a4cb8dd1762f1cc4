"""Compile once's protocol: one ticket per AOTAutograd (or fallback FX) compile, and the
key, result and load-report exchanges that carry it, with the loader's wait and the artifact's
transfer over the job's gloo group. The flow is told in the package's docstring (``__init__``).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from ... import config, health, process_state
from ...errors import (
    CollectiveDesyncError,
    CollectiveError,
    CompileOnceError,
    PeerFailureError,
    SetupMismatchError,
)
from ...instrument import timing
from ...observations import FrameId
from ...stats import counters
from ...transport import (
    PHASE_ONCE_KEYS,
    PHASE_ONCE_LOADED,
    PHASE_ONCE_RESULT,
    HostTree,
    groups,
)
from .. import audit, compile_wait
from .. import exchange as exchange_frame
from .. import failure as failure_procedure
from ..fingerprint import GraphFingerprint
from ..wire.once import (
    WARMTH_FX,
    WARMTH_MAX_ENTRIES,
    Loaded,
    ManifestFile,
    Offer,
    OnceEnvelope,
    Result,
    decode_once,
    encode_once,
)
from . import artifact, keys, sidecar, transfer
from .plan import COMPILE, LOAD, LOCAL, SERVE, Plan, decide, fallback_allowed

log = logging.getLogger("compiler_collectives.once")


_local = threading.local()  # ticket: Ticket | None
_seq = 0
# What the last full key exchange of this generation saw that stays from graph to graph.
_known: keys.Known | None = None
_records: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
# The compile group's ranks by host (``transport.HostTree``), built at a generation's first graph.
_tree: HostTree | None = None


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
    # Our error raised inside AOTAutograd's lookup, which takes any exception for a cache bypass:
    # the seam keeps it here and raises it once the lookup returns.
    error: CollectiveError | None = None


# ------------------------------------------------------------------ seam entry points


@process_state.kept(names=("_local",), why="the graph this thread compiles, set and restored by its compile")
def begin(frame: FrameId, cache: Cache, level: str = "aot", graph: str = "") -> Ticket:
    """Open the ticket of one AOTAutograd compile (``level`` "aot"), or of one inductor compile
    inside it (``level`` "fx"), on this thread (its cache lookup may follow)."""
    record = audit.current()
    ticket = Ticket(frame, cache, len(record.graphs) if record is not None else None, level=level, graph=graph)
    ticket.outer = current()  # a compile nested in another (a subgraph): the outer one resumes after
    _local.ticket = ticket
    return ticket


def current() -> Ticket | None:
    return getattr(_local, "ticket", None)


def note_fx_key(key: str) -> None:
    """The FX graph cache looked ``key`` up during the current compile."""
    ticket = current()
    if ticket is not None and ticket.plan is not None and key not in ticket.fx_keys:
        ticket.fx_keys.append(key)


def note_source(path: str) -> None:
    """Inductor wrote (or found) a kernel source at ``path`` during the current compile."""
    ticket = current()
    if ticket is not None and ticket.plan is not None and path.endswith(".cpp") and path not in ticket.sources:
        ticket.sources.append(path)


def note_hit(entry: bytes) -> None:
    """The current compile's cache lookup hit the entry whose bytes are ``entry``."""
    ticket = current()
    if ticket is not None and ticket.plan is not None and ticket.plan.role == LOAD:
        ticket.hit = hashlib.sha256(entry).digest()


def offer(ticket: Ticket, key: str | None, why: str | None, switches: Sequence[str]) -> Plan:
    """The key exchange; returns this rank's plan."""
    global _seq
    t0 = time.perf_counter()
    ticket.pg = groups.compile_pg()  # first: a new default group noticed here clears ``_seq``
    _seq += 1
    ticket.seq = _seq
    ticket.key = key
    ticket.members = tuple(groups.member_ranks(ticket.pg))
    ticket.rank = ticket.members[ticket.pg.rank()]
    cache_root = ticket.cache.root()
    holds = key is not None and artifact.holds(_entry_dir(ticket, key))
    mine = Offer(
        key,
        why,
        holds,
        artifact.dir_identity(cache_root),
        sorted(switches),
        config.settings.max_artifact_bytes,
        ticket.graph,
        0 if holds else _warmth(ticket, key),
    )
    ticket.offers = _settle_keys(ticket, mine)
    rank = ticket.rank
    try:
        ticket.plans = decide(ticket.offers, ticket.seq, me=rank)
    except SetupMismatchError as e:
        _failed(e)
        raise
    ticket.plan = ticket.plans[rank]
    ticket.step = Step.PLANNED
    ticket.fx_allowed = ticket.level == "aot" and fallback_allowed(ticket.offers)
    counters.once_exchanges += 1
    ticket.exchange_s += time.perf_counter() - t0
    if ticket.plan.role == LOCAL:
        log.info(
            "compile once #%d of %s: rank %d compiles it itself: %s", ticket.seq, ticket.frame, rank, ticket.plan.why
        )
    else:
        log.debug("compile once #%d of %s: %s", ticket.seq, ticket.frame, ticket.plan)
    return ticket.plan


def _host_tree(ticket: Ticket) -> HostTree:
    """The compile group's ranks by host; built at the generation's first graph (every rank together)."""
    global _tree
    tree = _tree
    if tree is None or tree.size != ticket.pg.size():
        pg = ticket.pg
        where = _where(ticket, "hosts")
        tree = _tree = exchange_frame.framed(
            pg,
            lambda: HostTree.build(pg, keys.record_width, where),
            kind="compile_once",
            seq=ticket.seq,
            frame=str(ticket.frame),
            where=where,
        )
    return tree


def _settle_keys(ticket: Ticket, mine: Offer) -> dict[int, Offer]:
    """Every rank's offer: from one fixed-size MIN over the host tree when, for each index on a
    host, every host's rank of that index has the same key (and the cache dirs are those of the
    last full exchange), else from an all-gather of every offer (``keys`` builds the record and
    reads it back). Every rank takes both steps or the first only, by the MIN's outcome: the
    same everywhere."""
    global _known
    kept, seq = _known, ticket.seq or 0
    tree = _host_tree(ticket)
    record = keys.record(mine, kept, members=ticket.members, tree=tree, seq=seq, level=ticket.level)
    counters.once_tree_exchanges += 1
    out = exchange_frame.framed(
        ticket.pg,
        lambda: tree.min_ints(ticket.pg, record, _where(ticket, "keys")),
        kind="compile_once",
        seq=ticket.seq,
        frame=str(ticket.frame),
        where=_where(ticket, "keys"),
    )
    settled = keys.offers(out, mine, kept, members=ticket.members, tree=tree, seq=seq)
    if settled is not None:
        counters.once_keys_reduced += 1
        return settled
    gathered = _gather(ticket, mine, PHASE_ONCE_KEYS, "keys")
    offers = {e.rank: e.body for e in gathered}
    _known = keys.known(ticket.members, offers)  # type: ignore[arg-type]
    return offers  # type: ignore[return-value]


def _warmth(ticket: Ticket, key: str | None) -> int:
    """How warm this rank's cache is for compiling ``key`` without its entry (``WARMTH_*``)."""
    root = ticket.cache.root()
    if ticket.level == "aot" and key is not None:
        fx_keys = sidecar.read_fx_keys(root, key, ticket.rank)
        if fx_keys and all(artifact.holds(ticket.cache.fx_dir(k)) for k in fx_keys):
            return WARMTH_FX
    # Entries of earlier graphs: the kernels they built are likely to serve this one too.
    return artifact.count_entries(os.path.join(root, "fxgraph"), WARMTH_MAX_ENTRIES)


def fetch(ticket: Ticket) -> bool:
    """A loading rank: wait for the source, take the result exchange, receive and check the
    artifact. True when it is installed (the cache lookup then finds it); False when refused
    (the caller compiles without the cache and then reports with ``loaded``)."""
    plan = ticket.plan
    assert plan is not None and plan.role == LOAD and plan.source is not None
    _wait_for_sources(ticket)
    results = _results(ticket, Result("none", None, [], []))
    result = results[plan.source]
    ticket.artifact_bytes = result.total()
    if result.status == "failed" and (result.failure or "").startswith("gathering the artifact failed"):
        ticket.outcome, ticket.outcome_why = "refused", f"rank {plan.source} has no artifact: {result.failure}"
        counters.once_refused += 1
        return False
    if result.status == "failed":
        ticket.outcome, ticket.outcome_why = "none", "the compiling rank's compile raised"
        _load_report(ticket)  # the serving rank takes it too before raising its own error
        raise _failed(
            CompileOnceError(
                f"rank {ticket.rank}: rank {plan.source} compiled graph #{ticket.seq} of {ticket.frame} for this rank "
                f"and its compile raised: {result.failure}. This rank does not compile it again; see rank "
                f"{plan.source}'s log for the traceback. COMPILER_COLLECTIVES_COMPILE_ONCE=0 makes every rank "
                "compile its own graphs.",
                kind="compile_once",
                rank=ticket.rank,
                seq=ticket.seq,
                frame=str(ticket.frame),
                ranks=(plan.source,),
            )
        )
    _send_artifacts(ticket, results)
    why = _receive_and_install(ticket, result)
    if why is not None:
        ticket.outcome, ticket.outcome_why = "refused", why
        counters.once_refused += 1
        log.warning(
            "compile once #%d of %s: rank %d refused the artifact of rank %d (%s); it compiles the graph "
            "itself, without the cache",
            ticket.seq,
            ticket.frame,
            ticket.rank,
            plan.source,
            why,
        )
        return False
    ticket.fingerprints = result.fingerprints  # taken as this rank's own once the lookup hits
    prefix = _entry_prefix(ticket)
    ticket.sent_entries = frozenset(f.sha256 for f in result.manifest if f.relpath.startswith(prefix))
    return True


def loaded(ticket: Ticket, hit: bool | None) -> None:
    """A loading rank after its cache lookup: ``hit`` (None: refused before the lookup). Takes the
    load report exchange."""
    if hit is True:
        ticket.outcome = "hit"
        counters.once_loaded += 1
        if ticket.hit is not None and ticket.sent_entries and ticket.hit not in ticket.sent_entries:
            _own_entry_hit(ticket)
        else:
            # Only on a hit: a rank whose lookup missed compiles, and fingerprints its own levels.
            _import_fingerprints(ticket.fingerprints)
            sidecar.write(ticket.cache.root(), ticket.key, ticket.fingerprints)
    elif hit is False:
        ticket.outcome, ticket.outcome_why = "miss", "the entry's guards fail this rank's size hints"
        counters.once_load_misses += 1
    _load_report(ticket)


def _own_entry_hit(ticket: Ticket) -> None:
    """The lookup hit an entry of this rank's own cache for its key, not the one it was sent
    (torch looks at every entry of the key, in name order): this rank runs its own cache hit, and
    the audit takes the fingerprints kept with it, or compares it at Dynamo's level."""
    plan = ticket.plan
    assert plan is not None
    kept = sidecar.read(ticket.cache.root(), ticket.key, ticket.rank)
    ticket.outcome_why = (
        f"the lookup hit an entry this rank's cache already held for its key, not the one rank {plan.source} sent; "
        + (
            "audited with the fingerprints kept with it"
            if kept
            else "no fingerprints kept with it: audited at Dynamo's level"
        )
    )
    log.info("compile once #%d of %s: rank %d: %s", ticket.seq, ticket.frame, ticket.rank, ticket.outcome_why)
    _import_fingerprints(kept)


NO_LOOKUP = (
    "AOTAutograd did not look this graph up in its cache (a backend without AOTAutograd's cache, "
    "such as aot_eager, or caches off)"
)


def finish(
    ticket: Ticket, error: BaseException | None, failure_text: str | None = None, no_lookup: str = NO_LOOKUP
) -> None:
    """Every rank that is not loading, when its AOTAutograd compile ended (``error``: it raised):
    serving ranks publish their artifact; then the result and load-report exchanges. A compile
    that never looked its graph up took no exchange: it is recorded as local, ``no_lookup`` why."""
    _local.ticket = ticket.outer
    step, plan = ticket.step, ticket.plan
    if step is Step.OPEN:
        ticket.step = Step.DONE
        if error is None:
            ticket.plan = Plan(LOCAL, None, no_lookup, False)
            counters.once_local += 1
            _record(ticket)
        return
    assert plan is not None
    if step is Step.REPORTED and plan.role == LOAD and ticket.rank in ticket.local:
        # The loader's own compile after a refused or missed load ended: the ranks that loaded
        # wait for this post (its compile takes as long as the source's did, so their next
        # exchange would otherwise measure it against COMPILER_COLLECTIVES_TIMEOUT).
        ticket.step = Step.DONE
        said = b"ok" if error is None else (failure_text or f"{type(error).__name__}: {error}").encode()[:2000]
        groups.post(_compiled_itself(ticket, ticket.rank), said)
        _wait_for_local_compiles(ticket, raised_here=error is not None)
        return
    if step is not Step.PLANNED:
        return
    if not _any_source(ticket):
        ticket.step = Step.DONE
        counters.once_local += 1
        _record(ticket)
        return
    if plan.role == LOAD:
        return  # its exchanges are done
    _raise_if_a_loader_gave_up(ticket)
    mine = Result("none", None, [], [])
    bundle = b""
    if plan.role in (COMPILE, SERVE):
        if error is not None:
            mine = Result("failed", failure_text or f"{type(error).__name__}: {error}"[:500], [], [])
        else:
            t0 = time.perf_counter()
            try:
                manifest, bundle = _collect(ticket)
                fingerprints = _own_fingerprints(ticket)
                if plan.role == SERVE and not fingerprints:
                    fingerprints = sidecar.read(ticket.cache.root(), ticket.key, ticket.rank)
                    _import_fingerprints(fingerprints)
                elif fingerprints:
                    sidecar.write(ticket.cache.root(), ticket.key, fingerprints)
                chunk_bytes = config.settings.once_chunk_bytes if bundle else 0
                chunks = transfer.chunk_digests(bundle, chunk_bytes) if bundle else []
                mine = Result("ok", None, manifest, fingerprints, chunk_bytes, chunks)
                ticket.artifact_bytes = mine.total()
            except Exception as e:  # noqa: BLE001 - its loaders must hear of it, never wait for it
                log.warning("compile once #%d of %s: could not gather the artifact: %s", ticket.seq, ticket.frame, e)
                mine = Result("failed", f"gathering the artifact failed: {type(e).__name__}: {e}"[:500], [], [])
            ticket.install_s += time.perf_counter() - t0
        groups.post(_notice(ticket, ticket.rank), b"1")
        ticket.posted_at = time.time()
    _wait_for_sources(ticket)
    results = _results(ticket, mine)
    if plan.role in (COMPILE, SERVE):
        _send_artifacts(ticket, results, bundle)
        if error is None:
            counters.once_compiled += plan.role == COMPILE
            counters.once_served += plan.role == SERVE
    else:
        counters.once_local += 1
    _load_report(ticket)
    ticket.step = Step.DONE


def _raise_if_a_loader_gave_up(ticket: Ticket) -> None:
    """A peer published while this rank compiled (a loader's compile timeout, say): its report,
    as a ``PeerFailureError`` naming this graph, instead of an exchange nobody else takes."""
    heard = health.poisoned()
    if isinstance(heard, PeerFailureError) and heard.reported_by:
        raise _failed(
            PeerFailureError(
                f"compile once #{ticket.seq} of {ticket.frame} on rank {ticket.rank}: while this rank compiled, "
                f"{heard}",
                kind="compile_once",
                rank=ticket.rank,
                seq=ticket.seq,
                frame=str(ticket.frame),
                ranks=heard.ranks,
                reported_by=heard.reported_by,
            )
        ) from heard


_E = TypeVar("_E", bound=CollectiveError)


def _failed(error: _E) -> _E:
    """Every error compile once raises of its own passes here: the one place it is counted (``errors``)."""
    counters.errors += 1
    return error


def abandon(ticket: Ticket) -> None:
    """Drop ``ticket`` without further exchanges (ours failed during its compile)."""
    _local.ticket = ticket.outer


def records() -> list[dict[str, Any]]:
    """Per graph, this rank's part: compiled, served, loaded, or compiled locally, and why."""
    return list(_records)


@process_state.clears(
    *process_state.EVERY_GENERATION,
    names=("_seq", "_known", "_tree"),
    what="compile once's graph numbers, the cache dirs its last key exchange saw, and its ranks by host",
)
def reset_sequence() -> None:
    """A new generation of our groups numbers its graphs from 1 again, and learns its hosts and
    gathers every offer at its first graph (every rank together)."""
    global _seq, _known, _tree
    _seq = 0
    _known = None
    _tree = None


@process_state.clears(process_state.STATS, names=("_records",), what="compile once's record of each graph")
def clear_records() -> None:
    _records.clear()


# ------------------------------------------------------------------ exchanges


def _where(ticket: Ticket, what: str) -> Callable[[], str]:
    return lambda: f"compile once #{ticket.seq} ({what}) of {ticket.frame} on rank {ticket.rank}"


def _gather(ticket: Ticket, body: Offer | Result | Loaded, phase: int, what: str) -> list[OnceEnvelope]:
    pg = ticket.pg
    rank, world = ticket.rank, pg.size()
    seq = ticket.seq or 0
    payload = encode_once(rank=rank, world_size=world, seq=seq, body=body)

    def check(envelopes: Sequence[OnceEnvelope], me: int) -> None:
        if len({e.seq for e in envelopes}) > 1:
            lines = "\n".join(f"  rank {e.rank}: compile once #{e.seq}" for e in envelopes)
            raise CollectiveDesyncError(
                f"compile once on rank {me}: the ranks are at different graphs:\n{lines}\n"
                "Every rank must compile the same graphs in the same order.",
                ranks=tuple(e.rank for e in envelopes if e.seq != seq),
            )

    counters.once_gathers += 1
    gathered = exchange_frame.gather(
        pg,
        payload,
        kind="compile_once",
        seq=seq,
        frame=str(ticket.frame),
        where=_where(ticket, what),
        decode=decode_once,
        check=check,
        phase=phase,
    )
    return list(gathered.envelopes)


def _any_source(ticket: Ticket) -> bool:
    return any(p.role in (COMPILE, SERVE) for p in ticket.plans.values())


def _notice(ticket: Ticket, rank: int) -> str:
    return f"once/{ticket.seq}/{rank}"


def _installed(ticket: Ticket, rank: int) -> str:
    return f"once/{ticket.seq}/in/{rank}"


def _compiled_itself(ticket: Ticket, rank: int) -> str:
    return f"once/{ticket.seq}/local/{rank}"


def _wait_for_local_compiles(ticket: Ticket, raised_here: bool = False) -> None:
    """Wait until every rank that did not load (but this one) posted that its own compile ended:
    every rank leaves the graph's compile with the slowest, as it waited for the source. One
    whose compile raised is named, quoting its error (unless this rank's own compile raised:
    that error is the one this rank raises)."""
    pending = [r for r in ticket.local if r != ticket.rank]
    said = _wait_counted(ticket, pending, _compiled_itself, "compile this graph itself (it did not load the artifact)")
    raised = {r: text for r, text in sorted(said.items()) if text != b"ok"}
    if raised and not raised_here:
        r, text = next(iter(raised.items()))
        raise _failed(
            CompileOnceError(
                f"rank {ticket.rank}: rank {r} compiled graph #{ticket.seq} of {ticket.frame} itself (it did not load "
                f"the artifact) and its compile raised: {text.decode('utf-8', 'replace')}. Every rank leaves a graph's "
                f"compile together, so this rank raises too; see rank {r}'s log for the traceback. "
                "COMPILER_COLLECTIVES_COMPILE_ONCE=0 makes every rank compile its own graphs.",
                kind="compile_once",
                rank=ticket.rank,
                seq=ticket.seq,
                frame=str(ticket.frame),
                ranks=tuple(raised),
            )
        )


def _wait_for_sources(ticket: Ticket) -> None:
    """Wait until every serving rank (but this one) posted that it is done."""
    me = ticket.rank
    pending = sorted({r for r, p in ticket.plans.items() if p.role in (COMPILE, SERVE) and r != me})
    if pending:
        _wait_counted(ticket, pending, _notice, "compile this graph for this rank")
        ticket.wait_ended_at = time.time()


def _wait_counted(
    ticket: Ticket, ranks: list[int], notice: Callable[[Ticket, int], str], doing: str
) -> dict[int, bytes]:
    """``_wait_for_posts``, its time added to the graph's ``waited_s`` and ``once_wait_s``."""
    if not ranks:
        return {}
    started = time.monotonic()
    said = _wait_for_posts(ticket, ranks, notice, doing)
    waited = time.monotonic() - started
    ticket.waited_s += waited
    counters.once_wait_s += waited
    return said


def _wait_for_posts(
    ticket: Ticket, ranks: list[int], notice: Callable[[Ticket, int], str], doing: str
) -> dict[int, bytes]:
    """What each of ``ranks`` posted under ``notice``, once all have (``compile_wait``)."""
    return compile_wait.wait_for_posts(
        {r: notice(ticket, r) for r in ranks},
        me=ticket.rank,
        doing=doing,
        what=f"compile once #{ticket.seq} of {ticket.frame}",
        kind="compile_once",
        seq=ticket.seq,
        frame=str(ticket.frame),
        on_timeout=CompileOnceError,
        advice="Raise COMPILER_COLLECTIVES_COMPILE_TIMEOUT if compiles legitimately take that long, or set "
        "COMPILER_COLLECTIVES_COMPILE_ONCE=0.",
    )


def _results(ticket: Ticket, mine: Result) -> dict[int, Result]:
    """Every serving rank's result (global rank -> result), on every rank.

    Only serving ranks have one: each is broadcast down a binomial tree over the group
    (``HostTree.broadcast``), sources in rank order, when there are at most as many as ranks on
    a host (a GPU job's: one per device index); with more, one all-gather of every rank's."""
    t0 = time.perf_counter()
    sources = sorted(r for r, p in ticket.plans.items() if p.role in (COMPILE, SERVE))
    tree = _tree
    if tree is None or len(sources) > tree.ranks_per_host:
        gathered = _gather(ticket, mine, PHASE_ONCE_RESULT, "result")
        out = {e.rank: e.body for e in gathered}
    else:
        counters.once_tree_exchanges += 1
        out = {r: _broadcast_result(ticket, tree, r, mine) for r in sources}
    for r, p in ticket.plans.items():
        body = out.get(r)
        if body is None and p.role not in (COMPILE, SERVE):
            continue
        bad = not isinstance(body, Result) or (p.role in (COMPILE, SERVE)) != (body.status != "none")
        if bad:
            raise _failed(
                CompileOnceError(
                    f"compile once #{ticket.seq} of {ticket.frame}: rank {r} sent a result that does not fit "
                    f"its role ({p.role}); the ranks disagree about the plan (a version or setting differs).",
                    kind="compile_once",
                    rank=ticket.rank,
                    seq=ticket.seq,
                    frame=str(ticket.frame),
                    ranks=(r,),
                )
            )
    ticket.exchange_s += time.perf_counter() - t0
    return out  # type: ignore[return-value]


def _broadcast_result(ticket: Ticket, tree: HostTree, source: int, mine: Result) -> Result | Offer | Loaded:
    """``source``'s result, broadcast from it over the tree; its graph number checked here."""
    pg, seq, where = ticket.pg, ticket.seq or 0, _where(ticket, "result")
    index = ticket.members.index(source)
    payload = encode_once(rank=ticket.rank, world_size=pg.size(), seq=seq, body=mine) if source == ticket.rank else None
    stamp = (PHASE_ONCE_RESULT << 32) | seq

    def step() -> Result | Offer | Loaded:
        sent, data = tree.broadcast(
            pg, index, payload, stamp, config.settings.max_payload_bytes, where, lambda i: ticket.members[i]
        )
        envelope = None
        if sent == stamp:
            envelope = decode_once(
                data, sender=source, max_bytes=config.settings.max_payload_bytes, expected_world_size=pg.size()
            )
        if envelope is None or envelope.seq != seq or envelope.rank != source:
            theirs = f"#{sent & 0xFFFFFFFF} (phase {sent >> 32})" if envelope is None else f"#{envelope.seq}"
            raise CollectiveDesyncError(
                f"compile once on rank {ticket.rank}: rank {source} sent its result of compile once {theirs} while "
                f"this rank is at #{seq} (phase {PHASE_ONCE_RESULT}): the ranks are at different graphs.\n"
                "Every rank must compile the same graphs in the same order.",
                ranks=(source,),
            )
        return envelope.body

    return exchange_frame.framed(pg, step, kind="compile_once", seq=ticket.seq, frame=str(ticket.frame), where=where)


def _load_report(ticket: Ticket) -> None:
    """Who did not load (a miss or a refusal): first one MIN of flags over the host tree; only
    when some rank did not load (or the ranks are at different graphs), the all-gather of every
    rank's outcome, for the names and the reasons."""
    ticket.step = Step.REPORTED
    t0 = time.perf_counter()
    seq = ticket.seq or 0
    loaded_here = ticket.outcome not in ("miss", "refused")
    tree = _tree
    if tree is not None:
        counters.once_tree_exchanges += 1
        pg = ticket.pg
        record = [PHASE_ONCE_LOADED, -PHASE_ONCE_LOADED, seq, -seq, 1 if loaded_here else 0]
        out = exchange_frame.framed(
            pg,
            lambda: tree.min_ints(pg, record, _where(ticket, "load report")),
            kind="compile_once",
            seq=ticket.seq,
            frame=str(ticket.frame),
            where=_where(ticket, "load report"),
        )
        if out[0] == -out[1] == PHASE_ONCE_LOADED and out[2] == -out[3] == seq and out[4] == 1:
            ticket.local = ()
            ticket.exchange_s += time.perf_counter() - t0
            _wait_for_local_compiles(ticket)
            _record(ticket)
            return
    gathered = _gather(ticket, Loaded(ticket.outcome, ticket.outcome_why), PHASE_ONCE_LOADED, "load report")
    for e in gathered:
        body = e.body
        assert isinstance(body, Loaded)
        if body.outcome in ("miss", "refused"):
            plan = ticket.plans.get(e.rank)
            log.warning(
                "compile once #%d of %s: rank %d did not load rank %s's artifact (%s: %s); it compiled locally",
                ticket.seq,
                ticket.frame,
                e.rank,
                plan.source if plan is not None else "?",
                body.outcome,
                body.why,
            )
            if e.rank != ticket.rank:
                counters.once_peer_local_compiles += 1
    ticket.local = tuple(e.rank for e in gathered if e.body.outcome in ("miss", "refused"))  # type: ignore[union-attr]
    ticket.exchange_s += time.perf_counter() - t0
    if ticket.rank not in ticket.local:
        _wait_for_local_compiles(ticket)
    _record(ticket)


# What else hears of each graph this rank finished (the seam's tlparse artifact); set by wiring.
_on_record: Callable[[Ticket, dict[str, Any]], None] | None = None


@process_state.wired(names=("_on_record",), what="each finished graph's artifact in torch's structured trace")
def set_on_record(fn: Callable[[Ticket, dict[str, Any]], None] | None) -> None:
    """Call ``fn(ticket, record)`` with each finished graph's record (``records()``'s item)."""
    global _on_record
    _on_record = fn


def _record(ticket: Ticket) -> None:
    plan = ticket.plan
    if plan is None:
        return
    if ticket.level == "aot" and ticket.fx_keys:
        sidecar.write_fx_keys(ticket.cache.root(), ticket.key, ticket.fx_keys)
    rec = timing.recorder
    if plan.role == LOAD:
        state = "loaded" if ticket.outcome == "hit" else "compiled locally"
        why = (ticket.outcome_why or plan.why) if ticket.outcome == "hit" else f"{ticket.outcome}: {ticket.outcome_why}"
    else:
        state = {COMPILE: "compiled", SERVE: "served", LOCAL: "compiled locally"}[plan.role]
        why = plan.why
    _records.append(
        {
            "seq": ticket.seq,
            "frame": str(ticket.frame),
            "level": ticket.level,
            "key": ticket.key,
            "state": state,
            "why": why,
            "source": plan.source,
            "waited_s": round(ticket.waited_s, 3),
            "exchange_s": round(ticket.exchange_s, 6),
            "install_s": round(ticket.install_s, 6),
            "transfer_s": round(ticket.transfer_s, 6),
            "span_s": round((time.time_ns() - ticket.started_ns) / 1e9, 6),
            "artifact_bytes": ticket.artifact_bytes,
            "posted_at": ticket.posted_at,
            "wait_ended_at": ticket.wait_ended_at,
        }
    )
    if _on_record is not None:
        _on_record(ticket, _records[-1])
    if rec is not None and ticket.seq is not None:
        rec.once(
            start_ns=ticket.started_ns,
            duration_s=(time.time_ns() - ticket.started_ns) / 1e9,
            seq=ticket.seq,
            frame=str(ticket.frame),
            state=state,
            why=why or "",
            source=plan.source,
            bytes_in=ticket.bytes_in,
        )


# ------------------------------------------------------------------ the audit's fingerprints


def _own_fingerprints(ticket: Ticket) -> list[GraphFingerprint]:
    record = audit.current()
    if record is None or ticket.audit_mark is None:
        return []
    return [g for g in record.graphs[ticket.audit_mark :] if g.level != "dynamo"]


def _import_fingerprints(fingerprints: list[GraphFingerprint]) -> None:
    """The levels of an artifact this rank did not compile count as its own: the same code runs."""
    if fingerprints:
        audit.import_graphs(fingerprints)


# ------------------------------------------------------------------ the artifact's transfer


def _entry_dir(ticket: Ticket, key: str) -> str:
    return ticket.cache.aot_dir(key) if ticket.level == "aot" else ticket.cache.fx_dir(key)


def _entry_prefix(ticket: Ticket) -> str:
    """Where the entry of this rank's own key lives, relative to its cache dir."""
    assert ticket.key is not None
    return os.path.relpath(_entry_dir(ticket, ticket.key), ticket.cache.root()) + os.sep


def _collect(ticket: Ticket) -> tuple[list[ManifestFile], bytes]:
    """Every file of this compile's artifact under the cache dir: the AOTAutograd and FX graph
    entries of its keys, and the kernel sources and binaries it built or found."""
    if ticket.level == "aot":
        dirs = ([ticket.cache.aot_dir(ticket.key)] if ticket.key else []) + [
            ticket.cache.fx_dir(k) for k in ticket.fx_keys
        ]
    else:
        dirs = [ticket.cache.fx_dir(ticket.key)] if ticket.key else []
    return artifact.collect(ticket.cache.root(), dirs, ticket.sources)


def _link(ticket: Ticket) -> transfer.Link:
    where = _where(ticket, "artifact")
    return transfer.Link(
        ticket.pg,
        ticket.members,
        ticket.rank,
        ticket.seq or 0,
        where,
        lambda e, peer, what: _transfer_failed(e, ticket, where, peer, what),
    )


def _routes(ticket: Ticket, source: int, result: Result) -> dict[int, transfer.Route]:
    return transfer.routes(source, result, ticket.plans, ticket.offers, ticket.level, config.settings.once_fanout)


def _send_artifacts(ticket: Ticket, results: dict[int, Result], bundle: bytes = b"") -> None:
    """A source sends its bytes to its children in the tree over the dirs of its loaders (the
    receivers forward them on as they take them: ``_receive_and_install``)."""
    plan = ticket.plan
    assert plan is not None
    if plan.role in (COMPILE, SERVE):
        result = results[ticket.rank]
        t0 = time.perf_counter()
        transfer.send(_link(ticket), bundle, result, _routes(ticket, ticket.rank, result)[ticket.rank])
        ticket.transfer_s += time.perf_counter() - t0


def _receive_and_install(ticket: Ticket, result: Result) -> str | None:
    """Receive (or find in this dir) the source's files and check each against its SHA-256;
    install them. None on success, else why they were refused (nothing was written then).

    A dir's receiver takes every byte its parent sends and forwards it whatever it then decides
    for itself: its subtree and its dir's readers must never wait on a decision only it made.

    Its time goes to the ticket's ``transfer_s`` (the bytes reaching this dir) and the rest,
    checking and installing, to its ``install_s``."""
    t0, moved = time.perf_counter(), ticket.transfer_s
    try:
        return _receive_and_install_timed(ticket, result)
    finally:
        ticket.install_s += time.perf_counter() - t0 - (ticket.transfer_s - moved)


def _receive_and_install_timed(ticket: Ticket, result: Result) -> str | None:
    plan = ticket.plan
    assert plan is not None and plan.source is not None
    problem = artifact.manifest_problem(result, plan.source, ticket.level)
    if problem is not None:
        return problem  # the same on every rank: no rank receives (``transfer.routes``)
    route = _routes(ticket, plan.source, result)[ticket.rank]
    got = transfer.Received(b"", None)
    if route.mode == transfer.RECEIVE:
        t0 = time.perf_counter()
        got = transfer.receive(_link(ticket), result, route, plan.source)
        ticket.transfer_s += time.perf_counter() - t0
        ticket.bytes_in = result.total()
    why = _refused(artifact.foreign_entry(result.manifest, _entry_prefix(ticket), ticket.key, ticket.level))
    if why is None:
        why = _place(ticket, result, route, got.data, got.refusal)
    if why is None and got.refetched is not None:
        ticket.outcome_why = got.refetched  # the graph's record says where the bytes came from
    if route.mode == transfer.RECEIVE and route.readers:
        groups.post(_installed(ticket, ticket.rank), b"ok" if why is None else why.encode()[:2000])
    return why


def _place(
    ticket: Ticket, result: Result, route: transfer.Route, data: bytes, received: artifact.Refusal | None
) -> str | None:
    """The files in place under this rank's cache dir, by its route; None, or why not."""
    plan = ticket.plan
    assert plan is not None and plan.source is not None
    root = ticket.cache.root()
    if route.mode == transfer.NONE:
        mine = ticket.offers[ticket.rank]
        return (
            f"the artifact is {result.total()} bytes, over COMPILER_COLLECTIVES_MAX_ARTIFACT_BYTES "
            f"({mine.max_artifact_bytes})"
        )
    if route.mode == transfer.SHARED:
        return _taken(ticket, artifact.check_shared(root, result.manifest, plan.source))
    if route.mode == transfer.READ:
        assert route.via is not None
        t0 = time.perf_counter()
        said = _wait_for_posts(ticket, [route.via], _installed, "receive the artifact for this cache dir")[route.via]
        ticket.transfer_s += time.perf_counter() - t0
        if said != b"ok":
            return f"rank {route.via}, which receives for this cache dir, did not install it: " + said.decode(
                "utf-8", "replace"
            )
        return _taken(ticket, artifact.check_shared(root, result.manifest, plan.source))
    if received is not None:
        return _refused(received)
    return _taken(ticket, transfer.install(root, result, data, plan.source))


def _taken(ticket: Ticket, outcome: artifact.Accepted | artifact.Refusal) -> str | None:
    """None when the artifact is in place, else why not. Files it replaced (torn or stale) or
    kernel binaries it kept (built here from the same source) are named for on-call."""
    if isinstance(outcome, artifact.Refusal):
        return _refused(outcome)
    if outcome.replaced or outcome.kept:
        log.info(
            "compile once #%d of %s: took the artifact; replaced %d file(s) whose bytes differed (torn or "
            "stale) %s; kept %d kernel binar(ies) built here from the same source %s",
            ticket.seq,
            ticket.frame,
            len(outcome.replaced),
            list(outcome.replaced[:10]),
            len(outcome.kept),
            list(outcome.kept[:10]),
        )
    return None


def _refused(refusal: artifact.Refusal | None) -> str | None:
    if refusal is None:
        return None
    if refusal.digest:
        counters.once_digest_mismatches += 1
    return refusal.why


def _transfer_failed(
    error: RuntimeError, ticket: Ticket, where: Callable[[], str], peer: int, what: str
) -> CollectiveError:
    """The error of a failed piece: gloo's own (a broken connection) names the one peer it was
    with, which the whole subtree below then hears in this rank's report."""
    if not isinstance(error, CollectiveError):
        error = PeerFailureError(
            f"{where()}: the connection to rank {peer} ({what}) broke: {error}. Rank {peer} most likely "
            f"crashed or was killed; check its log and exit status.",
            ranks=(peer,),
        )
    return _failed(
        failure_procedure.exchange_failed(
            error, kind="compile_once", rank=ticket.rank, seq=ticket.seq, frame=str(ticket.frame), where=where
        )
    )
