"""The host tree's table (``transport/table.py``) without processes: rows folded as the leaders
fold them (in any grouping, each table packed and unpacked as it would travel), and the checks on
a table a peer sent. ``tests/ranks/test_hosttree.py`` takes the table gather on real gloo ranks."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler_collectives.errors import WireFormatError
from compiler_collectives.transport import Table

SIZE = 160
LIMIT = 1 << 10


def refuse(what: str) -> WireFormatError:
    return WireFormatError(f"the peer {what}")


def travel(table: Table) -> Table:
    """``table`` as the peer that receives it reads it."""
    return Table.unpack(memoryview(table.pack()), len(table), table.columns, SIZE, LIMIT, refuse)


def contents(table: Table) -> dict[int, list[bytes]]:
    table.sort()
    columns = [table.column(c) for c in range(table.columns)]
    return {r: [values[index[k]] for values, index in columns] for k, r in enumerate(table.ranks())}


values = st.sampled_from([b"", b"a", b"b", b"key " * 20, bytes(range(256))])


def some_table(least: int) -> st.SearchStrategy[dict[int, list[bytes]]]:
    row = st.lists(values, min_size=3, max_size=3)
    return st.dictionaries(st.integers(0, SIZE - 1), row, min_size=least, max_size=least + 40)


# A small job's tables stay Python lists (``table._LOOSE``, 64 rows); a bigger one's rows move
# into tensors as they fold past it: both, and every mix of the two, give the same rows.
@pytest.mark.parametrize("least", [1, 60])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_folding_rows_in_any_grouping_gives_every_row_and_each_distinct_value_once(least, data):
    rows = data.draw(some_table(least))
    tables = [Table.of_row(r, row, SIZE) for r, row in rows.items()]
    while len(tables) > 1:  # a random tree of folds; every table travels before it is folded in
        i = data.draw(st.integers(0, len(tables) - 2))
        into, other = tables[i], tables.pop(i + 1)
        into.fold(travel(other), refuse, lambda r: r)
        tables[i] = travel(into) if data.draw(st.booleans()) else into
    (whole,) = tables
    assert contents(whole) == rows
    for c in range(3):
        assert sorted(whole.column(c)[0]) == sorted({row[c] for row in rows.values()})


def test_an_empty_table_travels_and_folds_as_nothing():
    table = Table.of_row(3, [b"x", b"y"], SIZE)
    table.fold(travel(Table(2, SIZE)), refuse, lambda r: r)
    assert contents(table) == {3: [b"x", b"y"]}
    assert contents(travel(Table(2, SIZE))) == {}


def test_a_row_of_a_rank_already_held_is_refused_naming_it():
    table = Table.of_row(3, [b"x"], SIZE)
    with pytest.raises(WireFormatError, match="rank 103's row, which this rank already holds"):
        table.fold(travel(Table.of_row(3, [b"y"], SIZE)), refuse, lambda r: r + 100)


def some_rows(n: int) -> Table:
    """Ranks 1..n: column 0 holds two values, column 1 one."""
    table = Table.of_row(1, [b"x1", b"same"], SIZE)
    for r in range(2, n + 1):
        table.fold(Table.of_row(r, [b"x%d" % (r % 2), b"same"], SIZE), refuse, lambda r: r)
    return table


# The packed layout: int64 rows, columns, distinct values per column (2, 1), their lengths (2, 2,
# 4); then int32 per row: rank, index, index; then the values.
ROWS_AT = 8 * (2 + 2 + 3)


def int32_at(data: bytearray, i: int, value: int) -> bytearray:
    data[ROWS_AT + 4 * i : ROWS_AT + 4 * i + 4] = value.to_bytes(4, "little", signed=True)
    return data


@pytest.mark.parametrize("n", [2, 12, 100])  # a host's few rows, a small job's table, a big one's (tensors)
@pytest.mark.parametrize(
    ("spoil", "says"),
    [
        (lambda d: int32_at(d, 0, SIZE), "ranks outside the group"),
        (lambda d: int32_at(d, 3, 1), "or one twice"),  # row 1 names rank 1 again
        (lambda d: int32_at(d, 1, 2), "values it did not send"),  # column 0 has two values
        (lambda d: int32_at(d, 2, -1), "values it did not send"),
        (lambda d: d[:-1], "do not add up"),
        (lambda d: d + b"!", "do not add up"),
        (lambda d: d[:20], "shorter than its header"),
    ],
)
def test_a_table_naming_what_it_does_not_hold_is_refused(n, spoil, says):
    data = bytearray(some_rows(n).pack())
    assert int.from_bytes(data[ROWS_AT : ROWS_AT + 4], "little") == 1  # the layout above
    assert len(Table.unpack(memoryview(bytes(data)), n, 2, SIZE, LIMIT, refuse)) == n
    with pytest.raises(WireFormatError, match=says):
        Table.unpack(memoryview(bytes(spoil(data))), n, 2, SIZE, LIMIT, refuse)


def test_a_table_of_other_rows_or_columns_than_announced_is_refused():
    data = memoryview(some_rows(2).pack())
    with pytest.raises(WireFormatError, match="announced 3 of 2"):
        Table.unpack(data, 3, 2, SIZE, LIMIT, refuse)
    with pytest.raises(WireFormatError, match="announced 2 of 3"):
        Table.unpack(data, 2, 3, SIZE, LIMIT, refuse)


def test_a_value_over_the_limit_is_refused():
    table = Table.of_row(1, [b"x" * (LIMIT + 1)], SIZE)
    with pytest.raises(WireFormatError, match="over the limit"):
        Table.unpack(memoryview(table.pack()), 1, 1, SIZE, LIMIT, refuse)
