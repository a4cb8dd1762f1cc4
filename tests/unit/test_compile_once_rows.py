"""Compile once's offers and load outcomes as rows of a table (``wire.once.encode_row``,
``decode_rows``; ``agreements/once/rows.py`` gathers them over the host tree), without processes:
the table is folded here as the tree's leaders fold it.

Every rank reads back the offers each rank sent, so ``decide`` makes the plans the payload of each
offer gives (the gather before the tables); a bad value is refused naming a rank that sent it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler_collectives.agreements import once
from compiler_collectives.agreements.wire.codec import pack
from compiler_collectives.agreements.wire.once import (
    ONCE_FORMAT_VERSION,
    WARMTH_FX,
    Loaded,
    Offer,
    decode_once,
    decode_rows,
    encode_once,
    encode_row,
    row_columns,
)
from compiler_collectives.errors import SetupMismatchError, WireFormatError
from compiler_collectives.transport import Table

SEQ, LIMIT = 5, 1 << 20


def through_table(bodies: dict[int, Offer | Loaded], world: int, kind: str = "keys", rows=None) -> dict:
    """Every body, as a rank reads it back from the table the tree's folds leave."""
    tables = [
        Table.of_row(r, rows[r] if rows else encode_row(world_size=world, seq=SEQ, body=b), world)
        for r, b in bodies.items()
    ]
    whole = tables[0]
    for t in tables[1:]:
        whole.fold(Table.unpack(memoryview(t.pack()), 1, t.columns, world, LIMIT, ValueError), ValueError, int)
    whole = Table.unpack(memoryview(whole.pack()), len(whole), whole.columns, world, LIMIT, ValueError)
    whole.sort()
    columns = [whole.column(c) for c in range(whole.columns)]
    return dict(zip(whole.ranks(), decode_rows(columns, whole.ranks(), kind=kind, seq=SEQ, world_size=world)))


def through_payloads(bodies: dict[int, Offer], world: int) -> dict[int, Offer]:
    """Every offer, as the gather of each rank's payload read it back."""
    out = {}
    for r, b in bodies.items():
        got = decode_once(encode_once(rank=r, world_size=world, seq=SEQ, body=b), sender=r, max_bytes=LIMIT).body
        assert isinstance(got, Offer)
        out[r] = got
    return out


offers = st.builds(
    Offer,
    key=st.sampled_from([None, "k0", "k1", "k2"]),
    why=st.sampled_from([None, "not cacheable: a graph break", "x" * 5000]),
    holds=st.booleans(),
    dir=st.sampled_from(["host0:1:1", "host1:1:1", "host2:7:9"]),
    switches=st.sampled_from([[], ["_sync_decision_cross_ranks"]]),
    max_artifact_bytes=st.sampled_from([1, 1 << 30]),
    graph=st.sampled_from(["", "g" * 64, "h" * 200]),
    warmth=st.sampled_from([0, 3, 17, WARMTH_FX]),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(offers, min_size=1, max_size=24), st.integers(1, 4))
def test_every_rank_reads_back_the_offers_and_plans_that_the_payloads_give(sent, seq):
    bodies = dict(enumerate(sent))
    got, before = through_table(bodies, len(sent)), through_payloads(bodies, len(sent))
    assert got == before  # texts cut as the payload cuts them
    try:
        expected = once.decide(before, seq)
    except SetupMismatchError as e:
        with pytest.raises(SetupMismatchError) as raised:
            once.decide(got, seq)
        assert str(raised.value) == str(e)
        return
    assert once.decide(got, seq) == expected


def test_the_outcomes_of_the_ranks_that_did_not_load_are_read_back():
    bodies = {3: Loaded("miss", "the entry's guards fail this rank's size hints"), 7: Loaded("refused", None)}
    assert through_table(bodies, 8, kind="loaded") == bodies


def test_every_field_of_an_offer_travels():
    base = Offer("k", None, False, "d", [], 1, "", 0)
    changed = Offer("k2", "why", True, "d2", ["s"], 2, "g", WARMTH_FX)
    for field in dataclasses.fields(Offer):
        one = dataclasses.replace(base, **{field.name: getattr(changed, field.name)})
        assert through_table({0: base, 1: one}, 2) == {0: base, 1: one}, field.name
    assert row_columns("keys") == 1 + len(dataclasses.fields(Offer))


def test_a_bad_value_is_refused_naming_the_first_rank_that_sent_it():
    good = Offer("k", None, False, "d", [], 1 << 30, "", 0)
    rows = {r: encode_row(world_size=4, seq=SEQ, body=good) for r in range(4)}
    for r in (2, 3):
        rows[r][1] = pack("k" * 300)  # the key column: longer than a key may be
    with pytest.raises(WireFormatError, match="from rank 2: key must be nil or a short string"):
        through_table(dict.fromkeys(range(4), good), 4, rows=rows)
    rows[2][4] = pack("d") + pack("d")  # the dir column: two values where one belongs
    with pytest.raises(WireFormatError, match="from rank 2"):
        through_table(dict.fromkeys(range(4), good), 4, rows=rows)


def test_a_row_of_another_format_version_is_refused_naming_its_version_and_sender():
    good = Offer("k", None, False, "d", [], 1 << 30, "", 0)
    rows = {r: encode_row(world_size=2, seq=SEQ, body=good) for r in range(2)}
    rows[1][0] = pack([ONCE_FORMAT_VERSION - 1, "compile_once", "keys", 2, SEQ])
    with pytest.raises(WireFormatError, match=f"from rank 1.*version {ONCE_FORMAT_VERSION - 1}"):
        through_table(dict.fromkeys(range(2), good), 2, rows=rows)


def test_a_row_of_another_graph_is_refused():
    good = Offer("k", None, False, "d", [], 1 << 30, "", 0)
    rows = {0: encode_row(world_size=2, seq=SEQ, body=good), 1: encode_row(world_size=2, seq=SEQ + 1, body=good)}
    with pytest.raises(WireFormatError, match=f"from rank 1.*graph #{SEQ + 1}"):
        through_table(dict.fromkeys(range(2), good), 2, rows=rows)
