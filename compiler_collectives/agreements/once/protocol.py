"""Compile once's protocol: one ticket per AOTAutograd (or fallback FX) compile, and the
key, result and load-report exchanges that carry it, with the loader's wait and the artifact's
transfer over the job's gloo group. The flow is told in the package's docstring (``__init__``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ... import config, health
from ...errors import CollectiveDesyncError, CompileOnceError, PeerFailureError, SetupMismatchError, ranks_text
from ...instrument import timing
from ...state import FrameId
from ...stats import counters
from ...transport import (
    PHASE_ONCE_KEYS,
    PHASE_ONCE_LOADED,
    PHASE_ONCE_RESULT,
    groups,
    recv_bytes,
    send_bytes,
    wait,
)
from .. import audit
from .. import exchange as exchange_frame
from .. import failure as failure_procedure
from ..fingerprint import GraphFingerprint
from ..wire.once import Loaded, ManifestFile, Offer, OnceEnvelope, Result, decode_once, encode_once
from . import artifact, sidecar
from .plan import COMPILE, LOAD, LOCAL, SERVE, Plan, decide, fallback_allowed

log = logging.getLogger("compiler_collectives.once")

LOG_EVERY_S = 30.0
_POLL_S = (0.005, 0.2)  # first and longest sleep between looks at the store while waiting

_local = threading.local()  # ticket: Ticket | None
_seq = 0
_records: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)


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
    finished: bool = False
    outcome: str = "none"
    outcome_why: str | None = None
    waited_s: float = 0.0
    fingerprints: list[GraphFingerprint] = dataclasses.field(default_factory=list)
    outer: Ticket | None = None
    level: str = "aot"  # "aot": AOTAutograd's entry; "fx": an FX graph cache entry (the fallback level)
    graph: str = ""  # digest of the graph handed to AOTAutograd (aot level)
    fx_allowed: bool = False  # aot level: its FX compiles share at the fallback level
    started_ns: int = dataclasses.field(default_factory=time.time_ns)
    bytes_in: int = 0


# ------------------------------------------------------------------ seam entry points


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


def offer(ticket: Ticket, key: str | None, why: str | None, switches: Sequence[str]) -> Plan:
    """The key exchange; returns this rank's plan."""
    global _seq
    _seq += 1
    ticket.seq = _seq
    ticket.key = key
    cache_root = ticket.cache.root()
    mine = Offer(
        key,
        why,
        key is not None and artifact.holds(_entry_dir(ticket, key)),
        artifact.dir_identity(cache_root),
        sorted(switches),
        config.settings.max_artifact_bytes,
        ticket.graph,
    )
    gathered = _gather(ticket, mine, PHASE_ONCE_KEYS, "keys")
    ticket.offers = {e.rank: e.body for e in gathered}  # type: ignore[misc]
    rank = _rank()
    try:
        ticket.plans = decide(ticket.offers, ticket.seq, me=rank)
    except SetupMismatchError:
        counters.errors += 1
        raise
    ticket.plan = ticket.plans[rank]
    ticket.fx_allowed = ticket.level == "aot" and fallback_allowed(ticket.offers)
    counters.once_exchanges += 1
    if ticket.plan.role == LOCAL:
        log.info(
            "compile once #%d of %s: rank %d compiles it itself: %s", ticket.seq, ticket.frame, rank, ticket.plan.why
        )
    else:
        log.debug("compile once #%d of %s: %s", ticket.seq, ticket.frame, ticket.plan)
    return ticket.plan


