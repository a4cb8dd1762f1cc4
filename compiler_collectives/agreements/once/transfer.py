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

The tree: the source is node 0, the receivers nodes 1..D in rank order, and node i's children
are nodes F*i+1 .. F*i+F. The bytes go in pieces of ``chunk_bytes`` (the source's
``COMPILER_COLLECTIVES_ONCE_CHUNK_BYTES``), each with its own tag, so a receiver forwards piece k
while piece k+1 arrives: one graph takes about F * size / bandwidth plus one piece's time per
level. A forwarder cannot change what its subtree loads: the digests come from the source, every
receiver checks every piece, and a piece that fails its check is forwarded as zeros (its subtree
refuses too, and compiles locally). The sends and receives of a transfer are waited for with
``run_p2p``: a parent may start late (it sends once the result exchange, which no longer waits for
every rank, ended there), and gloo's timed wait of a slice would close the group's connections. A
forwarder that dies breaks its children's receive at once (gloo's connection closes); they raise
``PeerFailureError`` through the failure procedure, whose report stops the rest of the subtree
within a heartbeat.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

from ...errors import CollectiveError
from ...stats import counters
from ...transport import byte_tensor, run_p2p, start_recv, start_send, tensor_view
from ..wire.once import Offer, Result
from . import artifact
from .plan import LOAD, Plan

# Tags of the pieces: bit 30 set, the graph's number in bits 20-29, the piece's in bits 0-19
# (gloo's tags are 32-bit signed; pieces are at most wire.once.MAX_CHUNKS = 2**20).
TAG_BASE = 1 << 30
_SEQ_BITS, _PIECE_BITS = 10, 20

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
    failed: Callable[[RuntimeError, int, str], CollectiveError]  # (error, the peer, what it is to this rank)

    def tag(self, piece: int) -> int:
        return TAG_BASE | ((self.seq & ((1 << _SEQ_BITS) - 1)) << _PIECE_BITS) | piece

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


def routes(
    source: int, result: Result, plans: dict[int, Plan], offers: dict[int, Offer], level: str, fanout: int
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

    out[source] = Route(RECEIVE, None, children(0))
    for i in range(1, len(nodes)):
        receiver = nodes[i]
        readers = tuple(by_dir[offers[receiver].dir][1:])
        out[receiver] = Route(RECEIVE, nodes[(i - 1) // fanout], children(i), readers)
        for r in readers:
            out[r] = Route(READ, via=receiver)
    return out


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
    value, broken = run_p2p(fn, link.where)
    if broken is not None:
        error, peer, what = broken
        raise link.failed(error, peer, what) from error
    return value


def send(link: Link, bundle: bytes, result: Result, route: Route) -> None:
    """The source: each piece to each of its children (piece-major, so every child's first piece
    leaves first), then wait for all of them."""
    if not route.children or not bundle:
        return
    data = byte_tensor(bundle)
    works = [
        start_send(link.pg, data[a:b], link.peer(child), link.tag(k))
        for k, (a, b) in enumerate(_pieces(len(bundle), result.chunk_bytes))
        for child in route.children
    ]
    counters.once_copies_sent += len(route.children)
    counters.once_bytes_sent += len(bundle) * len(route.children)
    _run(link, lambda: (None, _wait_sends(works, route.children)))


def _wait_sends(works: list[Any], children: tuple[int, ...]) -> _Broken | None:
    """Wait for sends posted piece-major to ``children``; a failed one names its child."""
    for i, w in enumerate(works):
        try:
            w.wait()
        except RuntimeError as e:
            return e, children[i % len(children)], "its child in the artifact's tree"
    return None


def receive(link: Link, result: Result, route: Route, source: int) -> tuple[bytes, artifact.Refusal | None]:
    """A dir's receiver: every piece from its parent, each checked against its digest, then
    forwarded to its children (zeros in place of a piece that failed). The bytes, and why they
    are refused (None: every piece matched)."""
    assert route.parent is not None
    parent_rank = route.parent
    total = result.total()
    pieces = _pieces(total, result.chunk_bytes)
    data = byte_tensor(total)
    parent = link.peer(parent_rank)
    recvs = [start_recv(link.pg, data[a:b], parent, link.tag(k)) for k, (a, b) in enumerate(pieces)]

    def take() -> tuple[artifact.Refusal | None, _Broken | None]:
        sends: list[Any] = []
        refusal: artifact.Refusal | None = None
        for k, ((a, b), work) in enumerate(zip(pieces, recvs)):
            try:
                work.wait()
            except RuntimeError as e:
                return None, (e, parent_rank, "its parent in the artifact's tree, which sends it the bytes")
            piece = data[a:b]
            if refusal is None and hashlib.sha256(tensor_view(piece)).digest() != result.chunks[k]:
                via = "" if parent_rank == source else f", forwarded by rank {parent_rank},"
                refusal = artifact.Refusal(
                    f"bytes {a}-{b} of the artifact{via} do not match the SHA-256 rank {source} sent over the "
                    "job's gloo group",
                    True,
                )
            if refusal is not None:
                piece.zero_()  # never pass on bytes that failed their check
            sends.extend(start_send(link.pg, piece, link.peer(child), link.tag(k)) for child in route.children)
        return refusal, _wait_sends(sends, route.children)

    refusal = _run(link, take)
    counters.once_bytes_received += total
    if route.children:
        counters.once_copies_sent += len(route.children)
        counters.once_bytes_sent += total * len(route.children)
    return (b"" if refusal is not None else bytes(tensor_view(data))), refusal


def install(root: str, result: Result, data: bytes, source: int) -> artifact.Accepted | artifact.Refusal:
    """A dir's receiver, once every piece matched: check each file and install them under ``root``."""
    pieces, refusal = artifact.split_verified(result.manifest, data, source)
    if refusal is not None:
        return refusal
    return artifact.install(root, pieces)
