"""Compile once's protocol: the entry points the seam (``dynamo/once_seam.py``) calls for one
AOTAutograd (or fallback FX) compile, and the decisions between them. The flow is told in the
package's docstring (``__init__``).

``begin`` opens a graph's ticket (``ticket``), current in the Dynamo compile's scope
(``agreements.compile_scope``) until ``finish`` or ``abandon``; ``note_*`` add what the compile
reads and writes to it; ``offer`` takes the key exchange and returns this rank's plan; a loading
rank ``fetch``es the artifact and reports whether its lookup ``loaded`` it; every other rank
``finish``es (publishing its artifact where it serves). The exchanges over the host tree are
``exchanges``'; the waits on the store, ``waits``'; the artifact's bytes, ``transfer``'s and
``loading``'s.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence

from ... import config, health
from ...errors import CollectiveError, PeerFailureError, SetupMismatchError
from ...ledger import ledger
from ...observations import FrameId
from ...records import OncePlanned
from ...transport import groups
from .. import audit, compile_scope, generation, our_groups
from .. import failure as failure_procedure
from ..fingerprint import GraphFingerprint
from ..wire.once import WARMTH_FX, WARMTH_MAX_ENTRIES, ManifestFile, Offer, Result
from . import artifact, exchanges, loading, sidecar, transfer, waits
from .plan import COMPILE, LOAD, LOCAL, SERVE, Plan, decide, fallback_allowed
from .ticket import Cache, Step, Ticket, failed, keep_record, once_error, where_of

log = logging.getLogger("compiler_collectives.once")


def begin(frame: FrameId, cache: Cache, level: str = "aot", graph: str = "") -> Ticket:
    """Open the ticket of one AOTAutograd compile (``level`` "aot"), or of one inductor compile
    inside it (``level`` "fx"), current in the Dynamo compile's scope (its cache lookup may
    follow). Outside a compile scope (a unit test's ticket) it is nobody's current ticket."""
    record = audit.current()
    ticket = Ticket(frame, cache, len(record.graphs) if record is not None else None, level=level, graph=graph)
    scope = compile_scope.current()
    if scope is not None:
        ticket.outer = scope.once_ticket  # a compile nested in another (a subgraph): the outer one resumes after
        scope.once_ticket = ticket
    return ticket


def current() -> Ticket | None:
    """The ticket of the compile in progress in this Dynamo compile's scope (None outside one)."""
    scope = compile_scope.current()
    return None if scope is None else scope.once_ticket


def _close(ticket: Ticket) -> None:
    """``ticket`` is no longer current: the compile it was nested in (if any) is again."""
    scope = compile_scope.current()
    if scope is not None:
        scope.once_ticket = ticket.outer


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
    t0 = time.perf_counter()
    ticket.pg = our_groups.compile_pg()  # first: a new default group noticed here starts a new generation
    gen = generation.current()
    gen.once_seq += 1
    ticket.seq = gen.once_seq
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
    ticket.offers = exchanges.settle_keys(ticket, mine, gen)
    rank = ticket.rank
    try:
        ticket.plans = decide(ticket.offers, ticket.seq, me=rank)
    except SetupMismatchError as e:
        failed(e)
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
    waits.wait_for_sources(ticket)
    results = exchanges.exchange_results(ticket, Result("none", None, [], []))
    result = results[plan.source]
    ticket.artifact_bytes = result.total()
    if result.status == "failed" and (result.failure or "").startswith("gathering the artifact failed"):
        ticket.outcome, ticket.outcome_why = "refused", f"rank {plan.source} has no artifact: {result.failure}"
        return False
    if result.status == "failed":
        ticket.outcome, ticket.outcome_why = "none", "the compiling rank's compile raised"
        _report(ticket)  # the serving rank takes it too before raising its own error
        raise once_error(
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
    _close(ticket)
    step, plan = ticket.step, ticket.plan
    if error is not None:
        ticket.failure = failure_text or f"{type(error).__name__}: {error}"
    if step is Step.OPEN:
        ticket.step = Step.DONE
        if error is None:
            ticket.plan = Plan(LOCAL, None, no_lookup, False)
            keep_record(ticket)
        return
    assert plan is not None
    if step is Step.REPORTED and plan.role == LOAD and ticket.rank in ticket.local:
        # The loader's own compile after a refused or missed load ended: the ranks that loaded
        # wait for this post (its compile takes as long as the source's did, so their next
        # exchange would otherwise measure it against COMPILER_COLLECTIVES_TIMEOUT).
        ticket.step = Step.DONE
        said = b"ok" if error is None else (failure_text or f"{type(error).__name__}: {error}").encode()[:2000]
        waits.post(ticket, waits.compiled_itself, said, "its own compile of this graph ended")
        waits.wait_for_local_compiles(ticket, raised_here=error is not None)
        return
    if step is not Step.PLANNED:
        return
    if not _any_source(ticket):
        ticket.step = Step.DONE
        keep_record(ticket)
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
        waits.post(ticket, waits.source_done, b"1", "its compile of this graph ended")
        ticket.posted_at = time.time()
    waits.wait_for_sources(ticket)
    results = exchanges.exchange_results(ticket, mine)
    if plan.role in (COMPILE, SERVE):
        ticket.transfer_s += transfer.serve(_transfer(ticket), bundle, results[ticket.rank])
    _report(ticket)
    ticket.step = Step.DONE


def _report(ticket: Ticket) -> None:
    """The load report (``exchanges.load_report``, which makes the graph's record); when it raises (an
    exchange failed, a rank that compiled the graph itself raised), the record is made all the
    same: this rank's outcome still counts."""
    try:
        exchanges.load_report(ticket)
    except BaseException:
        keep_record(ticket)
        raise


def _raise_if_a_loader_gave_up(ticket: Ticket) -> None:
    """A peer published while this rank compiled (a loader's compile timeout, say): its report,
    as a ``PeerFailureError`` naming this graph, instead of an exchange nobody else takes."""
    heard = health.latch.first_failure
    if isinstance(heard, PeerFailureError) and heard.reported_by:
        raise failed(
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


def abandon(ticket: Ticket) -> None:
    """Drop ``ticket`` without further exchanges (ours failed during its compile)."""
    _close(ticket)


def _any_source(ticket: Ticket) -> bool:
    return any(p.role in (COMPILE, SERVE) for p in ticket.plans.values())


def _own_fingerprints(ticket: Ticket) -> list[GraphFingerprint]:
    record = audit.current()
    if record is None or ticket.audit_mark is None:
        return []
    return [g for g in record.graphs[ticket.audit_mark :] if g.level != "dynamo"]


def _import_fingerprints(fingerprints: list[GraphFingerprint]) -> None:
    """The levels of an artifact this rank did not compile count as its own: the same code runs."""
    if fingerprints:
        audit.import_graphs(fingerprints)


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
    where = where_of(ticket, "artifact")

    def failed_piece(error: CollectiveError) -> CollectiveError:  # counted by the failure procedure
        return failure_procedure.fail(
            error, kind="compile_once", rank=ticket.rank, seq=ticket.seq, frame=str(ticket.frame), where=where
        )

    link = transfer.Link(ticket.pg, ticket.members, ticket.rank, ticket.seq or 0, where, failed_piece)
    return transfer.Graph(link, ticket.plans, ticket.offers, ticket.level, config.settings.once_fanout)


def _install(ticket: Ticket, result: Result) -> str | None:
    """A loader: the source's files received (or found in its dir), checked and installed
    (``loading.receive_and_install``), its time and bytes on the ticket; None, or why it refused.
    The ranks of one dir hear of their receiver's install through the store."""
    plan = ticket.plan
    assert plan is not None and plan.source is not None

    def installed(via: int) -> bytes:
        return waits.wait_for_posts(ticket, [via], waits.dir_installed, "receive the artifact for this cache dir")[via]

    def post(said: bytes) -> None:
        waits.post(ticket, waits.dir_installed, said, "it installed the artifact for this cache dir")

    here = loading.Dir(ticket.cache.root(), _entry_prefix(ticket), ticket.key, installed, post)
    done = loading.receive_and_install(_transfer(ticket), result, plan.source, here)
    ticket.transfer_s += done.transfer_s
    ticket.install_s += done.install_s
    ticket.bytes_in += done.bytes_in
    if done.refetched is not None:
        ticket.outcome_why = done.refetched  # the graph's record says where the bytes came from
    return done.refusal
