"""How a loading rank gets its source's files: one receiving rank per cache dir, and a tree of
those receivers across dirs, rooted at the source.

``routes`` decides, from what every rank knows after the result exchange (the plans, the
offers, the result), how each loader of one source gets the bytes:

* ``SHARED``: its cache dir is the source's; nothing travels, the files are checked in place;
* ``RECEIVE``: it is its dir's receiver (the lowest rank of the dir that accepts the artifact):
  it receives from its ``parent`` in the tree, checks each piece against the SHA-256 the source
  sent over the job's group before forwarding it to its ``children`` (at most
  ``COMPILER_COLLECTIVES_ONCE_FANOUT``), then installs, then tells its dir's ``readers``;
* ``READ``: another rank of its dir receives (``via``); it waits for that rank's install and
  checks the files in place, as ``SHARED`` does;
* ``NONE``: it does not accept the artifact (its size limit, or the manifest is unsafe): it
  refuses on its own, and no bytes come its way.

The driver hands each graph's transfer in as a ``Graph`` (its ``Link``, the plans, the offers,
the level, the fan-out) once the result exchange ended: the source ``serve``s its bytes down its
tree, and each loader calls ``loading.receive_and_install``, which follows its route to the files
in its cache dir (``loading.Dir``: the dir, and the mailbox's store notices by which a dir's
readers hear of its receiver's install) and says why it refused, if it did; a dir's receiver
takes its pieces here (``receive``). Who loads, and what a failure means,
stay the driver's: ``Link.failed`` publishes and counts a broken piece's error.

The tree: the source is node 0, the receivers nodes 1..D in rank order, and node i's children
are nodes F*i+1 .. F*i+F. The bytes go in pieces of ``chunk_bytes`` (the source's
``COMPILER_COLLECTIVES_ONCE_CHUNK_BYTES``), each with its own tag, so a receiver forwards piece k
while piece k+1 arrives: one graph takes about F * size / bandwidth plus one piece's time per
level. A forwarder cannot change what its subtree loads: the digests come from the source, every
receiver checks every piece, and a piece that fails its check is forwarded as zeros.

After the pieces each sender tells each child its verdict (8 bytes): -1, it passed every piece
on as it checked it; else the rank whose bytes first failed a check on the way (its parent, or
whom its parent's verdict named), from which piece on it forwards zeros. So a receiver whose
check fails names the rank that sent the bad bytes: its parent when the parent's verdict was
clean (its bytes changed after its own check: in its memory or on the link), else the upstream
rank the verdict names, never an honest forwarder that passed on zeros.

Then every receiver tells the source whether it needs the bytes again (1 byte: its check
failed), and the source, which holds the whole bundle until its ``send`` returns, sends each
such receiver one copy of its own, checked again piece by piece. Only when that copy fails too
does the receiver refuse (and its rank compile the graph itself). A source's ``send`` therefore
ends when every receiver of its tree has its bytes: no later than the load report, which waits
for every rank anyway. The refusal and the refetch are both named in the receiver's log and
record (``Received.refetched``).

Before any piece, each parent and child meet over the compile group's host tree (``meet``:
``HostTree.meet``, one record each way on the tree's records' tag, stamped with the graph's
number): a peer found in a MIN or a gather over the tree instead (another graph, or another
code path) raises ``CollectiveDesyncError`` at once on both ranks, each naming what the other is
in, where each would otherwise wait for the group's timeout on tags the other never uses.

The sends and receives of a transfer are waited for with ``run_p2p``: a parent may start late
(it sends once the result exchange, which no longer waits for every rank, ended there), and
gloo's timed wait of a slice would close the group's connections. A forwarder that dies breaks
its children's receive at once (gloo's connection closes), and the source's wait for its word;
they raise ``PeerFailureError`` through the failure procedure, whose report stops the rest of
the subtree within a heartbeat (a dead rank ends the job's step anyway: its bytes are not
fetched elsewhere). A peer that never takes its part (stuck, or on another code path) ends the
wait at gloo's timeout, the compile group's COMPILER_COLLECTIVES_TIMEOUT: ``CollectiveTimeoutError``
naming it, not ``PeerFailureError`` (its connection did not break).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ... import config
from ...errors import CollectiveError, CollectiveTimeoutError, PeerFailureError
from ...ledger import ledger
from ...records import ArtifactReceived, ArtifactSent, DigestMismatch
from ...transport import HostTree, broken_peers, byte_tensor, run_p2p, start_recv, start_send, tensor_view
from .. import phases
from ..wire.once import Offer, Result
from . import artifact
from .plan import LOAD, Plan

log = logging.getLogger("compiler_collectives.once")

# Tags of the pieces: bit 30 set, the graph's number in bits 20-29, the piece's in bits 0-19
# (gloo's tags are 32-bit signed; pieces are at most wire.once.MAX_CHUNKS = 2**20).
TAG_BASE = 1 << 30
_SEQ_BITS, _PIECE_BITS = 10, 20
# Tags of a transfer's small messages and of the source's second copy: bits 28 and 29 set (below
# the pieces' bit 30; above transport.hosttree's 1 << 28 | 1..4 and gloo.PROBE_TAG, 1 << 29),
# the message's kind above the graph's number.
_CONTROL_BASE = 3 << 28
VERDICT, NEED, COPY = 1, 2, 3
_CLEAN = -1  # a verdict: every piece passed on as it checked

SHARED, RECEIVE, READ, NONE = "shared", "receive", "read", "none"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Link:
    """One graph's transfer context: the compile group, its members (global ranks), this rank,
    the graph's number (tags), where we are (for errors) and how a failed transfer is named."""

    pg: Any
    members: tuple[int, ...]
    rank: int
    seq: int
    where: Callable[[], str]
    # How this rank publishes and counts the error of a failed transfer (the driver's failure
    # procedure); the error already names the peer (``broken``).
    failed: Callable[[CollectiveError], CollectiveError]
    # The compile group's host tree: each parent and child meet on it first (``meet``); None: they do not.
    tree: HostTree | None = None

    def tag(self, piece: int) -> int:
        return TAG_BASE | ((self.seq & ((1 << _SEQ_BITS) - 1)) << _PIECE_BITS) | piece

    def control(self, kind: int) -> int:
        """The tag of one of the transfer's small messages (``VERDICT``, ``NEED``) or the source's
        second copy (``COPY``) for this graph."""
        return _CONTROL_BASE | (kind << _SEQ_BITS) | (self.seq & ((1 << _SEQ_BITS) - 1))

    def peer(self, rank: int) -> int:
        """Global rank -> its rank in the compile group."""
        return self.members.index(rank)


