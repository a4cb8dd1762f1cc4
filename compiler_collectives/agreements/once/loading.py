"""A loader's side of compile once's transfer: by its route (``transfer.routes``), the source's
files received (or found in its cache dir), checked against their SHA-256, and installed.

``receive_and_install`` follows this rank's route: a dir's receiver takes the pieces down the
tree (``transfer.receive``) and installs them, then tells its dir's readers; a reader waits for
that install and checks the files in place, as a rank sharing the source's dir does; a rank that
does not accept the artifact refuses on its own. ``Dir`` is this rank's cache dir as it needs it
(with the mailbox's store notices for a dir's readers); ``Installed`` what it came to: why it
refused, if it did, and its bytes and times for the graph's record.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from ...ledger import ledger
from ...records import DigestMismatch
from ..wire.once import Result
from . import artifact
from .transfer import NONE, READ, RECEIVE, SHARED, Graph, Received, Route, receive

log = logging.getLogger("compiler_collectives.once")


def install(root: str, result: Result, data: bytes, source: int) -> artifact.Accepted | artifact.Refusal:
    """A dir's receiver, once every piece matched: check each file and install them under ``root``."""
    pieces, refusal = artifact.split_verified(result.manifest, data, source)
    if refusal is not None:
        return refusal
    return artifact.install(root, pieces)


@dataclasses.dataclass(frozen=True)
class Dir:
    """This rank's cache dir as a loader's install needs it: its root, where the entry of its own
    key lives under it (``prefix``), and how the ranks of one dir hear of their receiver's install
    (the mailbox's notices on the store)."""

    root: str
    prefix: str
    key: str | None
    installed: Callable[[int], bytes]  # what rank ``via``, this dir's receiver, posted: b"ok" or why it refused
    post: Callable[[bytes], None]  # this rank as its dir's receiver: the same post, for its readers


@dataclasses.dataclass(frozen=True)
class Installed:
    """What a loader's receive and install came to: why it refused (None: the files are in
    place; nothing was written otherwise), why its bytes are the source's own copy rather than
    the tree's (``Received.refetched``), the bytes it received, and its time: the bytes reaching
    this dir (receiving, or waiting for the dir's receiver) and the rest (checking, installing)."""

    refusal: str | None
    refetched: str | None = None
    bytes_in: int = 0
    transfer_s: float = 0.0
    install_s: float = 0.0


def receive_and_install(graph: Graph, result: Result, source: int, here: Dir) -> Installed:
    """A loader of ``source``'s artifact: receive (or find in this dir) its files and check each
    against its SHA-256; install them.

    A dir's receiver takes every byte its parent sends and forwards it whatever it then decides
    for itself: its subtree and its dir's readers must never wait on a decision only it made."""
    started = time.perf_counter()
    problem = artifact.manifest_problem(result, source, graph.level)
    if problem is not None:
        # The same on every rank: no rank receives (``routes``).
        return Installed(problem, install_s=time.perf_counter() - started)
    route = graph.route(source, result)
    got, moved, bytes_in = Received(b"", None), 0.0, 0
    if route.mode == RECEIVE:
        t0 = time.perf_counter()
        got = receive(graph.link, result, route, source)
        moved, bytes_in = time.perf_counter() - t0, result.total()
    why = _refused(artifact.foreign_entry(result.manifest, here.prefix, here.key, graph.level))
    if why is None and route.mode == READ:
        assert route.via is not None
        t0 = time.perf_counter()
        said = here.installed(route.via)
        moved += time.perf_counter() - t0
        if said != b"ok":
            why = f"rank {route.via}, which receives for this cache dir, did not install it: " + said.decode(
                "utf-8", "replace"
            )
    if why is None:
        why = _place(graph, result, route, source, here.root, got.data, got.refusal)
    if route.mode == RECEIVE and route.readers:
        here.post(b"ok" if why is None else why.encode()[:2000])
    refetched = got.refetched if why is None else None
    return Installed(why, refetched, bytes_in, moved, time.perf_counter() - started - moved)


def _place(
    graph: Graph,
    result: Result,
    route: Route,
    source: int,
    root: str,
    data: bytes,
    received: artifact.Refusal | None,
) -> str | None:
    """The files in place under ``root`` by this rank's route; None, or why not."""
    if route.mode == NONE:
        mine = graph.offers[graph.link.rank]
        return (
            f"the artifact is {result.total()} bytes, over COMPILER_COLLECTIVES_MAX_ARTIFACT_BYTES "
            f"({mine.max_artifact_bytes})"
        )
    if route.mode in (SHARED, READ):
        return _taken(graph, artifact.check_shared(root, result.manifest, source))
    if received is not None:
        return _refused(received)
    return _taken(graph, install(root, result, data, source))


def _taken(graph: Graph, outcome: artifact.Accepted | artifact.Refusal) -> str | None:
    """None when the artifact is in place, else why not. Files it replaced (torn or stale) or
    kernel binaries it kept (built here from the same source) are named for on-call."""
    if isinstance(outcome, artifact.Refusal):
        return _refused(outcome)
    if outcome.replaced or outcome.kept:
        log.info(
            "%s: took the artifact; replaced %d file(s) whose bytes differed (torn or stale) %s; kept %d "
            "kernel binar(ies) built here from the same source %s",
            graph.link.where(),
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
        ledger.add(DigestMismatch(refetched=False))
    return refusal.why
