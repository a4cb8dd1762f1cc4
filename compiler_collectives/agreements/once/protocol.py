"""Compile once's protocol: one ticket per AOTAutograd (or fallback FX) compile, and the
key, result and load-report exchanges that carry it, with the loader's wait and the artifact's
transfer over the job's gloo group. The flow is told in the package's docstring (``__init__``).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from types import MappingProxyType
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
from ...ledger import ledger
from ...observations import FrameId
from ...records import (
    Failure,
    OnceGraph,
    OnceKeys,
    OnceLoadReport,
    OncePlanned,
    OnceTreeExchange,
    OnceWait,
)
from ...transport import HostTree, groups
from .. import audit, compile_wait, phases
from .. import exchange as exchange_frame
from .. import failure as failure_procedure
from ..fingerprint import GraphFingerprint
from ..wire.once import (
    WARMTH_FX,
    WARMTH_MAX_ENTRIES,
    Loaded,
    ManifestFile,
    Offer,
    Result,
    decode_once,
    encode_once,
)
from . import artifact, keys, sidecar, tally, transfer
from .plan import COMPILE, LOAD, LOCAL, SERVE, Plan, decide, fallback_allowed

log = logging.getLogger("compiler_collectives.once")


_local = threading.local()  # ticket: Ticket | None
_seq = 0
# What the last full key exchange of this generation saw that stays from graph to graph.
_known: keys.Known | None = None
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
    # This rank's own compile of the graph raised (``finish``): its text.
    failure: str | None = None
    # The graph's record (``records()``'s item), once made: made once, and counted once (``tally``).
    record: dict[str, Any] | None = None


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
    ledger.add(OncePlanned(ticket.seq or 0))
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
            lambda: HostTree.build(pg, keys.record_width, where, phases.HOST_TREE),
            kind="compile_once",
            seq=ticket.seq,
            frame=str(ticket.frame),
            where=where,
        )
    return tree


def _settle_keys(ticket: Ticket, mine: Offer) -> dict[int, Offer]:
    """Every rank's offer: from one fixed-size MIN over the host tree when, for each index on a
    host, every host's rank of that index has the same key (and the cache dirs are those of the
    last full exchange), else from a gather of every offer over the tree (``keys`` builds the
    record and reads it back). Every rank takes both steps or the first only, by the MIN's
    outcome: the same everywhere."""
    global _known
    kept, seq = _known, ticket.seq or 0
    tree = _host_tree(ticket)
    record = keys.record(mine, kept, members=ticket.members, tree=tree, seq=seq, level=ticket.level)
    out = _min(ticket, tree, record, phases.ONCE_KEYS, "keys")
    settled = keys.offers(out, mine, kept, members=ticket.members, tree=tree, seq=seq)
    if settled is not None:
        ledger.add(OnceKeys(reduced=True))
        return settled
    ledger.add(OnceKeys(reduced=False))
    offers = _gather(ticket, mine, phases.ONCE_KEYS, "keys")
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
        return False
    if result.status == "failed":
        ticket.outcome, ticket.outcome_why = "none", "the compiling rank's compile raised"
        _report(ticket)  # the serving rank takes it too before raising its own error
        raise _once_error(
            ticket,
            f"rank {ticket.rank}: rank {plan.source} compiled graph #{ticket.seq} of {ticket.frame} for this rank "
            f"and its compile raised: {result.failure}. This rank does not compile it again; see rank "
            f"{plan.source}'s log for the traceback. COMPILER_COLLECTIVES_COMPILE_ONCE=0 makes every rank "
            "compile its own graphs.",
            (plan.source,),
        )
    why = _install(ticket, result)
    if why is not None:
        ticket.outcome, ticket.outcome_why = "refused", why
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
        if ticket.hit is not None and ticket.sent_entries and ticket.hit not in ticket.sent_entries:
            _own_entry_hit(ticket)
        else:
            # Only on a hit: a rank whose lookup missed compiles, and fingerprints its own levels.
            _import_fingerprints(ticket.fingerprints)
            sidecar.write(ticket.cache.root(), ticket.key, ticket.fingerprints)
    elif hit is False:
        ticket.outcome, ticket.outcome_why = "miss", "the entry's guards fail this rank's size hints"
    _report(ticket)


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
    if error is not None:
        ticket.failure = failure_text or f"{type(error).__name__}: {error}"
    if step is Step.OPEN:
        ticket.step = Step.DONE
        if error is None:
            ticket.plan = Plan(LOCAL, None, no_lookup, False)
            _record(ticket)
        return
    assert plan is not None
    if step is Step.REPORTED and plan.role == LOAD and ticket.rank in ticket.local:
        # The loader's own compile after a refused or missed load ended: the ranks that loaded
        # wait for this post (its compile takes as long as the source's did, so their next
        # exchange would otherwise measure it against COMPILER_COLLECTIVES_TIMEOUT).
        ticket.step = Step.DONE
        said = b"ok" if error is None else (failure_text or f"{type(error).__name__}: {error}").encode()[:2000]
        _post(ticket, _compiled_itself, said, "its own compile of this graph ended")
        _wait_for_local_compiles(ticket, raised_here=error is not None)
        return
    if step is not Step.PLANNED:
        return
    if not _any_source(ticket):
        ticket.step = Step.DONE
        _record(ticket)
        return
    if plan.role == LOAD:
        return  # its exchanges are done
    _raise_if_a_loader_gave_up(ticket)
    mine = Result("none", None, [], [])
    bundle = b""
    if plan.role in (COMPILE, SERVE):
        if ticket.failure is not None:
            mine = Result("failed", ticket.failure[:500], [], [])
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
        _post(ticket, _notice, b"1", "its compile of this graph ended")
        ticket.posted_at = time.time()
    _wait_for_sources(ticket)
    results = _results(ticket, mine)
    if plan.role in (COMPILE, SERVE):
        ticket.transfer_s += transfer.serve(_transfer(ticket), bundle, results[ticket.rank])
    _report(ticket)
    ticket.step = Step.DONE


def _report(ticket: Ticket) -> None:
    """The load report (``_load_report``, which makes the graph's record); when it raises (an
    exchange failed, a rank that compiled the graph itself raised), the record is made all the
    same: this rank's outcome still counts."""
    try:
        _load_report(ticket)
    except BaseException:
        _record(ticket)
        raise


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
    ledger.add(Failure("compile_once"))
    return error