def fetch(ticket: Ticket) -> bool:
    """A loading rank: wait for the source, take the result exchange, receive and check the
    artifact. True when it is installed (the cache lookup then finds it); False when refused
    (the caller compiles without the cache and then reports with ``loaded``)."""
    plan = ticket.plan
    assert plan is not None and plan.role == LOAD and plan.source is not None
    _wait_for_sources(ticket)
    results = _results(ticket, Result("none", None, [], []))
    result = results[plan.source]
    if result.status == "failed" and (result.failure or "").startswith("gathering the artifact failed"):
        ticket.outcome, ticket.outcome_why = "refused", f"rank {plan.source} has no artifact: {result.failure}"
        counters.once_refused += 1
        return False
    if result.status == "failed":
        ticket.outcome, ticket.outcome_why = "none", "the compiling rank's compile raised"
        _load_report(ticket)  # the serving rank takes it too before raising its own error
        counters.errors += 1
        raise CompileOnceError(
            f"rank {_rank()}: rank {plan.source} compiled graph #{ticket.seq} of {ticket.frame} for this rank "
            f"and its compile raised: {result.failure}. This rank does not compile it again; see rank "
            f"{plan.source}'s log for the traceback. COMPILER_COLLECTIVES_COMPILE_ONCE=0 makes every rank "
            "compile its own graphs.",
            kind="compile_once",
            rank=_rank(),
            seq=ticket.seq,
            frame=str(ticket.frame),
            ranks=(plan.source,),
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
            _rank(),
            plan.source,
            why,
        )
        return False
    ticket.fingerprints = result.fingerprints  # taken as this rank's own once the lookup hits
    return True


def loaded(ticket: Ticket, hit: bool | None) -> None:
    """A loading rank after its cache lookup: ``hit`` (None: refused before the lookup). Takes the
    load report exchange."""
    if hit is True:
        ticket.outcome = "hit"
        counters.once_loaded += 1
        # Only on a hit: a rank whose lookup missed compiles, and fingerprints its own levels.
        _import_fingerprints(ticket.fingerprints)
        sidecar.write(ticket.cache.root(), ticket.key, ticket.fingerprints)
    elif hit is False:
        ticket.outcome, ticket.outcome_why = "miss", "the entry's guards fail this rank's size hints"
        counters.once_load_misses += 1
    _load_report(ticket)


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
    plan = ticket.plan
    if plan is None:
        if error is None:
            ticket.plan = Plan(LOCAL, None, no_lookup, False)
            counters.once_local += 1
            _record(ticket)
        return
    if ticket.finished:
        return
    if not _any_source(ticket):
        ticket.finished = True
        counters.once_local += 1
        _record(ticket)
        return
    if plan.role == LOAD:
        # The loader's own compile after a refused or missed load: its exchanges are done
        # (it reported before compiling, so nobody waited for its compile).
        return
    mine = Result("none", None, [], [])
    bundle = b""
    if plan.role in (COMPILE, SERVE):
        if error is not None:
            mine = Result("failed", failure_text or f"{type(error).__name__}: {error}"[:500], [], [])
        else:
            try:
                manifest, bundle = _collect(ticket)
                fingerprints = _own_fingerprints(ticket)
                if plan.role == SERVE and not fingerprints:
                    fingerprints = sidecar.read(ticket.cache.root(), ticket.key, _rank())
                    _import_fingerprints(fingerprints)
                elif fingerprints:
                    sidecar.write(ticket.cache.root(), ticket.key, fingerprints)
                mine = Result("ok", None, manifest, fingerprints)
            except Exception as e:  # noqa: BLE001 - its loaders must hear of it, never wait for it
                log.warning("compile once #%d of %s: could not gather the artifact: %s", ticket.seq, ticket.frame, e)
                mine = Result("failed", f"gathering the artifact failed: {type(e).__name__}: {e}"[:500], [], [])
        groups.post(_notice(ticket, _rank()), b"1")
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


def abandon(ticket: Ticket) -> None:
    """Drop ``ticket`` without further exchanges (ours failed during its compile)."""
    _local.ticket = ticket.outer


def records() -> list[dict[str, Any]]:
    """Per graph, this rank's part: compiled, served, loaded, or compiled locally, and why."""
    return list(_records)


def reset_sequence() -> None:
    """A new generation of our groups numbers its graphs from 1 again (every rank together)."""
    global _seq
    _seq = 0


def clear_records() -> None:
    _records.clear()


# ------------------------------------------------------------------ exchanges


def _rank() -> int:
    pg = groups.compile_pg()
    return groups.member_ranks(pg)[pg.rank()]


def _where(ticket: Ticket, what: str) -> Callable[[], str]:
    return lambda: f"compile once #{ticket.seq} ({what}) of {ticket.frame} on rank {_rank()}"


def _gather(ticket: Ticket, body: Offer | Result | Loaded, phase: int, what: str) -> list[OnceEnvelope]:
    pg = groups.compile_pg()
    members = groups.member_ranks(pg)
    rank, world = members[pg.rank()], pg.size()
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


