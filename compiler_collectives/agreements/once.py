"""Compile once: among the ranks whose graphs have the same AOTAutograd cache key, one rank compiles
(or serves the entry its cache holds) and the others load what it made.

Flow, per graph that AOTAutograd looks up in its cache while compiler collectives are on (the
seam ``dynamo/once_seam.py`` calls in; every rank of the agreement scope takes every step, warm
or cold, so the exchanges never depend on cache state):

1. **Keys** (``offer``, at the cache lookup): one all-gather of each rank's key (or why the graph
   is not cacheable here), whether its cache holds an entry, its cache dir's identity, which of
   torch's compile-time collectives are on, and the largest artifact it accepts. ``decide`` turns
   that into a plan, the same on every rank: ranks whose key no other rank has, or whose graph is
   not cacheable, compile locally; so does every rank when any of torch's compile-time
   collectives is on (ranks that are not compiling could not join them). In each group of equal
   keys, the lowest rank that holds the entry serves it; otherwise one rank compiles, chosen in
   turn across graphs so that the work spreads over ranks and hosts. The others load.
2. **Compile**: the serving or compiling rank runs AOTAutograd as usual (backward lowered with
   the forward, so the entry exists when the compile ends); local ranks compile; loading ranks
   wait inside the backend, for this graph only (waiting around a whole step would deadlock on
   DDP's all-reduce). They wait while the compiling rank is alive, up to
   ``COMPILER_COLLECTIVES_COMPILE_TIMEOUT``, logging about every 30 s.
3. **Result** (``finish``/``fetch``): once every serving rank has posted that it is done, one
   all-gather carries each serving rank's outcome: the manifest of its artifact (every file of
   the cache entries and kernel binaries, relative to the cache dir, with its SHA-256) and the
   program audit's fingerprints of the compile. The manifest comes over the job's own gloo group;
   the bytes travel over gloo point to point to ranks with another cache dir, and not at all to
   ranks that share the serving rank's dir. A rank loads only files whose SHA-256 matches, only
   for a key it computed itself; anything else is refused, named in the log, and that rank
   compiles the graph itself, without the cache.
4. **Loaded** (``loaded``): one all-gather of each loading rank's outcome, so every rank logs and
   counts who loaded, whose load missed (an entry's guards fail that rank's size hints: it
   compiled locally) and who refused.

Failures: a serving rank whose compile raises publishes the error; its loaders raise
``CompileOnceError`` quoting it (the serving rank raises its own). A serving rank that dies is
seen through its heartbeat or its broken gloo connection: the loaders raise ``PeerFailureError``
naming it. Never a hang.

Plain Python over ``torch.distributed``; torch's cache internals are reached through the
``Cache`` the seam passes in.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .. import config, health
from ..errors import CollectiveDesyncError, CompileOnceError, PeerFailureError, SetupMismatchError, ranks_text
from ..instrument import timing
from ..state import FrameId
from ..stats import counters
from ..transport import (
    PHASE_ONCE_KEYS,
    PHASE_ONCE_LOADED,
    PHASE_ONCE_RESULT,
    groups,
    recv_bytes,
    send_bytes,
    wait,
)
from . import audit
from . import exchange as exchange_frame
from . import failure as failure_procedure
from .fingerprint import GraphFingerprint
from .wire.codec import failure, pack, reading
from .wire.once import (
    Loaded,
    ManifestFile,
    Offer,
    OnceEnvelope,
    Result,
    decode_once,
    encode_once,
    fingerprint_in,
    fingerprint_out,
)

log = logging.getLogger("compiler_collectives.once")

COMPILE, SERVE, LOAD, LOCAL = "compile", "serve", "load", "local"
LOG_EVERY_S = 30.0
_POLL_S = (0.005, 0.2)  # first and longest sleep between looks at the store while waiting
_SAFE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=-]{0,255}$")
_SIDECAR_VERSION = 1

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


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one rank does for one graph, decided from every rank's offer identically everywhere."""

    role: str  # COMPILE, SERVE, LOAD or LOCAL
    source: int | None  # the global rank that compiles or serves this rank's key
    why: str  # for LOCAL: why; otherwise a short description
    shares_dir: bool  # LOAD: this rank's cache dir is the source's


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