def _once_error(ticket: Ticket, message: str, ranks: tuple[int, ...]) -> CompileOnceError:
    """Compile once's own error about this ticket's graph, naming ``ranks``, counted (``_failed``)."""
    return _failed(
        CompileOnceError(
            message, kind="compile_once", rank=ticket.rank, seq=ticket.seq, frame=str(ticket.frame), ranks=ranks
        )
    )


def abandon(ticket: Ticket) -> None:
    """Drop ``ticket`` without further exchanges (ours failed during its compile)."""
    _local.ticket = ticket.outer


def records() -> list[dict[str, Any]]:
    """Per graph, this rank's part: compiled, served, loaded, or compiled locally, and why."""
    return [dict(g.record) for g in ledger.kept(OnceGraph)]


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


# ------------------------------------------------------------------ exchanges


def _where(ticket: Ticket, what: str) -> Callable[[], str]:
    return lambda: f"compile once #{ticket.seq} ({what}) of {ticket.frame} on rank {ticket.rank}"


def _min(ticket: Ticket, tree: HostTree, record: list[int], phase: int, what: str) -> list[int]:
    """The element-wise MIN of every rank's ``record`` over the host tree, in this graph's ``phase``."""
    ledger.add(OnceTreeExchange(what))
    pg, where = ticket.pg, _where(ticket, what)
    stamp = HostTree.stamp(phase, ticket.seq or 0)
    return exchange_frame.framed(
        pg,
        lambda: tree.min_ints(pg, record, where, stamp, lambda i: ticket.members[i]),
        kind="compile_once",
        seq=ticket.seq,
        frame=str(ticket.frame),
        where=where,
    )


_BODIES = {phases.ONCE_KEYS: "keys", phases.ONCE_RESULT: "result", phases.ONCE_LOADED: "loaded"}