def _wait_for_sources(ticket: Ticket) -> None:
    """Wait until every serving rank (but this one) posted that it is done; while each is alive, up
    to COMPILER_COLLECTIVES_COMPILE_TIMEOUT, logging every ``LOG_EVERY_S``."""
    me = _rank()
    pending = sorted({r for r, p in ticket.plans.items() if p.role in (COMPILE, SERVE) and r != me})
    if not pending:
        return
    started = time.monotonic()
    deadline = started + config.settings.compile_timeout_s
    next_log = started + LOG_EVERY_S
    probes = {r: groups.watch_peer(r) for r in pending}
    sleep = _POLL_S[0]
    while pending:
        pending = [r for r in pending if groups.read_post(_notice(ticket, r)) is None]
        if not pending:
            break
        failure_seen = health.poisoned()
        if failure_seen is not None:
            raise PeerFailureError(
                f"compile once #{ticket.seq} of {ticket.frame} on rank {me}: stopped waiting for "
                f"{ranks_text(pending)} to compile: {failure_seen}",
                kind="compile_once",
                rank=me,
                seq=ticket.seq,
                frame=str(ticket.frame),
                ranks=failure_seen.ranks,
                reported_by=failure_seen.reported_by,
            )
        for r in pending:
            gone = probes[r]()
            if gone is not None:
                counters.errors += 1
                raise _published(
                    PeerFailureError(
                        f"compile once #{ticket.seq} of {ticket.frame} on rank {me}: rank {r} was compiling "
                        f"this graph for this rank and is gone: {gone}. Check rank {r}'s log and exit "
                        "status (killed by the OOM killer?).",
                        kind="compile_once",
                        rank=me,
                        seq=ticket.seq,
                        frame=str(ticket.frame),
                        ranks=(r,),
                    ),
                    ticket,
                )
        now = time.monotonic()
        if now >= deadline:
            counters.errors += 1
            raise _published(
                CompileOnceError(
                    f"compile once #{ticket.seq} of {ticket.frame} on rank {me}: waited "
                    f"{now - started:.0f}s for {ranks_text(pending)} to compile a graph for this rank, and they "
                    "are alive. Raise COMPILER_COLLECTIVES_COMPILE_TIMEOUT if compiles legitimately take that "
                    "long, or set COMPILER_COLLECTIVES_COMPILE_ONCE=0.",
                    kind="compile_once",
                    rank=me,
                    seq=ticket.seq,
                    frame=str(ticket.frame),
                    ranks=tuple(pending),
                ),
                ticket,
            )
        if now >= next_log:
            next_log = now + LOG_EVERY_S
            log.warning(
                "rank %d: waiting for %s to compile graph #%d of %s (%.0f s)",
                me,
                ranks_text(pending),
                ticket.seq,
                ticket.frame,
                now - started,
            )
        time.sleep(sleep)
        sleep = min(sleep * 2, _POLL_S[1])
    ticket.waited_s = time.monotonic() - started
    counters.once_wait_s += ticket.waited_s


def _published(error: CompileOnceError | PeerFailureError, ticket: Ticket) -> CompileOnceError | PeerFailureError:
    """A loader's failure to wait (the compiling rank timed out or is gone), published through
    the failure policy: the compiling rank hears of it within a heartbeat and raises at its next
    exchange, instead of entering an exchange this rank will never take."""
    failure_procedure.known(error, seq=ticket.seq)
    return error


def _results(ticket: Ticket, mine: Result) -> dict[int, Result]:
    gathered = _gather(ticket, mine, PHASE_ONCE_RESULT, "result")
    out = {e.rank: e.body for e in gathered}
    for r, p in ticket.plans.items():
        body = out[r]
        bad = not isinstance(body, Result) or (p.role in (COMPILE, SERVE)) != (body.status != "none")
        if bad:
            counters.errors += 1
            raise CompileOnceError(
                f"compile once #{ticket.seq} of {ticket.frame}: rank {r} sent a result that does not fit "
                f"its role ({p.role}); the ranks disagree about the plan (a version or setting differs).",
                kind="compile_once",
                rank=_rank(),
                seq=ticket.seq,
                frame=str(ticket.frame),
                ranks=(r,),
            )
    return out  # type: ignore[return-value]