@dataclasses.dataclass(frozen=True)
class Route:
    """How one rank takes part in one source's transfer (the source's own: ``RECEIVE``'s
    sending half, with no parent)."""

    mode: str
    parent: int | None = None  # RECEIVE: whom it receives from
    children: tuple[int, ...] = ()  # the source and RECEIVE: whom it forwards to
    readers: tuple[int, ...] = ()  # RECEIVE: the ranks of its dir that read its install
    via: int | None = None  # READ: its dir's receiver
    receivers: tuple[int, ...] = ()  # the source: every receiver of its tree (each may ask for a copy)


def routes(
    source: int, result: Result, plans: Mapping[int, Plan], offers: dict[int, Offer], level: str, fanout: int
) -> dict[int, Route]:
    """Every rank's route for ``source``'s artifact (its loaders and the source itself); pure: the
    same on every rank, so each send has its receive."""
    loaders = sorted(r for r, p in plans.items() if p.role == LOAD and p.source == source)
    out: dict[int, Route] = {}
    by_dir: dict[str, list[int]] = {}
    total = result.total()
    # The same for every loader: checked once, not once per rank of the job.
    safe = total > 0 and artifact.manifest_problem(result, source, level) is None
    for r in loaders:
        if plans[r].shares_dir:
            out[r] = Route(SHARED)
        elif safe and total <= offers[r].max_artifact_bytes:
            by_dir.setdefault(offers[r].dir, []).append(r)
        else:
            out[r] = Route(NONE)
    nodes = [source] + sorted(members[0] for members in by_dir.values())
    fanout = max(1, fanout)

    def children(i: int) -> tuple[int, ...]:
        return tuple(nodes[fanout * i + 1 : fanout * i + fanout + 1])

    out[source] = Route(RECEIVE, None, children(0), receivers=tuple(nodes[1:]))
    for i in range(1, len(nodes)):
        receiver = nodes[i]
        readers = tuple(by_dir[offers[receiver].dir][1:])
        out[receiver] = Route(RECEIVE, nodes[(i - 1) // fanout], children(i), readers)
        for r in readers:
            out[r] = Route(READ, via=receiver)
    return out


@dataclasses.dataclass(frozen=True)
class Graph:
    """One graph's transfer as its driver has it once the result exchange ended: the link, every
    rank's plan and offer (from which every rank works out the same routes), the graph's level
    ("aot" or "fx") and the tree's fan-out (``COMPILER_COLLECTIVES_ONCE_FANOUT``)."""

    link: Link
    plans: Mapping[int, Plan]
    offers: dict[int, Offer]
    level: str
    fanout: int

    def route(self, source: int, result: Result) -> Route:
        """This rank's route for ``source``'s artifact."""
        return routes(source, result, self.plans, self.offers, self.level, self.fanout)[self.link.rank]


def serve(graph: Graph, bundle: bytes, result: Result) -> float:
    """The source: its bytes down its tree (``send``); the seconds it took."""
    t0 = time.perf_counter()
    send(graph.link, bundle, result, graph.route(graph.link.rank, result))
    return time.perf_counter() - t0


def chunk_digests(bundle: bytes, chunk_bytes: int) -> list[bytes]:
    """The SHA-256 of each ``chunk_bytes`` piece of ``bundle`` (the source's, for the result)."""
    view = memoryview(bundle)
    return [hashlib.sha256(view[i : i + chunk_bytes]).digest() for i in range(0, len(bundle), chunk_bytes)]


def _pieces(total: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(i, min(total, i + chunk_bytes)) for i in range(0, total, chunk_bytes)]


# A piece's send or receive that failed on the helper thread: gloo's error, the peer, what it is to this rank.
_Broken = tuple[RuntimeError, int, str]


def _run(link: Link, fn: Callable[[], tuple[T, _Broken | None]]) -> T:
    """``fn`` (the waits of one transfer) on ``run_p2p``'s helper thread; a failed piece as our error."""
    value, failed = run_p2p(fn, link.where)
    if failed is not None:
        error, peer, what = failed
        raise link.failed(broken(error, link.where, peer, what)) from error
    return value


def broken(error: RuntimeError, where: Callable[[], str], peer: int, what: str) -> CollectiveError:
    """The error of a failed piece: gloo's own (a broken connection) names the one peer it was
    with, which the whole subtree below then hears in this rank's report. Gloo's timeout (the
    compile group's: COMPILER_COLLECTIVES_TIMEOUT) says that peer never took its part: stuck, or
    on another code path, not gone."""
    if isinstance(error, CollectiveError):
        return error
    if "timed out" in str(error).lower():
        return CollectiveTimeoutError(
            f"{where()}: rank {peer} ({what}) did not take its part within {config.settings.timeout_s:.0f}s "
            f"(COMPILER_COLLECTIVES_TIMEOUT; gloo: {str(error).splitlines()[0]}). It is stuck, much slower, or "
            "took another code path; check its log.",
            ranks=(peer,),
        )
    return PeerFailureError(
        f"{where()}: the connection to rank {peer} ({what}) broke: {error}. Rank {peer} most likely "
        f"crashed or was killed; check its log and exit status.",
        ranks=(peer,),
    )


def meet(link: Link, peers: tuple[int, ...]) -> None:
    """One record each way with each of ``peers`` (its parent and children in the tree) on the host
    tree's records' tag, before any piece: a peer in a MIN or a gather over the tree (another
    graph, or another code path) raises ``CollectiveDesyncError`` there and here at once, each
    naming the other's exchange, where both would wait for the group's timeout on tags the other
    never uses."""
    if link.tree is None or not peers:
        return
    stamp = HostTree.stamp(phases.ONCE_TRANSFER, link.seq)
    try:
        link.tree.meet(link.pg, [link.peer(r) for r in peers], stamp, link.where, lambda i: link.members[i])
    except CollectiveError as e:
        raise link.failed(e) from e
    except RuntimeError as e:  # gloo's: a connection broke (whose: a look at each), or its timeout
        gone = [r for r in broken_peers(link.pg, link.members) if r in peers] if len(peers) > 1 else []
        peer = (gone or list(peers))[0]
        raise link.failed(broken(e, link.where, peer, "its peer in the artifact's tree")) from e


def _verdict(rank: int) -> bytes:
    return rank.to_bytes(8, "little", signed=True)


def send(link: Link, bundle: bytes, result: Result, route: Route) -> None:
    """The source: each piece to each of its children (piece-major, so every child's first piece
    leaves first) and its clean verdict; then each receiver's word, and a copy of its own to
    every receiver whose check failed."""
    if not route.children or not bundle:
        return
    meet(link, route.children)
    data = byte_tensor(bundle)
    clean = byte_tensor(_verdict(_CLEAN))
    works = [
        start_send(link.pg, data[a:b], link.peer(child), link.tag(k))
        for k, (a, b) in enumerate(_pieces(len(bundle), result.chunk_bytes))
        for child in route.children
    ]
    works += [start_send(link.pg, clean, link.peer(child), link.control(VERDICT)) for child in route.children]
    words = {r: byte_tensor(1) for r in route.receivers}
    asked = [(r, start_recv(link.pg, words[r], link.peer(r), link.control(NEED))) for r in route.receivers]

    def serve() -> tuple[tuple[int, ...], _Broken | None]:
        broken = _wait_sends(works, route.children)
        if broken is not None:
            return (), broken
        for r, work in asked:
            try:
                work.wait()
            except RuntimeError as e:
                return (), (e, r, "a receiver of its artifact, which tells it whether it needs the bytes again")
        wanting = tuple(r for r in route.receivers if tensor_view(words[r])[0] == 1)
        copies = [start_send(link.pg, data, link.peer(r), link.control(COPY)) for r in wanting]
        return wanting, _wait_sends(copies, wanting)

    ledger.add(ArtifactSent(len(route.children), len(bundle) * len(route.children)))
    wanting = _run(link, serve)
    if wanting:
        ledger.add(ArtifactSent(len(wanting), len(bundle) * len(wanting)))
        log.warning(
            "%s: sent rank(s) %s a second copy of the artifact: the bytes they took in the tree failed "
            "their check (see their logs for who sent them altered)",
            link.where(),
            ", ".join(map(str, wanting)),
        )


def _wait_sends(works: list[Any], children: tuple[int, ...]) -> _Broken | None:
    """Wait for sends posted piece-major to ``children``; a failed one names its child."""
    for i, w in enumerate(works):
        try:
            w.wait()
        except RuntimeError as e:
            return e, children[i % len(children)], "its child in the artifact's tree"
    return None


def _first_bad(data: Any, pieces: list[tuple[int, int]], result: Result) -> tuple[int, int] | None:
    """The byte range of the first piece of ``data`` whose SHA-256 is not the source's."""
    for k, (a, b) in enumerate(pieces):
        if hashlib.sha256(tensor_view(data[a:b])).digest() != result.chunks[k]:
            return a, b
    return None


@dataclasses.dataclass(frozen=True)
class Received:
    """What a dir's receiver took: the bytes (empty when refused), why they are refused (None:
    every piece matched), and, when the tree's bytes failed their check but the source's own
    copy matched, why the tree's were refused (for the log and the graph's record)."""

    data: bytes
    refusal: artifact.Refusal | None
    refetched: str | None = None


def receive(link: Link, result: Result, route: Route, source: int) -> Received:
    """A dir's receiver: every piece from its parent, each checked against its digest, then
    forwarded to its children (zeros in place of a piece that failed, and from then on); its
    parent's verdict, and its own to its children; then its word to the source, and the source's
    own copy when its check failed."""
    assert route.parent is not None
    parent_rank = route.parent
    meet(link, (parent_rank, *route.children))
    total = result.total()
    pieces = _pieces(total, result.chunk_bytes)
    data = byte_tensor(total)
    parent = link.peer(parent_rank)
    recvs = [start_recv(link.pg, data[a:b], parent, link.tag(k)) for k, (a, b) in enumerate(pieces)]
    heard = byte_tensor(8)
    verdict_recv = start_recv(link.pg, heard, parent, link.control(VERDICT))
    from_parent = "its parent in the artifact's tree, which sends it the bytes"
    from_source = "the artifact's source, which sends it a copy of its own"

    def take() -> tuple[tuple[tuple[int, int] | None, int, Any], _Broken | None]:
        sends: list[Any] = []
        bad: tuple[int, int] | None = None  # the first piece that failed its check
        for k, ((a, b), work) in enumerate(zip(pieces, recvs)):
            try:
                work.wait()
            except RuntimeError as e:
                return (None, _CLEAN, None), (e, parent_rank, from_parent)
            piece = data[a:b]
            if bad is None and hashlib.sha256(tensor_view(piece)).digest() != result.chunks[k]:
                bad = (a, b)
            if bad is not None:
                piece.zero_()  # never pass on bytes that failed their check
            sends.extend(start_send(link.pg, piece, link.peer(child), link.tag(k)) for child in route.children)
        try:
            verdict_recv.wait()
        except RuntimeError as e:
            return (None, _CLEAN, None), (e, parent_rank, from_parent)
        upstream = int.from_bytes(tensor_view(heard), "little", signed=True)
        # A clean verdict (or one that names no rank of the group): the parent's own bytes failed.
        culprit = _CLEAN if bad is None else (upstream if upstream in link.members else parent_rank)
        mine = byte_tensor(_verdict(culprit))
        sends += [start_send(link.pg, mine, link.peer(child), link.control(VERDICT)) for child in route.children]
        copy = byte_tensor(total if bad is not None else 0)
        copy_recv = start_recv(link.pg, copy, link.peer(source), link.control(COPY)) if bad is not None else None
        need = byte_tensor(b"\x01" if bad is not None else b"\x00")
        word = start_send(link.pg, need, link.peer(source), link.control(NEED))
        broken = _wait_sends(sends, route.children)
        if broken is not None:
            return (bad, culprit, None), broken
        for work in (word, copy_recv):
            if work is None:
                continue
            try:
                work.wait()
            except RuntimeError as e:
                return (bad, culprit, None), (e, source, from_source)
        return (bad, culprit, copy), None

    bad, culprit, copy = _run(link, take)
    ledger.add(ArtifactReceived(total))
    if route.children:
        ledger.add(ArtifactSent(len(route.children), total * len(route.children)))
    if bad is None:
        return Received(bytes(tensor_view(data)), None)
    a, b = bad
    why = (
        f"bytes {a}-{b} of the artifact, as this rank took them from rank {parent_rank} in the tree, do not "
        f"match the SHA-256 rank {source} sent over the job's gloo group: rank {culprit} sent them altered "
        + (
            f"(rank {parent_rank}, which checked them, forwarded zeros in their place)"
            if culprit != parent_rank
            else "(after its own check of them passed: in its memory or on the link)"
            if culprit != source
            else "(in its memory or on the link)"
        )
    )
    ledger.add(ArtifactReceived(total))
    again = _first_bad(copy, pieces, result)
    if again is not None:
        return Received(
            b"",
            artifact.Refusal(
                f"{why}; the copy rank {source} then sent this rank directly failed its check too "
                f"(bytes {again[0]}-{again[1]})",
                True,
            ),
        )
    ledger.add(DigestMismatch(refetched=True))
    log.warning("%s: refused the tree's bytes (%s); took rank %d's own copy instead", link.where(), why, source)
    return Received(
        bytes(tensor_view(copy)),
        None,
        f"loaded rank {source}'s own copy, sent to this rank directly: this rank refused the bytes it took "
        f"in the tree: {why}",
    )