def _gather(
    ticket: Ticket, body: Offer | Result | Loaded | None, phase: int, what: str
) -> dict[int, Offer | Result | Loaded]:
    """The ``body`` of every rank that has one (global rank -> body; None: this rank has none),
    on every rank, over the host tree (``HostTree.gather``): O(log hosts) rounds, and bytes per
    rank those of the bodies, not of the world."""
    tree = _host_tree(ticket)
    pg, seq, where = ticket.pg, ticket.seq or 0, _where(ticket, what)
    limit = config.settings.max_payload_bytes
    payload = None if body is None else encode_once(rank=ticket.rank, world_size=pg.size(), seq=seq, body=body)

    def step() -> dict[int, Offer | Result | Loaded]:
        got = tree.gather(pg, payload, HostTree.stamp(phase, seq), limit, where, lambda i: ticket.members[i])
        out: dict[int, Offer | Result | Loaded] = {}
        for i, data in sorted(got.items()):
            sender = ticket.members[i]
            envelope = decode_once(data, sender=sender, max_bytes=limit, expected_world_size=pg.size())
            if envelope.seq != seq or envelope.kind != _BODIES[phase]:
                raise CollectiveDesyncError(
                    f"{where()}: rank {sender} sent its {envelope.kind} of compile once #{envelope.seq} in this "
                    f"rank's exchange of {_BODIES[phase]} of #{seq}: the ranks are at different graphs.\n"
                    "Every rank must compile the same graphs in the same order.",
                    ranks=(sender,),
                )
            out[sender] = envelope.body
        return out

    return exchange_frame.framed(pg, step, kind="compile_once", seq=ticket.seq, frame=str(ticket.frame), where=where)


def _any_source(ticket: Ticket) -> bool:
    return any(p.role in (COMPILE, SERVE) for p in ticket.plans.values())


def _notice(ticket: Ticket, rank: int) -> str:
    return f"once/{ticket.seq}/{rank}"


def _installed(ticket: Ticket, rank: int) -> str:
    return f"once/{ticket.seq}/in/{rank}"


def _compiled_itself(ticket: Ticket, rank: int) -> str:
    return f"once/{ticket.seq}/local/{rank}"