def _load_report(ticket: Ticket) -> None:
    ticket.finished = True
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
            if e.rank != _rank():
                counters.once_peer_local_compiles += 1
    _record(ticket)


def _record(ticket: Ticket) -> None:
    plan = ticket.plan
    if plan is None:
        return
    rec = timing.recorder
    if plan.role == LOAD:
        state = "loaded" if ticket.outcome == "hit" else "compiled locally"
        why = plan.why if ticket.outcome == "hit" else f"{ticket.outcome}: {ticket.outcome_why}"
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
        }
    )
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


def _send_artifacts(ticket: Ticket, results: dict[int, Result], bundle: bytes = b"") -> None:
    """The source sends its bytes to each of its loaders that has another cache dir (and accepts
    that size); such loaders receive them. Everyone else does nothing here."""
    me = _rank()
    plan = ticket.plan
    assert plan is not None
    if plan.role not in (COMPILE, SERVE):
        return
    result = results[me]
    total = sum(f.size for f in result.manifest)
    pg = groups.compile_pg()
    members = list(groups.member_ranks(pg))
    works = []
    for r, p in sorted(ticket.plans.items()):
        if p.role == LOAD and p.source == me and _travels(result, p, ticket.offers[r], ticket.level):
            works.append(send_bytes(pg, bundle, members.index(r), _tag(ticket), _where(ticket, "artifact")))
            counters.once_bytes_sent += total
    where = _where(ticket, "artifact")
    try:
        for w in works:
            wait(w, where)
    except RuntimeError as e:
        raise _transfer_failed(e, ticket, where) from e


def _travels(result: Result, plan: Plan, offer: Offer, level: str) -> bool:
    """Whether the source sends its bytes to a loading rank: decided from what both sides know
    (the manifest, the plan, the loader's limit), so a send is never left without its receive."""
    total = sum(f.size for f in result.manifest)
    return (
        plan.source is not None
        and not plan.shares_dir
        and 0 < total <= offer.max_artifact_bytes
        and artifact.manifest_problem(result, plan.source, level) is None
    )


def _tag(ticket: Ticket) -> int:
    return 0x0CC00000 + ((ticket.seq or 0) & 0xFFFFF)


def _receive_and_install(ticket: Ticket, result: Result) -> str | None:
    """Receive (or find in the shared dir) the source's files and check each against its SHA-256;
    install them. None on success, else why they were refused (nothing was written then)."""
    plan = ticket.plan
    assert plan is not None and plan.source is not None
    total = sum(f.size for f in result.manifest)
    root = ticket.cache.root()
    problem = artifact.manifest_problem(result, plan.source, ticket.level)
    if problem is not None:
        return problem
    prefix = _entry_prefix(ticket)
    refusal = artifact.foreign_entry(result.manifest, prefix, ticket.key, ticket.level)
    if refusal is None and plan.shares_dir:
        return _taken(ticket, artifact.check_shared(root, result.manifest, plan.source))
    if refusal is not None:
        return _refused(refusal)
    if not _travels(result, plan, ticket.offers[_rank()], ticket.level):
        return (
            f"the artifact is {total} bytes, over COMPILER_COLLECTIVES_MAX_ARTIFACT_BYTES "
            f"({ticket.offers[_rank()].max_artifact_bytes})"
        )
    pg = groups.compile_pg()
    members = list(groups.member_ranks(pg))
    where = _where(ticket, "artifact")
    try:
        data = recv_bytes(pg, total, members.index(plan.source), _tag(ticket), where)
    except RuntimeError as e:
        raise _transfer_failed(e, ticket, where) from e
    counters.once_bytes_received += total
    ticket.bytes_in = total
    pieces, refusal = artifact.split_verified(result.manifest, data, plan.source)
    if refusal is not None:
        return _refused(refusal)
    return _taken(ticket, artifact.install(root, pieces))


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


def _transfer_failed(error: RuntimeError, ticket: Ticket, where: Callable[[], str]) -> BaseException:
    counters.errors += 1
    return failure_procedure.exchange_failed(
        error, kind="compile_once", rank=_rank(), seq=ticket.seq, frame=str(ticket.frame), where=where
    )
