"""One exchange over a ``HostTree`` (``hosttree.py``) on this rank: its records, the gloo operations
it starts and waits for, and how it names a peer found in another exchange.

Every message starts with a record of one fixed width (``HEAD`` int64s, then the MIN's values) on
one tag: the operation (``MIN``, ``GATHER``, ``TABLE``, ``MEET``), the stamp, for a gather the
entries or rows that follow on another tag, and in a notice who was found where. A record of
another operation or stamp raises ``CollectiveDesyncError`` naming both exchanges, and this rank
tells its peers (a notice) so that they raise too. ``hosttree`` says what each operation does.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from ..errors import CollectiveDesyncError, WireFormatError
from .gloo import Phases, started, tensor_view
from .hierarchy import doubling_plan
from .p2p import TAG_BASE, Background, done
from .table import Table

if TYPE_CHECKING:
    from .hosttree import HostTree

# Tags of these operations: ``p2p.TAG_BASE``'s. Every operation's records share one tag, whatever
# the operation: see ``hosttree``'s docstring.
_RECORD, _ENTRIES = TAG_BASE | 1, TAG_BASE | 2
NEUTRAL = (1 << 63) - 1
"""A record element nobody set: MIN's identity."""

MIN, GATHER, TABLE, MEET = 1, 2, 3, 4
_NOTICE = 1 << 8  # in a record's kind: the sender stopped the exchange (see the culprit's fields)
_OPS = {MIN: "the MIN of ", GATHER: "the gather of ", TABLE: "the table gather of ", MEET: ""}  # a meeting: its phase
# A record's header (int64s), before the MIN's values: the operation and stamp; the entries that
# follow (a gather's) and their bytes; in a notice, the rank found in another exchange and what
# it is in, and the rank that found it and what that one is in (each rank + 1; 0: none).
_KIND, _STAMP, _COUNT, _BYTES, _CULPRIT, _CULPRIT_KIND, _CULPRIT_STAMP, _FINDER, _FINDER_KIND, _FINDER_STAMP = range(10)
HEAD = 10
NOTICE_GRACE_S = 2.0  # how long a rank that stops an exchange waits for its notices to be taken
ENTRY_HEAD = 16  # per entry in a gather's bytes: its group rank and its length, int64 each
_ADVICE = "Every rank of the group must take the same exchanges in the same order."  # unless the caller's


@dataclasses.dataclass(frozen=True)
class _Mismatch:
    """A record from a peer in another exchange, or a notice of one (``told_by``: from whom): the
    rank found in another exchange (the culprit), the rank that found it, and what each is in."""

    told_by: int | None
    culprit: int
    ckind: int
    cstamp: int
    finder: int
    fkind: int
    fstamp: int


def _what(phases: Phases, kind: int, stamp: int) -> str:
    op = _OPS.get(kind & ~_NOTICE, f"the operation {kind & ~_NOTICE} of ")
    phase = stamp >> 32
    return f"{op}{phases.names.get(phase, f'phase {phase}')} #{stamp & 0xFFFFFFFF}"


