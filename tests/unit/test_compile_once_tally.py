"""Compile once's counters from its records, without processes: a graph whose compile ends
without an exchange (its driver's own end) is one record of ``stats()["compile_once"]`` and
counts once in the counter of how it ended, or in none when its compile raised; every way the
machine can end a graph is one the ledger counts, and one it cannot count is an error, never a
silent zero. (The multi-process tests, ``test_compile_once*.py``, read the same counters for
graphs that were compiled, served, loaded, missed and refused.)"""

from __future__ import annotations

from typing import Any

import pytest

import compiler_collectives as cc
from compiler_collectives.agreements import once
from compiler_collectives.agreements.once import tally
from compiler_collectives.ledger import ONCE_ENDED, Ledger
from compiler_collectives.observations import FrameId
from compiler_collectives.records import OnceGraph
from tests.fixtures import NoCache

OUTCOME_COUNTERS = ("once_compiled", "once_served", "once_local", "once_loaded", "once_load_misses", "once_refused")


def changed_counters(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The counters of ``stats()`` that moved, and by how much (the records are left out)."""
    return {k: after[k] - before[k] for k in OUTCOME_COUNTERS + ("once_peer_local_compiles",) if after[k] != before[k]}


@pytest.mark.parametrize(
    ("role", "load", "raised"),
    [(role, "none", raised) for role in (once.COMPILE, once.SERVE, once.LOCAL) for raised in (False, True)]
    + [(once.LOAD, load, False) for load in ("hit", "miss", "refused", "none")],
)
@pytest.mark.parametrize("failed", [False, True])
def test_every_role_and_load_ends_in_a_way_the_ledger_counts(role: str, load: str, raised: bool, failed: bool) -> None:
    Ledger().add(OnceGraph(tally.ended(role, load, raised, failed), 0, {}))  # raises on a way the ledger lacks


def test_a_way_to_end_the_ledger_lacks_raises_instead_of_counting_nothing() -> None:
    assert "half loaded" not in ONCE_ENDED
    with pytest.raises(KeyError):
        Ledger().add(OnceGraph("half loaded", 0, {}))


def test_a_compile_that_never_looked_its_graph_up_is_one_record_and_counts_once_as_local() -> None:
    cc.reset_stats()
    before = cc.stats()
    once.begin(FrameId("f", "a.py", 1), NoCache()).compile_ended(None)
    after = cc.stats()
    (record,) = after["compile_once"]
    assert record["state"] == "compiled locally" and record["ended"] == "local"
    assert changed_counters(before, after) == {"once_local": 1}


def test_a_graph_whose_own_compile_raised_is_recorded_as_raised_and_counts_in_no_outcome() -> None:
    cc.reset_stats()
    before = cc.stats()
    once.begin(FrameId("f", "a.py", 1), NoCache()).compile_ended("ValueError: the backend failed")
    after = cc.stats()
    (record,) = after["compile_once"]
    assert record["ended"] == "raised"
    assert changed_counters(before, after) == {}


def test_each_graph_is_one_record_and_reset_stats_forgets_them_with_their_counts() -> None:
    cc.reset_stats()
    for line in (1, 2, 3):
        once.begin(FrameId("f", "a.py", line), NoCache()).compile_ended(None)
    stats = cc.stats()
    assert [r["frame"] for r in stats["compile_once"]] == [str(FrameId("f", "a.py", n)) for n in (1, 2, 3)]
    assert stats["once_local"] == 3
    cc.reset_stats()
    assert cc.stats()["compile_once"] == [] and cc.stats()["once_local"] == 0


def test_a_record_read_from_stats_is_a_copy_the_reader_cannot_change_the_ledger_through() -> None:
    cc.reset_stats()
    once.begin(FrameId("f", "a.py", 1), NoCache()).compile_ended(None)
    cc.stats()["compile_once"][0]["state"] = "loaded"
    assert cc.stats()["compile_once"][0]["state"] == "compiled locally"