def dir_identity(root: str) -> str:
    """Ranks with the same identity share the cache dir: host (boot id), device and inode."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            host = f.read().strip()
    except OSError:
        host = socket.gethostname()
    try:
        st = os.stat(root)
        return f"{host}:{st.st_dev}:{st.st_ino}"
    except OSError:
        return f"{host}:{os.path.realpath(root)}"


def holds(cache: Cache, key: str, level: str = "aot") -> bool:
    """Whether this rank's cache has an entry for ``key`` at ``level`` (its guards are not evaluated)."""
    try:
        d = cache.aot_dir(key) if level == "aot" else cache.fx_dir(key)
        return any(not n.startswith(".") for n in os.listdir(d))
    except OSError:
        return False


def fallback_allowed(offers: dict[int, Offer]) -> bool:
    """Whether the FX compiles inside an AOTAutograd compile that no rank could share share at the
    FX graph cache instead: every rank bypassed AOTAutograd's cache for the same reason (a graph
    DDPOptimizer split, say), on an equal graph (so every rank runs the same inductor compiles in
    the same order), and none of torch's compile-time collectives is on."""
    first = next(iter(offers.values()))
    return bool(first.graph) and all(
        o.key is None and o.why == first.why and o.graph == first.graph and not o.switches for o in offers.values()
    )


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
        key is not None and holds(ticket.cache, key, ticket.level),
        dir_identity(cache_root),
        sorted(switches),
        config.settings.max_artifact_bytes,
        ticket.graph,
    )
    gathered = _gather(ticket, mine, PHASE_ONCE_KEYS, "keys")
    ticket.offers = {e.rank: e.body for e in gathered}  # type: ignore[misc]
    rank = _rank()
    ticket.plans = decide(ticket.offers, ticket.seq, me=rank)
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
        _write_sidecar(ticket, ticket.fingerprints)
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
                    fingerprints = _read_sidecar(ticket)
                    _import_fingerprints(fingerprints)
                elif fingerprints:
                    _write_sidecar(ticket, fingerprints)
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


# ------------------------------------------------------------------ the plan