class Exchange:
    """One MIN or gather on this rank: what it holds, and every gloo operation it started (kept
    until each ends: a helper thread waits for them after a failure)."""

    def __init__(
        self,
        tree: HostTree,
        pg: dist.ProcessGroup,
        kind: int,
        stamp: int,
        max_bytes: int,
        describe: Callable[[], str],
        name: Callable[[int], int],
        met: list[int] | None = None,
    ) -> None:
        self.tree, self.pg, self.kind, self.stamp = tree, pg, kind, stamp
        self.max_bytes, self.describe, self.name = max_bytes, describe, name
        self.values = torch.full((tree.width,), NEUTRAL, dtype=torch.int64)
        self.entries: dict[int, bytes] = {}  # a gather's
        self.table = Table(1, tree.size)  # a table gather's
        self.works: list[Any] = []
        # A meeting's peers are the caller's; each waits for this rank's record.
        self.peers, self.owed = self._peers() if met is None else (met, set(met))
        self.waiting = frozenset(self.owed)  # the peers that wait for a record from this rank
        self.first_sent: dict[int, Any] = {}  # peer -> the send of this rank's first record to it
        self.mismatch: _Mismatch | None = None

    def run(self) -> tuple[list[int], dict[int, bytes] | Table]:
        try:
            self._steps()
        except CollectiveDesyncError:
            if self.mismatch is not None:
                self._tell(self.mismatch)
            raise
        return [int(v) for v in self.values.tolist()], self.table if self.kind == TABLE else self.entries

    def _steps(self) -> None:
        if self.kind == MEET:
            sent = [w for peer in self.peers for w in self._send(peer, self._pack())]
            for peer in self.peers:
                self._take(peer, self._receive(peer), fold=True)
            for work in sent:
                done(work)
            return
        tree = self.tree
        local = tree.hosts[tree.host]
        leader = local[0]
        if tree.index != leader:
            self._send(leader, self._pack())
            self._take(leader, self._receive(leader), fold=False)
            return
        pending = [(peer, self._receive(peer)) for peer in local[1:]]
        for peer, work in pending:
            self._take(peer, work, fold=True)
        leaders = [h[0] for h in tree.hosts]
        for op, peer, _ in doubling_plan(tree.host, len(tree.hosts)):
            # Partners meet once per direction in one exchange: the record's tag needs no step.
            dst = leaders[peer]
            sent = self._send(dst, self._pack()) if op in ("give", "tell", "swap") else []
            if op in ("fold", "take", "swap"):
                self._take(dst, self._receive(dst), fold=op != "take")
            for work in sent:
                done(work)
        if self.kind == TABLE:
            self.table.sort()  # once here, not on each of the host's ranks
        packed = self._pack()
        sent = [w for peer in local[1:] for w in self._send(peer, packed)]
        for work in sent:
            done(work)

    def _peers(self) -> tuple[list[int], set[int]]:
        """This rank's peers in the exchange, and those of them that wait for a record from it."""
        tree = self.tree
        local = tree.hosts[tree.host]
        if tree.index != local[0]:
            return [local[0]], {local[0]}
        leaders = [h[0] for h in tree.hosts]
        plan = doubling_plan(tree.host, len(tree.hosts))
        partners = [leaders[peer] for _, peer, _ in plan]
        told = [leaders[peer] for op, peer, _ in plan if op in ("give", "tell", "swap")]
        return list(dict.fromkeys([*local[1:], *partners])), {*local[1:], *told}

    def _pack(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        record = torch.zeros(HEAD + self.tree.width, dtype=torch.int64)
        record[_KIND], record[_STAMP] = self.kind, self.stamp
        record[HEAD:] = self.values
        if self.kind == TABLE:
            if not len(self.table):
                return record, None
            blob = bytearray(self.table.pack())
            record[_COUNT], record[_BYTES] = len(self.table), len(blob)
            return record, torch.frombuffer(blob, dtype=torch.uint8)
        if not self.entries:
            return record, None
        items = sorted(self.entries.items())
        table = array("q", [v for i, data in items for v in (i, len(data))])
        blob = bytearray(table.tobytes())
        for _, data in items:
            blob += data
        record[_COUNT], record[_BYTES] = len(items), len(blob)
        return record, torch.frombuffer(blob, dtype=torch.uint8)

    def _send(self, peer: int, packed: tuple[torch.Tensor, torch.Tensor | None]) -> list[Any]:
        record, blob = packed
        self.owed.discard(peer)
        works = [started(self.pg.send, [record], peer, _RECORD)]
        self.first_sent.setdefault(peer, works[0])
        if blob is not None:
            works.append(started(self.pg.send, [blob], peer, _ENTRIES))
        self.works.extend(works)
        return works

    def _receive(self, peer: int) -> tuple[Any, torch.Tensor]:
        record = torch.empty(HEAD + self.tree.width, dtype=torch.int64)
        work = started(self.pg.recv, [record], peer, _RECORD)
        self.works.append(work)
        return work, record

    def _take(self, peer: int, received: tuple[Any, torch.Tensor], fold: bool) -> None:
        """Fold (MIN, union) or take (replace) what ``peer`` holds into this rank's."""
        work, record = received
        done(work)
        head = [int(v) for v in record[:HEAD].tolist()]
        if head[_KIND] & _NOTICE:
            c, f = head[_CULPRIT] - 1, head[_FINDER] - 1
            self._mismatched(
                _Mismatch(
                    peer, c, head[_CULPRIT_KIND], head[_CULPRIT_STAMP], f, head[_FINDER_KIND], head[_FINDER_STAMP]
                )
            )
        if head[_KIND] != self.kind or head[_STAMP] != self.stamp:
            self._mismatched(_Mismatch(None, peer, head[_KIND], head[_STAMP], self.tree.index, self.kind, self.stamp))
        if self.kind == TABLE:
            self._take_table(peer, head[_COUNT], head[_BYTES], record, fold)
            return
        entries = self._entries(peer, head[_COUNT], head[_BYTES])
        if fold:
            torch.minimum(self.values, record[HEAD:], out=self.values)
            for i in entries:
                if i in self.entries:
                    raise self._bad(peer, f"sent rank {self.name(i)}'s entry, which this rank already holds")
            self.entries.update(entries)
            return
        mine = self.entries.get(self.tree.index)
        if mine is not None and entries.get(self.tree.index) != mine:
            raise self._bad(peer, "sent back this rank's own entry altered or not at all")
        self.values.copy_(record[HEAD:])
        self.entries = entries

    def _take_table(self, peer: int, count: int, nbytes: int, record: torch.Tensor, fold: bool) -> None:
        """``_take`` of a table gather: fold ``peer``'s rows in, or take its table (with this rank's row)."""
        limit = Table.bound(count, self.table.columns, self.max_bytes)
        blob = self._blob(peer, count, nbytes, limit, "rows")
        got = Table(self.table.columns, self.tree.size)
        if nbytes:
            data = tensor_view(blob)  # a view of ``blob``'s memory: ``blob`` stays referenced while it is read
            columns, size, refuse = self.table.columns, self.tree.size, lambda w: self._bad(peer, w)
            got = Table.unpack(data, count, columns, size, self.max_bytes, refuse)
        if fold:
            torch.minimum(self.values, record[HEAD:], out=self.values)
            self.table.fold(got, lambda w: self._bad(peer, w), self.name)
            return
        mine = self.table.row_of(self.tree.index)
        if mine is not None and got.row_of(self.tree.index) != mine:
            raise self._bad(peer, "sent back this rank's own row altered or not at all")
        self.values.copy_(record[HEAD:])
        self.table = got

    def _blob(self, peer: int, count: int, nbytes: int, limit: int, what: str) -> torch.Tensor:
        """The bytes ``peer`` announced (``count`` entries or rows in ``nbytes``), received once the
        sizes are checked against ``limit``; empty where it announced none."""
        if not 0 <= count <= self.tree.size or not 0 <= nbytes <= limit or (count == 0) != (nbytes == 0):
            raise WireFormatError(
                f"{self.describe()}: rank {self.name(peer)} announced {count} {what} in {nbytes} bytes, over the "
                f"limit of {self.max_bytes} bytes a rank (COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES) for a group of "
                f"{self.tree.size}; raise the limit on every rank if a payload is legitimately that large",
                ranks=(self.name(peer),),
            )
        blob = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            work = started(self.pg.recv, [blob], peer, _ENTRIES)
            self.works.append(work)
            done(work)
        return blob

    def _over(self, i: int, peer: int, nbytes: int, what: str) -> WireFormatError:
        return WireFormatError(
            f"{self.describe()}: rank {self.name(i)}'s {what} (passed on by rank {self.name(peer)}) is "
            f"{nbytes} bytes, over the limit of {self.max_bytes} bytes "
            "(COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES); raise the limit on every rank if it is legitimately "
            "that large",
            ranks=(self.name(i),),
        )

    def _entries(self, peer: int, count: int, nbytes: int) -> dict[int, bytes]:
        """The entries ``peer`` announced, received and checked; the sizes are checked first."""
        blob = self._blob(peer, count, nbytes, count * (ENTRY_HEAD + self.max_bytes), "entries")
        if not nbytes:
            return {}
        data = tensor_view(blob)  # a view of ``blob``'s memory: ``blob`` stays referenced while it is read
        table = array("q")
        table.frombytes(bytes(data[: count * ENTRY_HEAD]))
        out: dict[int, bytes] = {}
        at = count * ENTRY_HEAD
        for k in range(count):
            i, length = table[2 * k], table[2 * k + 1]
            if not 0 <= i < self.tree.size or i in out or not 0 <= length <= nbytes - at:
                raise self._bad(peer, f"sent a malformed set of entries (entry {k}: rank {i}, {length} bytes)")
            if length > self.max_bytes:
                raise self._over(i, peer, length, "payload")
            out[i] = bytes(data[at : at + length])
            at += length
        if at != nbytes:
            raise self._bad(peer, f"announced {nbytes} bytes of entries and sent {at}")
        return out

    def _bad(self, peer: int, what: str) -> WireFormatError:
        return WireFormatError(f"{self.describe()}: rank {self.name(peer)} {what}", ranks=(self.name(peer),))

    def _mismatched(self, m: _Mismatch) -> NoReturn:
        self.mismatch = m
        raise self._desync(m)

    def _tell(self, m: _Mismatch) -> None:
        """A notice to each peer of this exchange but the one that told this rank: those waiting
        for this rank raise at once, and tell theirs. Gloo writes a message only once its peer
        has posted the receive, and this process may end as soon as it raised: so this rank
        raises once the peers that wait for a record from it took theirs, or after
        ``NOTICE_GRACE_S`` (a thread of their own waits for those: a timed wait would close the
        group's connections). The others (a peer not waiting for this rank never takes its
        notice) are left to the helper thread.

        A peer that waits for a record from this rank and was sent one before the mismatch (a
        meeting's record, sent before it receives) gets no notice that it would take: it takes that
        record, which names this rank's exchange. This rank waits for that record's send as for a
        notice; ending at once, it would close the connection before gloo wrote it (the peer then
        gets gloo's "Connection closed by peer", not the desync)."""
        record = torch.zeros(HEAD + self.tree.width, dtype=torch.int64)
        head = [self.kind | _NOTICE, self.stamp, 0, 0, m.culprit + 1, m.ckind, m.cstamp]
        record[:HEAD] = torch.tensor([*head, m.finder + 1, m.fkind, m.fstamp], dtype=torch.int64)
        owed = [w for p, w in self.first_sent.items() if p in self.waiting and p != m.told_by]
        for peer in self.peers:
            if peer != m.told_by:
                try:
                    work = started(self.pg.send, [record], peer, _RECORD)
                except RuntimeError:  # a broken connection: that peer hears of it by other means
                    continue
                (owed if peer in self.owed else self.works).append(work)
        Background(lambda: [w.wait() for w in owed]).finished.wait(NOTICE_GRACE_S)

    def _desync(self, m: _Mismatch) -> CollectiveDesyncError:
        me, name, phases = self.tree.index, self.name, self.tree.phases
        mine = _what(phases, self.kind, self.stamp)
        ranks: tuple[int, ...]
        if m.told_by is None:  # this rank found it: the culprit is its peer
            said = f"rank {name(m.culprit)} is in {_what(phases, m.ckind, m.cstamp)} while this rank is in {mine}"
            ranks = (name(m.culprit),)
        elif m.culprit == me:  # the peer that found it told this rank
            said = f"rank {name(m.finder)} is in {_what(phases, m.fkind, m.fstamp)} while this rank is in {mine}"
            ranks = (name(m.finder),)
        else:  # passed on from further away
            said = (
                f"rank {name(m.culprit)} is in {_what(phases, m.ckind, m.cstamp)} while rank {name(m.finder)} is in "
                f"{_what(phases, m.fkind, m.fstamp)} (rank {name(m.told_by)} told this rank, which is in {mine})"
            )
            ranks = tuple(name(r) for r in dict.fromkeys((m.culprit, m.finder)) if r != me)
        return CollectiveDesyncError(
            f"{self.describe()}: {said}: the ranks are at different exchanges.\n{phases.advice or _ADVICE}", ranks=ranks
        )
