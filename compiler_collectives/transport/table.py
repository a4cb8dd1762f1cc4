"""A table: rows of byte strings by group rank, each column's distinct values held once; what the
host tree's table gather (``HostTree.gather_table``) folds on its way up and hands every rank.

A gather of one payload per rank (``HostTree.gather``) ends with every payload on every rank, and
a rank that then decodes them decodes the world, however alike they are (compile once's offers
at 8,192 ranks: 8 keys and 1,024 cache dirs among 8,192 offers). A table cuts each rank's row into
columns (the caller's fields, each its own bytes); a leader folds the rows it takes into its own
table, keeping each column's distinct values once and, per row, the index of its value in each
column. So what travels, and what a rank decodes, is each distinct value once and a few int32 per
row (int32 columns folded as tensors: no Python loop per row).

A packed table (native byte order, as the tree's records; sections in this order keep each
aligned to its own width)::

    int64  R rows, C columns, then for each column its count of distinct values V_c
    int64  the length of each distinct value, column by column
    int32  R x (1 + C): per row its group rank, then the index of its value in each column
    bytes  the distinct values, column by column

``unpack`` checks every count, length, rank and index against the table's bounds before it is
used: a peer's table can name no rank outside the group, no rank twice, no value it did not send,
and no value over the caller's limit (each rank checks its own row's: ``HostTree.gather_table``).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable, Sequence

import torch

from .gloo import tensor_view

_HEAD = 2  # int64: rows, columns
# A table of at most this many rows is folded, sorted, packed and read as Python lists, without
# a tensor operation: a small job's first gather in a process would otherwise pay torch's first
# calls of each operation (10-25 ms along the tree's path at 4 ranks, issue 43), more than the
# rows' Python costs (a few microseconds a row).
_LOOSE = 64
Refuse = Callable[[str], Exception]  # the exchange's error for what a peer sent, naming that peer


class Table:
    """Rows of ``columns`` byte strings, at most one per group rank of a group of ``size``."""

    def __init__(self, columns: int, size: int) -> None:
        self.columns, self.size = columns, size
        self.values: list[list[bytes]] = [[] for _ in range(columns)]  # per column, its distinct values
        self._at: list[dict[bytes, int]] = [{} for _ in range(columns)]  # per column: value -> its index
        self._held: set[int] | None = set()  # the group ranks of the rows (None: not gathered yet)
        # The rows (group rank, then an index per column), in parts: tensors, and rows folded one by
        # one as lists (a tensor operation costs microseconds however small, and its first call in a
        # process far more: see _LOOSE); ``rows`` joins them.
        self._parts: list[torch.Tensor] = []
        self._loose: list[list[int]] = []

    @classmethod
    def of_row(cls, rank: int, row: Sequence[bytes], size: int) -> Table:
        """The table of one row: group rank ``rank``'s."""
        table = cls(len(row), size)
        table._held = {rank}
        table._loose.append([rank, *(table._add(c, v) for c, v in enumerate(row))])
        return table

    def __len__(self) -> int:
        return sum(int(p.shape[0]) for p in self._parts) + len(self._loose)

    def held(self) -> set[int]:
        """The group ranks of the rows."""
        if self._held is None:
            self._held = set(self._field(0))
        return self._held

    def _lists(self) -> list[list[int]] | None:
        """The rows as lists (group rank, then an index per column) while no tensor holds any of
        them; None once one does."""
        return None if self._parts else self._loose

    def _field(self, j: int) -> list[int]:
        """Field ``j`` of every row (0: the group rank; 1 + c: column c's index), in row order."""
        lists = self._lists()
        out: list[int] = [row[j] for row in lists] if lists is not None else self.rows[:, j].tolist()
        return out

    @property
    def rows(self) -> torch.Tensor:
        """The rows, an int32 tensor of ``len(self)`` x (1 + columns)."""
        if self._loose:
            self._parts.append(torch.tensor(self._loose, dtype=torch.int32).reshape(-1, 1 + self.columns))
            self._loose = []
        if len(self._parts) != 1:
            self._parts = [
                torch.cat(self._parts) if self._parts else torch.empty((0, 1 + self.columns), dtype=torch.int32)
            ]
        return self._parts[0]

    def _add(self, column: int, value: bytes) -> int:
        at = self._at[column]
        i = at.get(value)
        if i is None:
            i = at[value] = len(self.values[column])
            self.values[column].append(value)
        return i

    @staticmethod
    def bound(rows: int, columns: int, max_bytes: int) -> int:
        """The most bytes a packed table of ``rows`` rows may take, each row at most ``max_bytes``:
        a column has at most a value per row, and each value is in some row."""
        return 8 * (_HEAD + columns) + rows * (8 * columns + 4 * (1 + columns) + max_bytes)

    def fold(self, other: Table, refuse: Refuse, name: Callable[[int], int]) -> None:
        """Add ``other``'s rows (none of them this table's ranks), each value kept once."""
        if not len(other):
            return
        held, theirs = self.held(), other.held()
        if not held.isdisjoint(theirs):
            raise refuse(f"sent rank {name(min(held & theirs))}'s row, which this rank already holds")
        held |= theirs
        remap = [self._add(c, v) for c in range(self.columns) for v in other.values[c]]
        if len(other) <= _LOOSE:
            starts = list(itertools.accumulate((len(v) for v in other.values), initial=0))
            theirs_rows = other._lists()
            for rank, *index in theirs_rows if theirs_rows is not None else other.rows.tolist():
                self._loose.append([rank, *(remap[k + i] for k, i in zip(starts, index))])
            return
        # One gather maps every column's indices into this table's: column c's at its offset.
        offsets = torch.tensor([0, *(len(v) for v in other.values[:-1])], dtype=torch.int64).cumsum(0)
        moved = other.rows.clone()
        moved[:, 1:] = torch.tensor(remap, dtype=torch.int32)[other.rows[:, 1:].long() + offsets]
        self._parts.append(moved)

    def row_of(self, rank: int) -> list[bytes] | None:
        """Group rank ``rank``'s row, or None."""
        lists = self._lists()
        if lists is not None:
            row = next((r for r in lists if r[0] == rank), None)
            return None if row is None else [self.values[c][i] for c, i in enumerate(row[1:])]
        found = (self.rows[:, 0] == rank).nonzero()
        if not len(found):
            return None
        index = self.rows[int(found[0]), 1:].tolist()
        return [self.values[c][i] for c, i in enumerate(index)]

    def sort(self) -> None:
        """Rows in group rank order (whatever order the folds left them in)."""
        lists = self._lists()
        if lists is not None:
            lists.sort()
            return
        rows = self.rows
        if len(rows) > 1 and not bool((rows[1:, 0] > rows[:-1, 0]).all()):  # a leader sorted it already
            self._parts = [rows[torch.argsort(rows[:, 0])]]

    def ranks(self) -> list[int]:
        """The group rank of each row, in row order."""
        return self._field(0)

    def column(self, c: int) -> tuple[list[bytes], list[int]]:
        """Column ``c``: its distinct values, and per row (in row order) the index of its value."""
        values = self.values[c]
        if len(values) == 1:
            return values, [0] * len(self)
        return values, self._field(1 + c)

    def pack(self) -> bytes:
        """The table's bytes (the layout above)."""
        counts = [len(v) for v in self.values]
        head = array("q", [len(self), self.columns, *counts])
        head.extend(len(v) for col in self.values for v in col)
        lists = self._lists()
        if lists is not None:
            packed = array("i", [i for row in lists for i in row]).tobytes()
        else:
            packed = bytes(tensor_view(self.rows.contiguous().view(torch.uint8).reshape(-1)))
        return b"".join([head.tobytes(), packed, *(v for col in self.values for v in col)])

    @classmethod
    def unpack(cls, data: memoryview, rows: int, columns: int, size: int, max_bytes: int, refuse: Refuse) -> Table:
        """The table a peer packed: ``rows`` rows (as its record announced) of ``columns`` columns,
        each value at most ``max_bytes``, every rank in a group of ``size``; checked throughout."""
        fixed = 8 * (_HEAD + columns)
        if len(data) < fixed:
            raise refuse(f"sent a table of {len(data)} bytes, shorter than its header")
        head = array("q")
        head.frombytes(bytes(data[:fixed]))
        if head[0] != rows or head[1] != columns:
            raise refuse(f"sent a table of {head[0]} rows of {head[1]} columns, announced {rows} of {columns}")
        counts, least = list(head[_HEAD:]), 1 if rows else 0  # a row has a value in every column
        if any(not least <= v <= rows for v in counts):
            raise refuse(f"sent a table whose columns hold {counts} distinct values for {rows} rows")
        at = fixed + 8 * sum(counts)
        body = at + 4 * rows * (1 + columns)
        if len(data) < body:
            raise refuse(f"sent a table of {len(data)} bytes, shorter than its {rows} rows")
        lengths = array("q")
        lengths.frombytes(bytes(data[fixed:at]))
        if (lengths and (min(lengths) < 0 or max(lengths) > max_bytes)) or body + sum(lengths) != len(data):
            raise refuse(f"sent a table whose values do not add up to its {len(data)} bytes, or one over the limit")
        table = cls(columns, size)
        ends = list(itertools.accumulate(lengths, initial=0))
        blob = bytes(data[body:])
        values = [blob[a:b] for a, b in itertools.pairwise(ends)]
        for c, (first, count) in enumerate(zip(itertools.accumulate(counts, initial=0), counts)):
            table.values[c] = values[first : first + count]
            table._at[c] = dict(zip(table.values[c], range(count)))
        if not rows:
            return table
        if rows <= _LOOSE:  # a small table's rows: checked as Python ints, not tensors
            flat = array("i")
            flat.frombytes(bytes(data[at:body]))
            loose = [list(flat[k : k + 1 + columns]) for k in range(0, len(flat), 1 + columns)]
            ranks = {row[0] for row in loose}
            if len(ranks) != rows or not all(0 <= r < size for r in ranks):
                raise refuse(f"sent a table whose rows name ranks outside the group of {size}, or one twice")
            if not all(0 <= i < v for row in loose for i, v in zip(row[1:], counts)):
                raise refuse("sent a table whose rows name values it did not send")
            table._loose, table._held = loose, ranks
            return table
        got = torch.frombuffer(bytearray(data[at:body]), dtype=torch.int32).reshape(rows, 1 + columns)
        owners = got[:, 0]
        if int(owners.min()) < 0 or int(owners.max()) >= size or int(torch.bincount(owners).max()) > 1:
            raise refuse(f"sent a table whose rows name ranks outside the group of {size}, or one twice")
        low, high = torch.aminmax(got[:, 1:], dim=0)
        if int(low.min()) < 0 or any(h >= v for h, v in zip(high.tolist(), counts)):
            raise refuse("sent a table whose rows name values it did not send")
        table._parts, table._held = [got], None
        return table
