"""What our artifacts for PT2's tooling say, built from given observations without a rank (issues
12, 29): a graph compiled without an exchange says it compiled locally; the dims, ints and kinds
that differ across ranks are reported with every value and the ranks off the common one; the
restart decision says which rank recorded what differently; a forced recompile's reason names the
ranks that missed. The artifacts and logs of live ranks: ``tests/ranks/test_pt2_tooling.py``.
"""

from __future__ import annotations

from compiler_collectives.agreements import reasons as recompile_reasons
from compiler_collectives.agreements.compiler import restart_decision
from compiler_collectives.instrument import artifacts
from compiler_collectives.observations import DYNAMIC, InferStride, LocalState, SizeEntry


def test_a_graph_compiled_without_any_exchange_has_an_artifact_saying_it_compiled_locally():
    payload = artifacts.compile_once(
        rank=1,
        seq=None,
        frame="f at x.py:1",
        level="aot",
        key=None,
        state="compiled locally",
        why="AOTAutograd did not look this graph up in its cache",
        outcome="none",
        outcome_why=None,
        roles={},
        bytes_received=0,
        waited_s=0.0,
        elapsed_s=0.25,
    )
    assert (payload["role"], payload["source"], payload["state"]) == ("local", None, "compiled locally")
    assert payload["plan"] == {} and payload["compiled_by"] == payload["loaders"] == []
    assert payload["time_ms"] == 250.0 and payload["world_size"] is None


# ---------------------------------------------------------------- artifact content


def _tensor(*size: int) -> SizeEntry:
    return SizeEntry(scalar=DYNAMIC, size=size, stride=(InferStride(1),) + (1,) * (len(size) - 1))


def _scalar(value: int) -> SizeEntry:
    return SizeEntry(scalar=value, size=DYNAMIC, stride=DYNAMIC)


def _states(*per_rank: dict) -> list[LocalState]:
    return [LocalState(automatic_dynamic=dict(entries)) for entries in per_rank]


def test_a_dim_that_differs_is_reported_with_every_value_and_the_ranks_off_the_common_one():
    states = _states({"L['x']": _tensor(8, 4)}, {"L['x']": _tensor(9, 4)}, {"L['x']": _tensor(8, 4)})
    assert artifacts.dynamic_decisions(states) == [
        {
            "source": "L['x']",
            "what": "size",
            "dim": 0,
            "values": {"0": 8, "1": 9, "2": 8},
            "ranks": [1],
            "why": "differs across ranks",
        }
    ]


def test_an_int_argument_that_differs_is_a_dynamic_scalar():
    (decision,) = artifacts.dynamic_decisions(_states({"L['n']": _scalar(3)}, {"L['n']": _scalar(4)}))
    assert (decision["what"], decision["dim"], decision["values"]) == ("scalar", None, {"0": 3, "1": 4})


def test_a_different_number_of_dims_makes_the_tensor_dynamic_as_a_whole():
    decisions = artifacts.dynamic_decisions(_states({"L['x']": _tensor(8, 4)}, {"L['x']": _tensor(8, 4, 2)}))
    assert [(d["what"], d["dim"]) for d in decisions] == [("size", None), ("stride", None)]


def test_a_tensor_on_one_rank_and_an_int_on_another_is_dynamic_as_a_whole():
    (decision,) = artifacts.dynamic_decisions(_states({"L['x']": _tensor(8)}, {"L['x']": _scalar(8)}))
    assert decision["what"] == "kind" and decision["values"] == {"0": "tensor", "1": "scalar"}


def test_a_source_seen_on_some_ranks_only_says_which():
    states = _states({"L['x']": _tensor(8)}, {}, {"L['x']": _tensor(9)})
    (decision,) = artifacts.dynamic_decisions(states)
    assert decision["seen_on"] == [0, 2] and decision["values"] == {"0": 8, "2": 9}


def test_sizes_every_rank_agrees_on_are_not_reported():
    assert artifacts.dynamic_decisions(_states({"L['x']": _tensor(8, 4)}, {"L['x']": _tensor(8, 4)})) == []


def test_the_restart_decision_says_which_rank_recorded_what_differently():
    early = _states({"L['x']": _tensor(8)}, {"L['x']": _tensor(9)})
    recorded = _states({"L['x']": _tensor(8)}, {"L['x']": _tensor(10)})
    restart, why = restart_decision(recorded, early)
    assert restart and "rank 1" in why and "L['x']" in why
    restart, why = restart_decision(early, early)
    assert not restart and "exactly as exchanged" in why


def test_the_restart_decision_names_a_non_argument_source_that_differs():
    restart, why = restart_decision(_states({"L['m'].w": _tensor(3)}, {"L['m'].w": _tensor(4)}))
    assert restart and "L['m'].w" in why and "rank 1" in why


def test_a_forced_rank_names_every_missing_rank_up_to_eight_then_counts_the_rest():
    missed = {r: [f"reason {r}"] for r in range(1, 12)}
    (text,) = recompile_reasons.recorded_reasons(0, missed, [])
    assert text.startswith("forced by the guard collective: rank 1 missed: reason 1; rank 2 missed: reason 2")
    assert "rank 8 missed: reason 8; and 3 more rank(s) missed: [9, 10, 11]" in text


def test_a_missing_rank_with_no_other_missing_rank_records_only_its_own_reasons():
    assert recompile_reasons.recorded_reasons(1, {1: ["a", "b"]}, ["a", "b"]) == ["a", "b"]
