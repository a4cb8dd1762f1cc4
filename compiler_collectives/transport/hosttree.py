"""A tree over one gloo group's ranks by host, for exchanges whose cost must not grow with the world.

An exchange a caller runs for every graph it compiles, as an all-gather or a ring all-reduce on
the whole group, costs O(N) hops and, for the all-gathers, O(N) bytes per rank. Over a
``HostTree`` it costs O(log hosts) steps, and bytes per rank that grow with what was contributed,
not with the world (a host's leader: with its host's ranks too). Every operation takes one path:

* each rank sends what it holds to its host's leader (the host's lowest rank), the leader folds
  it in; the leaders fold among themselves by recursive doubling (``hierarchy.doubling_plan``,
  as the guard collective's leaders do: ceil(log2 H) rounds, two more when H is not a power of
  two); each leader sends the outcome back to its host's ranks.
* ``min_ints``: what a rank holds is a fixed record of ints (``HostTree.width``); folding is the
  element-wise MIN.
* ``gather``: what a rank holds is a set of entries (group rank -> bytes), its own payload or
  none; folding is the union. A rank without a payload sends a record and nothing else.
* ``gather_table``: what a rank holds is a ``table.Table``, its own row of byte strings (one per
  column) or none; folding is the union of the rows, each column's distinct values kept once: a
  rank ends with each distinct value once and a few ints per row, not every rank's payload. The
  leaders sort the rows by rank before they send them down to their hosts' ranks.

Every message of each starts with a record of one fixed width on one tag: the operation, the
exchange's stamp (``HostTree.stamp``: the caller's phase and number), and for a gather the number
and the bytes of the entries (or the table's rows) that follow on another tag (checked against
the caller's limit before anything is allocated). So whatever two ranks are doing, the first
message one receives from the other says what the other is in: a rank in a MIN whose peer is in a
gather, or at another number, raises ``CollectiveDesyncError`` naming that peer at once (in the
caller's words for its phases: ``gloo.Phases``, given at ``build``), and sends its own record to
each of its peers in the exchange (a notice) so that they raise too, instead of each waiting for
COMPILER_COLLECTIVES_TIMEOUT. Records keep their width across operations so that any two always
pair up. A caller's own exchange with some of the group's ranks on tags of its own (compile once's
artifact transfer) starts with a ``meet``: one such record each way with each of those peers, so
that a peer found in a MIN or a gather meanwhile (or the reverse) is named at once too.

Point-to-point operations on the group itself, on tags of their own (``p2p.TAG_BASE``): no group
more per host, and a rank of another host is one gloo connection away. Within a host the records
go over gloo's loopback connections, not the guard's shared-memory segment: a few tens of
microseconds per exchange, which an exchange per graph (not per call) can afford. Each exchange
runs on a helper thread and is waited for in slices (``p2p.run_p2p``: a rank waits here for peers
still compiling or running user code).

Built once per generation of our groups, every rank together, from one all-gather of each
rank's host key (``hierarchy.host_key``: torchrun's agents are hosts), by Bruck's algorithm
(``p2p.gather_ints``: ceil(log2 N) rounds). The tree holds ints (and the caller's names)
only: the caller passes the group to each exchange, so nothing here keeps a group (and its
store) alive past its generation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
import torch.distributed as dist

from ..errors import WireFormatError
from .gloo import Phases
from .hierarchy import host_key
from .p2p import gather_ints, sliced
from .table import Table
from .tree_exchange import ENTRY_HEAD, GATHER, HEAD, MEET, MIN, NEUTRAL, TABLE, Exchange


# The operations and the record's layout: ``tree_exchange``'s.
def _same(i: int) -> int:
    return i


@dataclasses.dataclass(frozen=True)
class HostTree:
    """Group ranks by host (hosts in order of their lowest rank), this rank's place, the record width."""

    index: int  # this rank in the group
    hosts: tuple[tuple[int, ...], ...]  # group ranks of each host, ascending
    place: tuple[tuple[int, int], ...]  # group rank -> (host, index on its host)
    width: int  # int64s per record of ``min_ints``
    phases: Phases = dataclasses.field(default_factory=Phases)  # how the caller names its exchanges
    NEUTRAL: ClassVar[int] = NEUTRAL
    HEAD: ClassVar[int] = HEAD
    ENTRY_HEAD: ClassVar[int] = ENTRY_HEAD

    @classmethod
    def build(
        cls,
        pg: dist.ProcessGroup,
        width: Callable[[int], int],
        describe: Callable[[], str] | None = None,
        phases: Phases | None = None,
    ) -> HostTree:
        """Every rank of ``pg`` together: one all-gather of host keys (``gather_ints``: ceil(log2 N)
        rounds, not gloo's ring of N - 1). ``width(ranks_per_host)``: the record width (the same
        on every rank); ``phases``: how the caller names the phases of its stamps, and what it
        advises, where ranks are found in different exchanges."""
        keys = sliced(lambda: gather_ints(pg, host_key()), describe)
        by_key: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_key.setdefault(key, []).append(i)
        hosts = tuple(tuple(v) for v in by_key.values())
        place = [(0, 0)] * pg.size()
        for h, ranks in enumerate(hosts):
            for j, i in enumerate(ranks):
                place[i] = (h, j)
        return cls(pg.rank(), hosts, tuple(place), width(max(len(h) for h in hosts)), phases or Phases())

    @staticmethod
    def stamp(phase: int, seq: int) -> int:
        """An exchange's stamp: its phase (the caller's number, named in ``phases``) and number."""
        return (phase << 32) | (seq & 0xFFFFFFFF)

    @property
    def size(self) -> int:
        return len(self.place)

    @property
    def host(self) -> int:
        return self.place[self.index][0]

    @property
    def local_index(self) -> int:
        return self.place[self.index][1]

    @property
    def ranks_per_host(self) -> int:
        return max(len(h) for h in self.hosts)

    def min_ints(
        self,
        pg: dist.ProcessGroup,
        values: list[int],
        describe: Callable[[], str],
        stamp: int = 0,
        name: Callable[[int], int] = _same,
    ) -> list[int]:
        """The element-wise MIN of every rank's ``values`` (at most ``width``; every rank the same
        length). A rank in another exchange (another operation or ``stamp``) raises
        ``CollectiveDesyncError`` naming it (``name``: group rank -> global)."""
        if len(values) > self.width:
            raise ValueError(f"{len(values)} values in a record of {self.width}")
        held, _ = self._run(pg, MIN, stamp, values, None, 0, describe, name)
        return held[: len(values)]

    def gather(
        self,
        pg: dist.ProcessGroup,
        payload: bytes | None,
        stamp: int,
        max_bytes: int,
        describe: Callable[[], str],
        name: Callable[[int], int] = _same,
    ) -> dict[int, bytes]:
        """Every rank's ``payload`` on every rank (group rank -> bytes; a rank whose payload is
        None has no entry). A payload over ``max_bytes``, or more bytes announced than that allows,
        raises ``WireFormatError`` naming the rank, allocating nothing; a rank in another
        exchange raises ``CollectiveDesyncError`` naming it (``name``: group rank -> global)."""
        _, entries = self._run(pg, GATHER, stamp, [], payload, max_bytes, describe, name)
        assert isinstance(entries, dict)
        return entries

    def gather_table(
        self,
        pg: dist.ProcessGroup,
        row: Sequence[bytes] | None,
        columns: int,
        stamp: int,
        max_bytes: int,
        describe: Callable[[], str],
        name: Callable[[int], int] = _same,
    ) -> Table:
        """Every rank's ``row`` (``columns`` byte strings; None: this rank has none) on every rank, as
        one table in group rank order: each column's distinct values once, per row the index of its
        value in each. A row over ``max_bytes`` (its values' bytes summed), or more bytes announced
        than that allows, raises ``WireFormatError`` naming the rank, allocating nothing; a rank in
        another exchange raises ``CollectiveDesyncError`` naming it (``name``: group rank -> global)."""
        if columns < 1 or (row is not None and len(row) != columns):
            raise ValueError(f"a row of {columns} columns, given {None if row is None else len(row)}")
        if row is not None and sum(map(len, row)) > max_bytes:
            raise WireFormatError(
                f"{describe()}: this rank's row is {sum(map(len, row))} bytes, over the limit of {max_bytes} bytes "
                "(COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES)",
                ranks=(name(self.index),),
            )
        table = Table(columns, self.size) if row is None else Table.of_row(self.index, row, self.size)
        _, held = self._run(pg, TABLE, stamp, [], table, max_bytes, describe, name)
        assert isinstance(held, Table)
        held.sort()
        return held

    def meet(
        self,
        pg: dist.ProcessGroup,
        peers: Sequence[int],
        stamp: int,
        describe: Callable[[], str],
        name: Callable[[int], int] = _same,
    ) -> None:
        """One record with each of ``peers`` (group ranks, each of which meets this rank under the
        same ``stamp``), both ways, on the records' tag: for a caller's exchange with them on tags
        of its own, first. A peer in a MIN, a gather or another meeting raises
        ``CollectiveDesyncError`` here, naming it, and it raises too, naming this rank's meeting
        (its phase in ``phases`` names it), instead of both waiting for the group's timeout."""
        op = Exchange(self, pg, MEET, stamp, 0, describe, name, list(dict.fromkeys(peers)))
        sliced(op.run, describe, op.works)

    def _run(
        self,
        pg: dist.ProcessGroup,
        kind: int,
        stamp: int,
        values: Sequence[int],
        held: bytes | Table | None,
        max_bytes: int,
        describe: Callable[[], str],
        name: Callable[[int], int],
    ) -> tuple[list[int], dict[int, bytes] | Table]:
        op = Exchange(self, pg, kind, stamp, max_bytes, describe, name)
        op.values[: len(values)] = torch.tensor(list(values), dtype=torch.int64)
        if isinstance(held, Table):
            op.table = held
        elif held is not None:
            op.entries[self.index] = held
        return sliced(op.run, describe, op.works)