def decide(offers: dict[int, Offer], seq: int, me: int | None = None) -> dict[int, Plan]:
    """Every rank's plan from every rank's offer (global rank -> offer); the same on every rank.
    ``me``: this rank, for errors."""
    ranks = sorted(offers)
    switch_sets = {r: tuple(offers[r].switches) for r in ranks}
    if len(set(switch_sets.values())) > 1:
        lines = "\n".join(f"  rank {r}: {', '.join(s) or 'none'}" for r, s in switch_sets.items())
        counters.errors += 1
        raise SetupMismatchError(
            "compile once: the ranks disagree about torch's compile-time collectives (they must match "
            f"across ranks: ranks that run them wait for ranks that do not):\n{lines}\n"
            "Set the same torch config on every rank.",
            kind="compile_once",
            rank=me,
            seq=seq,
        )
    on = switch_sets[ranks[0]]
    if on:
        why = f"torch's compile-time collectives are on ({', '.join(on)}): every rank compiles"
        return {r: Plan(LOCAL, None, why, False) for r in ranks}
    plans: dict[int, Plan] = {}
    by_key: dict[str, list[int]] = {}
    for r in ranks:
        key = offers[r].key
        if key is None:
            plans[r] = Plan(LOCAL, None, f"not cacheable here: {offers[r].why or 'no cache key'}", False)
        else:
            by_key.setdefault(key, []).append(r)
    for turn, members in enumerate(sorted(by_key.values())):
        if len(members) == 1:
            plans[members[0]] = Plan(LOCAL, None, "no other rank has this graph's cache key", False)
            continue
        holders = [r for r in members if offers[r].holds]
        if holders:
            source, role, done = holders[0], SERVE, "serves the entry its cache holds"
        else:
            source, role, done = members[(seq + turn) % len(members)], COMPILE, "compiles"
        plans[source] = Plan(role, source, f"{done} for {ranks_text([r for r in members if r != source])}", False)
        for r in members:
            if r != source:
                plans[r] = Plan(LOAD, source, f"loads from rank {source}", offers[r].dir == offers[source].dir)
    return plans


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
                raise PeerFailureError(
                    f"compile once #{ticket.seq} of {ticket.frame} on rank {me}: rank {r} was compiling "
                    f"this graph for this rank and is gone: {gone}. Check rank {r}'s log and exit "
                    "status (killed by the OOM killer?).",
                    kind="compile_once",
                    rank=me,
                    seq=ticket.seq,
                    frame=str(ticket.frame),
                    ranks=(r,),
                )
        now = time.monotonic()
        if now >= deadline:
            counters.errors += 1
            raise CompileOnceError(
                f"compile once #{ticket.seq} of {ticket.frame} on rank {me}: waited "
                f"{now - started:.0f}s for {ranks_text(pending)} to compile a graph for this rank, and they "
                "are alive. Raise COMPILER_COLLECTIVES_COMPILE_TIMEOUT if compiles legitimately take that "
                "long, or set COMPILER_COLLECTIVES_COMPILE_ONCE=0.",
                kind="compile_once",
                rank=me,
                seq=ticket.seq,
                frame=str(ticket.frame),
                ranks=tuple(pending),
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


# ------------------------------------------------------------------ artifacts


def _collect(ticket: Ticket) -> tuple[list[ManifestFile], bytes]:
    """Every file of this compile's artifact under the cache dir: the AOTAutograd and FX graph
    entries of its keys, and the kernel sources and binaries it built or found."""
    root = os.path.realpath(ticket.cache.root())
    paths: list[str] = []
    if ticket.level == "aot":
        dirs = ([ticket.cache.aot_dir(ticket.key)] if ticket.key else []) + [
            ticket.cache.fx_dir(k) for k in ticket.fx_keys
        ]
    else:
        dirs = [ticket.cache.fx_dir(ticket.key)] if ticket.key else []
    for d in dirs:
        try:
            paths.extend(os.path.join(d, n) for n in sorted(os.listdir(d)) if not n.startswith("."))
        except OSError:
            continue
    for src in ticket.sources:
        d, name = os.path.split(src)
        stem = name.split(".", 1)[0]
        try:
            paths.extend(
                os.path.join(d, n)
                for n in sorted(os.listdir(d))
                if n.startswith(stem + ".") and not n.startswith(".") and not n.endswith(".lock")
            )
        except OSError:
            continue
    manifest: list[ManifestFile] = []
    chunks: list[bytes] = []
    seen: set[str] = set()
    for path in paths:
        real = os.path.realpath(path)
        rel = os.path.relpath(real, root)
        if rel in seen or rel.startswith("..") or not os.path.isfile(real):
            continue
        seen.add(rel)
        with open(real, "rb") as f:
            data = f.read()
        manifest.append(ManifestFile(rel, hashlib.sha256(data).digest(), len(data)))
        chunks.append(data)
    return manifest, b"".join(chunks)


def safe_relpath(rel: str) -> bool:
    """A path a loading rank may write under its cache dir: relative, normalized, plain names."""
    if not rel or os.path.isabs(rel) or os.path.normpath(rel) != rel:
        return False
    parts = rel.split(os.sep)
    return len(parts) <= 6 and all(_SAFE_PART.match(p) and p not in (".", "..") for p in parts)


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


def manifest_problem(result: Result, source: int, level: str = "aot") -> str | None:
    """Why no rank may load this artifact, whatever its bytes (None: it may, once they match)."""
    if result.status != "ok":
        return f"rank {source} has no artifact ({result.status})"
    for f in result.manifest:
        if not safe_relpath(f.relpath):
            return f"rank {source} named a file outside the cache layout: {f.relpath!r}"
    entry, cache = ("aotautograd", "AOTAutograd") if level == "aot" else ("fxgraph", "FX graph")
    if not any(f.relpath.startswith(entry + os.sep) for f in result.manifest):
        return f"rank {source} saved no {cache} cache entry for this graph (its cache bypassed it)"
    return None


def _travels(result: Result, plan: Plan, offer: Offer, level: str) -> bool:
    """Whether the source sends its bytes to a loading rank: decided from what both sides know
    (the manifest, the plan, the loader's limit), so a send is never left without its receive."""
    total = sum(f.size for f in result.manifest)
    return (
        plan.source is not None
        and not plan.shares_dir
        and 0 < total <= offer.max_artifact_bytes
        and manifest_problem(result, plan.source, level) is None
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
    problem = manifest_problem(result, plan.source, ticket.level) or _foreign_entry(ticket, result)
    if problem is not None:
        return problem
    if plan.shares_dir:
        extra = _unlisted_entries(ticket, result)
        if extra:
            return f"the shared cache dir holds entries for this key that rank {plan.source} did not list: {extra}"
        for f in result.manifest:
            try:
                with open(os.path.join(root, f.relpath), "rb") as fh:
                    data = fh.read()
            except OSError as e:
                return f"{f.relpath} is missing from the shared cache dir ({e.strerror})"
            if hashlib.sha256(data).digest() != f.sha256:
                counters.once_digest_mismatches += 1
                return f"{f.relpath} in the shared cache dir does not match the SHA-256 rank {plan.source} sent"
        return None
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
    pieces: list[tuple[ManifestFile, bytes]] = []
    offset = 0
    for f in result.manifest:
        piece = data[offset : offset + f.size]
        offset += f.size
        if hashlib.sha256(piece).digest() != f.sha256:
            counters.once_digest_mismatches += 1
            return f"{f.relpath} does not match the SHA-256 rank {plan.source} sent over the job's gloo group"
        pieces.append((f, piece))
    for f, _ in pieces:
        path = os.path.join(root, f.relpath)
        if os.path.exists(path):
            with open(path, "rb") as fh:
                if hashlib.sha256(fh.read()).digest() != f.sha256:
                    return f"{f.relpath} exists in this rank's cache dir with other content"
    return _install(root, pieces)


def _install(root: str, pieces: list[tuple[ManifestFile, bytes]]) -> str | None:
    """Write every file under a hidden temporary name (torch's lookups skip those), then rename
    them all into place: on any failure nothing new is left behind. None, or why not."""
    staged: list[tuple[str, str]] = []
    try:
        for i, (f, piece) in enumerate(pieces):
            path = os.path.join(root, f.relpath)
            if os.path.exists(path):
                continue
            d = os.path.dirname(path)
            os.makedirs(d, exist_ok=True)
            tmp = os.path.join(d, f".cc-once-{os.getpid()}-{threading.get_ident()}-{i}")
            with open(tmp, "wb") as fh:
                fh.write(piece)
            staged.append((tmp, path))
    except OSError as e:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return f"could not write the artifact into this rank's cache dir: {e}"
    for tmp, path in staged:
        os.replace(tmp, path)
    return None


def _entry_prefix(ticket: Ticket) -> str:
    """Where the entry of this rank's own key lives, relative to its cache dir."""
    assert ticket.key is not None
    d = ticket.cache.aot_dir(ticket.key) if ticket.level == "aot" else ticket.cache.fx_dir(ticket.key)
    return os.path.relpath(d, ticket.cache.root()) + os.sep


def _foreign_entry(ticket: Ticket, result: Result) -> str | None:
    """A rank loads only for a key it computed itself: the artifact's entry must be under it."""
    prefix = _entry_prefix(ticket)
    if not any(f.relpath.startswith(prefix) for f in result.manifest):
        return f"the artifact holds no entry for this rank's own key ({ticket.key})"
    top = "aotautograd" + os.sep if ticket.level == "aot" else None
    for f in result.manifest:
        if top is not None and f.relpath.startswith(top) and not f.relpath.startswith(prefix):
            return f"the artifact holds an AOTAutograd entry for another key: {f.relpath}"
    return None


def _unlisted_entries(ticket: Ticket, result: Result) -> list[str]:
    """Files under this key's entry dir that the manifest does not list (the lookup would load them)."""
    prefix = _entry_prefix(ticket)
    listed = {f.relpath for f in result.manifest}
    try:
        names = [n for n in os.listdir(os.path.join(ticket.cache.root(), prefix)) if not n.startswith(".")]
    except OSError:
        return []
    return sorted(prefix + n for n in names if prefix + n not in listed)[:5]


def _transfer_failed(error: RuntimeError, ticket: Ticket, where: Callable[[], str]) -> BaseException:
    counters.errors += 1
    return failure_procedure.exchange_failed(
        error, kind="compile_once", rank=_rank(), seq=ticket.seq, frame=str(ticket.frame), where=where
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


def _sidecar(ticket: Ticket) -> str | None:
    if ticket.key is None:
        return None
    return os.path.join(ticket.cache.root(), "compiler_collectives", "audit", ticket.key)


def _write_sidecar(ticket: Ticket, fingerprints: list[GraphFingerprint]) -> None:
    """Keep the fingerprints with the cache entry, so that this rank can serve them when warm."""
    path = _sidecar(ticket)
    if path is None or not fingerprints:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(pack([_SIDECAR_VERSION, [fingerprint_out(g) for g in fingerprints]]))
        os.replace(tmp, path)
    except OSError as e:
        log.debug("compile once: could not keep the audit's fingerprints at %s: %s", path, e)


def _read_sidecar(ticket: Ticket) -> list[GraphFingerprint]:
    path = _sidecar(ticket)
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return []
    fail = failure("compile-once fingerprint file", "compile_once", _rank(), "compiler_collectives version")
    try:
        with reading(data, config.settings.max_payload_bytes, fail) as r:
            obj: Any = r.value()
            r.end()
        if type(obj) is not list or len(obj) != 2 or obj[0] != _SIDECAR_VERSION or type(obj[1]) is not list:
            return []
        return [fingerprint_in(g) for g in obj[1]]
    except Exception as e:  # noqa: BLE001 - a damaged file only costs the audit's comparison
        log.debug("compile once: ignoring %s: %s", path, e)
        return []