def _post(ticket: Ticket, notice: Callable[[Ticket, int], str], value: bytes, telling: str) -> None:
    """Post this rank's ``notice`` for the ranks waiting for it (``compile_wait.post``: a failed
    store raises our ``StoreFailureError``, published); ``telling``: what the post tells them."""
    compile_wait.post(
        notice(ticket, ticket.rank),
        value,
        me=ticket.rank,
        what=f"compile once #{ticket.seq} of {ticket.frame}",
        telling=telling,
        kind="compile_once",
        seq=ticket.seq,
        frame=str(ticket.frame),
    )


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
        raise _once_error(
            ticket,
            f"rank {ticket.rank}: rank {r} compiled graph #{ticket.seq} of {ticket.frame} itself (it did not load "
            f"the artifact) and its compile raised: {text.decode('utf-8', 'replace')}. Every rank leaves a graph's "
            f"compile together, so this rank raises too; see rank {r}'s log for the traceback. "
            "COMPILER_COLLECTIVES_COMPILE_ONCE=0 makes every rank compile its own graphs.",
            tuple(raised),
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
    ledger.add(OnceWait(waited))
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
    """Every serving rank's result (global rank -> result), on every rank: one gather over the
    host tree to which only the serving ranks contribute (the plans say who they are), however
    many there are."""
    t0 = time.perf_counter()
    ledger.add(OnceTreeExchange("result"))
    plan = ticket.plan
    source = plan is not None and plan.role in (COMPILE, SERVE)
    out = _gather(ticket, mine if source else None, phases.ONCE_RESULT, "result")
    for r, p in ticket.plans.items():
        body = out.get(r)
        if body is None and p.role not in (COMPILE, SERVE):
            continue
        bad = not isinstance(body, Result) or (p.role in (COMPILE, SERVE)) != (body.status != "none")
        if bad:
            raise _once_error(
                ticket,
                f"compile once #{ticket.seq} of {ticket.frame}: rank {r} sent a result that does not fit "
                f"its role ({p.role}); the ranks disagree about the plan (a version or setting differs).",
                (r,),
            )
    ticket.exchange_s += time.perf_counter() - t0
    return out  # type: ignore[return-value]


def _load_report(ticket: Ticket) -> None:
    """Who did not load (a miss or a refusal): first one MIN of a flag over the host tree; only
    when some rank did not load, a gather over the tree to which only those ranks contribute,
    for the names and the reasons."""
    ticket.step = Step.REPORTED
    t0 = time.perf_counter()
    loaded_here = ticket.outcome not in ("miss", "refused")
    tree = _host_tree(ticket)
    if _min(ticket, tree, [1 if loaded_here else 0], phases.ONCE_LOADED, "load report")[0] == 1:
        ticket.local = ()
        ticket.exchange_s += time.perf_counter() - t0
        _wait_for_local_compiles(ticket)
        _record(ticket)
        return
    ledger.add(OnceTreeExchange("load report"))
    mine = None if loaded_here else Loaded(ticket.outcome, ticket.outcome_why)
    details = _gather(ticket, mine, phases.ONCE_LOADED, "load report")
    ledger.add(OnceLoadReport(len(details)))
    for r, body in details.items():
        assert isinstance(body, Loaded)
        plan = ticket.plans.get(r)
        log.warning(
            "compile once #%d of %s: rank %d did not load rank %s's artifact (%s: %s); it compiled locally",
            ticket.seq,
            ticket.frame,
            r,
            plan.source if plan is not None else "?",
            body.outcome,
            body.why,
        )
    ticket.local = tuple(details)
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
    """The graph's record (``records()``), once per ticket, kept by the ledger (which counts it)."""
    plan = ticket.plan
    if plan is None or ticket.record is not None:
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
    ticket.record = {
        "seq": ticket.seq,
        "frame": str(ticket.frame),
        "level": ticket.level,
        "key": ticket.key,
        "state": state,
        "ended": tally.ended(plan.role, ticket.outcome, ticket.failure is not None),
        "why": why,
        "source": plan.source,
        "peers_local": [r for r in ticket.local if r != ticket.rank],
        "waited_s": round(ticket.waited_s, 3),
        "exchange_s": round(ticket.exchange_s, 6),
        "install_s": round(ticket.install_s, 6),
        "transfer_s": round(ticket.transfer_s, 6),
        "span_s": round((time.time_ns() - ticket.started_ns) / 1e9, 6),
        "artifact_bytes": ticket.artifact_bytes,
        "posted_at": ticket.posted_at,
        "wait_ended_at": ticket.wait_ended_at,
    }
    ledger.add(
        OnceGraph(ticket.record["ended"], len(ticket.record["peers_local"]), MappingProxyType(dict(ticket.record)))
    )
    if _on_record is not None:
        _on_record(ticket, ticket.record)
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


def _transfer(ticket: Ticket) -> transfer.Graph:
    """The graph's transfer (``transfer.Graph``); a failed piece is published and counted here."""
    where = _where(ticket, "artifact")

    def failed(error: CollectiveError) -> CollectiveError:  # counted by the failure procedure
        return failure_procedure.fail(
            error, kind="compile_once", rank=ticket.rank, seq=ticket.seq, frame=str(ticket.frame), where=where
        )

    link = transfer.Link(ticket.pg, ticket.members, ticket.rank, ticket.seq or 0, where, failed)
    return transfer.Graph(link, ticket.plans, ticket.offers, ticket.level, config.settings.once_fanout)


def _install(ticket: Ticket, result: Result) -> str | None:
    """A loader: the source's files received (or found in its dir), checked and installed
    (``transfer.receive_and_install``), its time and bytes on the ticket; None, or why it refused.
    The ranks of one dir hear of their receiver's install through the store."""
    plan = ticket.plan
    assert plan is not None and plan.source is not None

    def installed(via: int) -> bytes:
        return _wait_for_posts(ticket, [via], _installed, "receive the artifact for this cache dir")[via]

    def post(said: bytes) -> None:
        _post(ticket, _installed, said, "it installed the artifact for this cache dir")

    here = transfer.Dir(ticket.cache.root(), _entry_prefix(ticket), ticket.key, installed, post)
    done = transfer.receive_and_install(_transfer(ticket), result, plan.source, here)
    ticket.transfer_s += done.transfer_s
    ticket.install_s += done.install_s
    ticket.bytes_in += done.bytes_in
    if done.refetched is not None:
        ticket.outcome_why = done.refetched  # the graph's record says where the bytes came from
    return done.refusal
