"""The program audit's record of one graph: the fingerprints this rank gathered for one exchange.

``audit.py`` opens a record (``GraphAudit``) for each graph Dynamo hands to a backend and keeps
it open on this thread while the backend runs (``opened``), so that AOTAutograd's compilers and
inductor's post-grad passes add their graphs' fingerprints to it (``current``). One AOTAutograd
compile inside it is an ``AotScope``: whether it had a backward, and whether that backward was
compiled with the forward. ``levels()`` is what the record sends in the exchange
(``audit_verdict.settle``): per graph level, a digest of the ordered collectives and one of the
whole graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Iterator

import torch

from ..ledger import ledger
from ..observations import FrameId
from ..records import Fingerprinted
from . import wire
from .fingerprint import Collective, GraphFingerprint, collectives_digest, fingerprint

log = logging.getLogger("compiler_collectives.audit")

# Graph levels, in the order a difference is reported (the earliest is the
# closest to the user's code).
LEVELS = ("dynamo", "aot_forward", "aot_backward", "inductor_forward", "inductor_backward")
LEVEL_NAMES = {
    "dynamo": "the graph Dynamo handed to the backend",
    "aot_forward": "the AOTAutograd forward graph(s)",
    "aot_backward": "the AOTAutograd backward graph(s)",
    "inductor_forward": "inductor's post-grad forward graph(s)",
    "inductor_backward": "inductor's post-grad backward graph(s)",
}

_local = threading.local()  # record: GraphAudit | None, stage: str | None


@dataclasses.dataclass
class AotScope:
    """One AOTAutograd compile inside an audited Dynamo graph."""

    frame: FrameId
    training: bool = False  # the forward compiler ran: there is a backward graph
    backward_compiled: bool = False  # ... and it was compiled with the forward


class GraphAudit:
    """Fingerprints gathered for one exchange: a Dynamo graph's compile."""

    def __init__(self, frame: FrameId, phase: str, graph_break: str | None = None) -> None:
        self.frame = frame
        self.phase = phase
        # "file.py:18 (reason)" when this rank's trace ends this graph at a graph break.
        self.graph_break = graph_break
        self.graphs: list[GraphFingerprint] = []
        self.broken: set[str] = set()  # levels this rank could not fingerprint
        self.scopes: list[AotScope] = []
        self.spent_s = 0.0
        self.compared: list[str] = []  # levels every rank produced, once settled

    def add(self, gm: torch.fx.GraphModule, level: str) -> None:
        started = time.perf_counter()
        try:
            self.graphs.append(fingerprint(gm, level))
            ledger.add(Fingerprinted(level))
        except Exception as e:  # noqa: BLE001 - never fail a compile over the audit itself
            # Dropping the level keeps the comparison honest: a level this rank
            # cannot describe is left out of the exchange, so it is compared nowhere.
            self.broken.add(level)
            log.warning(
                "program audit: cannot fingerprint a %s graph of %s (%s: %s); that level is "
                "not compared for this compile",
                level,
                self.frame,
                type(e).__name__,
                e,
            )
        self.spent_s += time.perf_counter() - started

    def collectives(self, level: str) -> list[Collective]:
        return [c for g in self.graphs if g.level == level for c in g.collectives]

    def levels(self) -> list[wire.AuditLevel]:
        out = []
        for level in LEVELS:
            graphs = [g for g in self.graphs if g.level == level]
            if not graphs or level in self.broken:
                continue
            collectives = [c for g in graphs for c in g.collectives]
            h = hashlib.blake2b(digest_size=8)
            for g in graphs:
                h.update(g.graph_hash)
            out.append(
                wire.AuditLevel(level, len(graphs), len(collectives), collectives_digest(collectives), h.digest())
            )
        return out


def current() -> GraphAudit | None:
    """The record open on this thread (a graph being audited), if any."""
    return getattr(_local, "record", None)


def stage() -> str | None:
    """The AOTAutograd compiler running under the open record ("forward", "backward", ...), if any."""
    return getattr(_local, "stage", None)


@contextlib.contextmanager
def opened(record: GraphAudit | None, stage: str | None) -> Iterator[None]:
    """``record`` open on this thread (under AOTAutograd's ``stage`` compiler), restored after."""
    saved = (getattr(_local, "record", None), getattr(_local, "stage", None))
    _local.record, _local.stage = record, stage
    try:
        yield
    finally:
        _local.record, _local.stage = saved
