"""How a loading rank gets its source's files, behind one small interface.

``Transfer``: the source ``send``s its bundle to the loaders that need the bytes; a loader
``take``s the artifact into its cache dir, checked against the manifest. Two kinds today:

* ``SharedDir``: the loader shares the source's cache dir; nothing travels, the files are
  checked where they lie;
* ``Gloo``: point to point over the job's compile group, one copy per loader with another dir.

``for_loader`` picks one from the plan; both sides decide from what both know (the plan, the
manifest, the loader's limit), so a send never lacks its receive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from ...errors import CollectiveError
from ...stats import counters
from ...transport import recv_bytes, send_bytes, wait
from ..wire.once import Offer, Result
from . import artifact
from .plan import LOAD, Plan

TAG_BASE = 0x0CC00000


@dataclasses.dataclass(frozen=True)
class Link:
    """One graph's transfer context: the compile group, its members (global ranks), this rank,
    the graph's number (tags), where we are (for errors) and how a failed transfer is named."""

    pg: Any
    members: tuple[int, ...]
    rank: int
    seq: int
    where: Callable[[], str]
    failed: Callable[[RuntimeError], CollectiveError]

    def tag(self) -> int:
        return TAG_BASE + (self.seq & 0xFFFFF)


class Transfer(Protocol):
    def take(self, link: Link, root: str, result: Result, source: int) -> artifact.Accepted | artifact.Refusal:
        """The source's files, checked against ``result``'s manifest and in place under ``root``."""
        ...


def travels(result: Result, plan: Plan, offer: Offer, level: str) -> bool:
    """Whether the source sends its bytes to a loading rank (``Gloo``)."""
    total = sum(f.size for f in result.manifest)
    return (
        plan.source is not None
        and not plan.shares_dir
        and 0 < total <= offer.max_artifact_bytes
        and artifact.manifest_problem(result, plan.source, level) is None
    )


class SharedDir:
    """The loader shares the source's cache dir: the listed files are there, as listed."""

    def take(self, link: Link, root: str, result: Result, source: int) -> artifact.Accepted | artifact.Refusal:
        return artifact.check_shared(root, result.manifest, source)


class Gloo:
    """Point to point over the job's compile group (gloo), one copy to each loader that needs it."""

    def send(
        self, link: Link, bundle: bytes, result: Result, plans: dict[int, Plan], offers: dict[int, Offer], level: str
    ) -> None:
        total = sum(f.size for f in result.manifest)
        works = []
        for r, p in sorted(plans.items()):
            if p.role == LOAD and p.source == link.rank and travels(result, p, offers[r], level):
                works.append(send_bytes(link.pg, bundle, link.members.index(r), link.tag(), link.where))
                counters.once_bytes_sent += total
        try:
            for w in works:
                wait(w, link.where)
        except RuntimeError as e:
            raise link.failed(e) from e

    def take(self, link: Link, root: str, result: Result, source: int) -> artifact.Accepted | artifact.Refusal:
        total = sum(f.size for f in result.manifest)
        try:
            data = recv_bytes(link.pg, total, link.members.index(source), link.tag(), link.where)
        except RuntimeError as e:
            raise link.failed(e) from e
        counters.once_bytes_received += total
        pieces, refusal = artifact.split_verified(result.manifest, data, source)
        if refusal is not None:
            return refusal
        return artifact.install(root, pieces)


def for_loader(plan: Plan) -> Transfer:
    return SharedDir() if plan.shares_dir else Gloo()
