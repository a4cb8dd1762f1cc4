"""Compile once's counters from its records, without processes: each graph's record adds one to the
counter of how the graph ended on this rank (``once.tally``), and a way to end that nobody counts
is an error, never a silent zero. The last tests take a graph through the protocol's own
``finish`` where it needs no exchange, and read ``stats()``'s counters and the records."""

from __future__ import annotations

import pytest

from compiler_collectives.agreements import once
from compiler_collectives.agreements.once import tally
from compiler_collectives.observations import FrameId
from compiler_collectives.stats import counters

COUNTED = {
    "compiled": "once_compiled",
    "served": "once_served",
    "local": "once_local",
    "loaded": "once_loaded",
    "miss": "once_load_misses",
    "refused": "once_refused",
}
OUTCOME_COUNTERS = sorted(COUNTED.values())


class NoCache:
    """A ``Cache`` the tests never reach: a graph that needs no exchange touches no cache."""

    def root(self) -> str:
        raise AssertionError("not reached")

    def aot_dir(self, key: str) -> str:
        raise AssertionError("not reached")

    def fx_dir(self, key: str) -> str:
        raise AssertionError("not reached")


def outcome_counts() -> dict[str, int]:
    return {name: getattr(counters, name) for name in OUTCOME_COUNTERS}


@pytest.mark.parametrize("ended", sorted(COUNTED))
def test_each_way_a_graph_ends_adds_one_to_its_own_counter(ended: str) -> None:
    assert tally.counts({"ended": ended}) == {COUNTED[ended]: 1}


@pytest.mark.parametrize("ended", ["raised", "source raised"])
def test_a_graph_whose_compile_raised_counts_in_no_outcome_counter(ended: str) -> None:
    assert tally.counts({"ended": ended}) == {}


def test_a_way_to_end_the_table_lacks_raises_instead_of_counting_nothing() -> None:
    with pytest.raises(KeyError):
        tally.counts({"ended": "half loaded"})


@pytest.mark.parametrize(
    ("role", "load", "raised"),
    [(role, "none", raised) for role in (once.COMPILE, once.SERVE, once.LOCAL) for raised in (False, True)]
    + [(once.LOAD, load, False) for load in ("hit", "miss", "refused", "none")],
)
def test_every_role_and_load_ends_in_a_way_the_table_has(role: str, load: str, raised: bool) -> None:
    assert tally.ended(role, load, raised) in tally.COUNTED


def test_adding_a_record_bumps_its_counter_and_no_other() -> None:
    before = outcome_counts()
    tally.add({"ended": "refused"})
    after = outcome_counts()
    assert {k: after[k] - before[k] for k in after} == {k: int(k == "once_refused") for k in after}


def test_the_other_ranks_a_load_report_named_count_as_peers_that_compiled_it_themselves() -> None:
    assert tally.counts({"ended": "loaded", "peers_local": [3, 5]}) == {
        "once_loaded": 1,
        "once_peer_local_compiles": 2,
    }


def test_a_compile_that_never_looked_its_graph_up_is_recorded_and_counted_as_local() -> None:
    once.clear_records()
    before = outcome_counts()
    ticket = once.begin(FrameId("f", "a.py", 1), NoCache())
    ticket.rank = 0  # no group here: the graph's trace artifact names this rank
    once.finish(ticket, None)
    (record,) = once.records()
    assert record["state"] == "compiled locally" and record["ended"] == "local"
    after = outcome_counts()
    assert {k: after[k] - before[k] for k in after} == {k: int(k == "once_local") for k in after}


def test_a_graph_whose_own_compile_raised_is_recorded_as_raised_and_counted_nowhere() -> None:
    once.clear_records()
    before = outcome_counts()
    ticket = once.begin(FrameId("f", "a.py", 1), NoCache())
    # Planned to compile alone, with no rank serving: its end takes no exchange.
    ticket.plan = once.Plan(once.LOCAL, None, "keys differ", False)
    ticket.plans = {0: ticket.plan}
    ticket.step, ticket.rank = once.Step.PLANNED, 0
    once.finish(ticket, ValueError("the backend failed"))
    (record,) = once.records()
    assert record["ended"] == "raised"
    assert outcome_counts() == before
