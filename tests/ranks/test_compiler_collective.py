"""The compiler collective on real gloo groups and real torch.compile (issue: foundation)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from tests.rank_env import rank_env
from tests.rankside import GraphRecorder, summary

# Every test here starts rank processes or subprocesses: the multi-process tier.
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_seam]


def _fn(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sum(0) + 1


def ranks_with_different_sizes(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    rec = GraphRecorder()
    f = torch.compile(_fn, backend=rec)
    first = f(torch.ones(8 + rank, 4))
    after_first = summary(rec)
    # Yet other sizes, different on every rank: must not recompile anywhere.
    for n in (3, 17 + rank, 40):
        f(torch.ones(n, 4))
    out = summary(rec)
    out["after_first"] = after_first
    out["first_ok"] = bool(torch.equal(first, _fn(torch.ones(8 + rank, 4))))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_different_sizes_make_the_dim_dynamic_on_every_rank_in_one_compile(world):
    outcome = run_ranks(ranks_with_different_sizes, world)
    for r in outcome.results:
        assert r["after_first"]["compiles"] == 1
        assert r["graphs"] == [[["s", 4]]]
        assert r["compiles"] == 1, "a later call with other sizes recompiled"
        assert r["collectives"] == 1
        assert r["input_exchanges"] == 1
        assert r["restarts"] == 0, "the arguments were exchanged first: one trace is enough"
        assert r["first_ok"]


def test_without_the_input_exchange_different_sizes_cost_a_preflight_and_one_restart_like_torch():
    env = rank_env(exchange_inputs_first=False)
    outcome = run_ranks(ranks_with_different_sizes, 2, env=env)
    for r in outcome.results:
        assert r["graphs"] == [[["s", 4]]]
        assert r["compiles"] == 1
        assert r["collectives"] == 1 and r["input_exchanges"] == 0
        assert r["restarts"] == 1


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _from_attribute(holder: _Holder, unused: torch.Tensor) -> torch.Tensor:
    return holder.t * 2


def ranks_with_sizes_hidden_in_an_attribute(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    rec = GraphRecorder()
    f = torch.compile(_from_attribute, backend=rec)
    f(_Holder(torch.ones(3 + rank)), torch.ones(7 + rank))
    f(_Holder(torch.ones(11)), torch.ones(2))
    return summary(rec)


def test_sizes_that_are_not_frame_arguments_still_agree_through_the_end_of_trace_exchange():
    outcome = run_ranks(ranks_with_sizes_hidden_in_an_attribute, 2)
    for r in outcome.results:
        # L['holder'].t is only known by tracing: the first trace was static, so restart
        assert r["graphs"] == [[["s"]]]
        assert r["restarts"] == 1
        assert r["compiles"] == 1


def _uses_x_only(x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
    return x + 1


def ranks_with_an_unused_argument(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    rec = GraphRecorder()
    f = torch.compile(_uses_x_only, backend=rec)
    f(torch.ones(4), torch.ones(5 + rank))
    return summary(rec)


def test_an_unused_argument_that_differs_across_ranks_does_not_force_a_restart():
    outcome = run_ranks(ranks_with_an_unused_argument, 2)
    for r in outcome.results:
        assert r["graphs"] == [[[4]]]
        assert r["restarts"] == 0 and r["restarts_skipped"] == 1


def ranks_with_transposed_inputs(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    rec = GraphRecorder()
    f = torch.compile(lambda x: x.sum(1), backend=rec)
    x = torch.ones(6, 3 + rank).t()  # a non-contiguous view: strides and its base predicted
    value = f(x)
    out = summary(rec)
    out["ok"] = bool(torch.equal(value, x.sum(1)))
    return out


def test_argument_predictions_match_dynamo_for_non_contiguous_tensors():
    outcome = run_ranks(ranks_with_transposed_inputs, 2)
    for r in outcome.results:
        assert r["ok"]
        assert r["graphs"] == [[["s", 6]]]
        assert r["restarts"] == 0


def ranks_with_identical_sizes(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    rec = GraphRecorder()
    f = torch.compile(_fn, backend=rec)
    f(torch.ones(8, 4))
    f(torch.ones(8, 4))  # cache hit: no collective
    return summary(rec)


@pytest.mark.parametrize("world", [2, 4])
def test_identical_sizes_compile_one_static_graph_without_restart(world):
    outcome = run_ranks(ranks_with_identical_sizes, world)
    for r in outcome.results:
        assert r["graphs"] == [[[8, 4]]]
        assert r["collectives"] == 1, "a cache hit must never communicate"
        assert r["restarts"] == 0
        assert r["restarts_skipped"] == 1


def _scale(x: torch.Tensor, n: int) -> torch.Tensor:
    return x * n + n


def ranks_with_different_ints(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    rec = GraphRecorder()
    f = torch.compile(_scale, backend=rec)
    x = torch.ones(4)
    results = [f(x, 3 + rank).tolist(), f(x, 11 + rank).tolist()]
    out = summary(rec)
    out["correct"] = results == [_scale(x, 3 + rank).tolist(), _scale(x, 11 + rank).tolist()]
    return out


def test_int_inputs_that_differ_across_ranks_become_dynamic_everywhere():
    outcome = run_ranks(ranks_with_different_ints, 2)
    for r in outcome.results:
        assert r["compiles"] == 1
        assert r["symbolic_ints"] == [1], r
        assert r["correct"]


def ranks_with_different_ndim(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    rec = GraphRecorder()
    f = torch.compile(lambda x: x.sum() * 2, backend=rec)
    x = torch.ones(3, 5) if rank == 0 else torch.ones(3, 5, 2)
    value = f(x).item()
    out = summary(rec)
    out["correct"] = value == x.sum().item() * 2
    return out


def test_a_different_number_of_dims_makes_the_input_fully_dynamic_on_every_rank():
    outcome = run_ranks(ranks_with_different_ndim, 2)
    for rank, r in enumerate(outcome.results):
        assert r["compiles"] == 1
        assert r["correct"]
        (shape,) = r["graphs"][0]
        assert shape == ["s"] * (2 if rank == 0 else 3), r["graphs"]


def ranks_with_tensor_on_one_int_on_other(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    rec = GraphRecorder()
    f = torch.compile(lambda x, y: x + y, backend=rec)
    y = torch.ones(3) * 2 if rank == 0 else 5
    value = f(torch.ones(3), y).tolist()
    out = summary(rec)
    out["value"] = value
    return out


def test_a_tensor_on_one_rank_and_an_int_on_another_is_dynamic_on_every_rank():
    outcome = run_ranks(ranks_with_tensor_on_one_int_on_other, 2)
    r0, r1 = outcome.results
    assert r0["value"] == [3.0, 3.0, 3.0] and r1["value"] == [6.0, 6.0, 6.0]
    assert r0["restarts"] == r1["restarts"] == 0  # a tensor and an int are both predicted
    assert r0["compiles"] == r1["compiles"] == 1
    # rank 0's tensor y: every dim dynamic; rank 1's int y: a symbolic int
    assert ["s"] in r0["graphs"][0], r0["graphs"]
    assert r1["symbolic_ints"] == [1], r1


def _maybe_add(x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    out = x * 2
    if y is not None:
        out = out + y.sum()
    return out


def ranks_with_a_missing_input(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    rec = GraphRecorder()
    f = torch.compile(_maybe_add, backend=rec)
    y = torch.ones(2 + rank) if rank == 0 else None
    value = f(torch.ones(3), y).tolist()
    out = summary(rec)
    out["correct"] = value == _maybe_add(torch.ones(3), y).tolist()
    return out


def test_a_source_seen_on_one_rank_only_still_runs_the_collective_and_nothing_hangs():
    outcome = run_ranks(ranks_with_a_missing_input, 2, timeout=60)
    for r in outcome.results:
        assert r["correct"]
        assert r["collectives"] == 1


def _with_graph_break(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    torch._dynamo.graph_break()
    return y.cos() + x.shape[0]


def ranks_with_a_graph_break(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    rec = GraphRecorder()
    f = torch.compile(_with_graph_break, backend=rec)
    x = torch.ones(5 + rank, 2)
    value = f(x)
    out = summary(rec)
    out["correct"] = bool(torch.allclose(value, _with_graph_break(x)))
    return out


def test_a_frame_with_a_graph_break_runs_one_collective_per_graph_and_completes():
    outcome = run_ranks(ranks_with_a_graph_break, 2, timeout=60)
    for r in outcome.results:
        assert r["correct"]
        assert r["compiles"] == 2
        assert r["collectives"] == 2
        assert all(g[0][0] == "s" for g in r["graphs"]), r["graphs"]


def ranks_with_flag_off(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.disable()
    rec = GraphRecorder()
    f = torch.compile(_fn, backend=rec)
    f(torch.ones(8 + rank, 4))
    f(torch.ones(9 + rank, 4))
    return summary(rec)


def test_with_the_flag_off_no_collective_runs():
    outcome = run_ranks(ranks_with_flag_off, 2)
    for r in outcome.results:
        assert r["collectives"] == 0
        assert r["bytes_sent"] == 0
        assert r["compiles"] == 2  # plain automatic dynamic: static, then dynamic


def ranks_recompile_together(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    rec = GraphRecorder()
    f = torch.compile(_fn, backend=rec)
    f(torch.ones(8, 4))  # everyone the same: static, no restart
    f(torch.ones(8, 4, dtype=torch.float64))  # everyone recompiles for the dtype
    f(torch.ones(8, 4))  # hit
    return summary(rec)


def test_every_compile_including_recompiles_is_a_collective_and_hits_are_free():
    outcome = run_ranks(ranks_recompile_together, 2)
    for r in outcome.results:
        assert r["compiles"] == 2
        assert r["collectives"] == 2


def ranks_same_new_size_after_static(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    rec = GraphRecorder()
    f = torch.compile(_fn, backend=rec)
    f(torch.ones(8, 4))  # all ranks 8: static, restart skipped
    f(torch.ones(10, 4))  # all ranks 10: frame state says 8 -> must restart and go dynamic
    f(torch.ones(12, 4))  # covered by the dynamic graph
    return summary(rec)


def test_restart_is_not_skipped_when_the_prior_frame_state_changes_the_decision():
    env = rank_env(exchange_inputs_first=False)  # the all-static preflight path
    outcome = run_ranks(ranks_same_new_size_after_static, 2, env=env)
    for r in outcome.results:
        assert r["graphs"] == [[[8, 4]], [["s", 4]]]
        assert r["restarts_skipped"] == 1
        assert r["restarts"] == 1
        assert r["compiles"] == 2


def test_with_arguments_exchanged_first_the_prior_frame_state_joins_the_first_trace():
    outcome = run_ranks(ranks_same_new_size_after_static, 2)
    for r in outcome.results:
        assert r["graphs"] == [[[8, 4]], [["s", 4]]]  # the same decisions as above ...
        assert r["restarts"] == 0 and r["restarts_skipped"] == 2  # ... without the second trace
        assert r["compiles"] == 2


def ranks_skip_switched_off(rank: int, world: int) -> dict:
    import compiler_collectives as cc
    from compiler_collectives import config

    cc.enable()
    with config.override(skip_needless_restart=False):  # put back after: the rank may serve other tests
        rec = GraphRecorder()
        f = torch.compile(_fn, backend=rec)
        f(torch.ones(8, 4))
        return summary(rec)


def test_with_skipping_switched_off_identical_sizes_restart_like_torch():
    outcome = run_ranks(ranks_skip_switched_off, 2)
    for r in outcome.results:
        assert r["graphs"] == [[[8, 4]]]
        assert r["restarts"] == 1 and r["restarts_skipped"] == 0
