"""Pipeline parallelism: the service scoped to the ranks that run the same program (issue 17).

Four gloo ranks as two pipeline stages of two data-parallel ranks each. Stage 0
runs a compiled function and sends its activations point to point to stage 1,
which runs another compiled function. Stage 1 cannot compile before stage 0
has sent, so any agreement that spans both stages deadlocks: that is the test.

The scope variable's layouts and the scope verdict's wire format: ``tests/unit/test_scope_rules.py``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import release, run_ranks, stay_until
from tests.rank_env import rank_env
from tests.rankside import GraphRecorder, summary

# Multi-process tests here: release independent (tests/tiers.py).
pytestmark = pytest.mark.release_independent

TIMEOUT_S, PG_TIMEOUT_S = 60, 120
ENV = rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S)
SHORT_TIMEOUT_S = 4.0
SHORT_ENV = rank_env(timeout_s=SHORT_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S)
STEPS = 6
ONE_SIDED_STEP = 3  # from here dp rank 0 of stage 0 passes another int: a guard miss on that rank only


def _stage0(x: torch.Tensor, n: int) -> torch.Tensor:
    return (x * n).sum(0)  # [length, 8] -> [8]: stage 1's input never changes shape


def _stage1(h: torch.Tensor) -> torch.Tensor:
    return torch.relu(h) + 1


def _layout(rank: int, strided: bool) -> tuple[int, int, int]:
    """(stage, dp index, peer in the other stage) for 2 stages x 2 dp ranks."""
    if strided:  # stage = rank % 2: stage 0 is ranks 0, 2
        return rank % 2, rank // 2, rank + 1 if rank % 2 == 0 else rank - 1
    return rank // 2, rank % 2, rank + 2 if rank < 2 else rank - 2


def _run_pipeline(rank: int, stage: int, dp: int, peer: int, steps: int = STEPS) -> dict:
    import compiler_collectives as cc

    recorder = GraphRecorder()
    f = torch.compile(_stage0 if stage == 0 else _stage1, backend=recorder)
    for step in range(steps):
        if stage == 0:
            length = 4 + 2 * dp + step  # differs per dp rank, and per step
            n = 3 if (dp == 0 and step >= ONE_SIDED_STEP) else 2
            dist.send(f(torch.ones(length, 8), n).contiguous(), peer)
        else:
            h = torch.empty(8)
            dist.recv(h, peer)
            f(h)
    from compiler_collectives.transport import groups

    scoped = groups.scope()
    return {
        **summary(recorder),
        "stage": stage,
        "transport": cc.stats()["guard_transport"],
        "scope": list(scoped.ranks) if scoped is not None else None,
    }


def two_stages_scoped(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    stage, dp, peer = _layout(rank, strided=False)
    stage_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    cc.scope(stage_groups[stage])
    return _run_pipeline(rank, stage, dp, peer)


def _check_stages(results: list[dict], stages: dict[int, list[int]]) -> None:
    for _stage, ranks in stages.items():
        a, b = (results[r] for r in ranks)
        assert a["scope"] == ranks and b["scope"] == ranks, (a, b)
        # The stage's dp ranks end with the same graphs, in the same number of compiles.
        assert a["graphs"] == b["graphs"], (a, b)
        assert a["compiles"] == b["compiles"] and a["guard_collectives"] == b["guard_collectives"]
        assert a["transport"] == "shm", a
    s0, s1 = ([results[r] for r in ranks] for ranks in stages.values())
    # Stage 0: dims that differ per dp rank are dynamic from the first compile on; the
    # one-sided int change made both ranks recompile (the other rank was forced to).
    assert s0[0]["graphs"][0] == [["s", 8]], s0[0]
    assert s0[0]["compiles"] == 2, s0[0]
    assert sorted(r["forced_recompiles"] for r in s0) == [0, 1], s0
    # Stage 1 never recompiled: the forced recompile stayed within stage 0.
    assert all(r["compiles"] == 1 and r["forced_recompiles"] == 0 for r in s1), s1
    assert all(r["guard_collectives"] == STEPS - 1 for r in s1), s1
    # Each stage counted its own compiler collectives: the stages did not take part in each other's.
    assert s0[0]["collectives"] > s1[0]["collectives"], (s0, s1)


@pytest.mark.multiprocess
def test_two_pipeline_stages_with_scope_agree_within_each_stage_and_finish():
    outcome = run_ranks(two_stages_scoped, 4, env=ENV, timeout=120)
    _check_stages(outcome.results, {0: [0, 1], 1: [2, 3]})


def two_stages_strided_by_the_variable(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    stage, dp, peer = _layout(rank, strided=True)
    return _run_pipeline(rank, stage, dp, peer)


@pytest.mark.multiprocess
def test_the_strided_layout_through_the_variable_scopes_each_stage_without_a_call():
    env = rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S, scope="strided:2")
    outcome = run_ranks(two_stages_strided_by_the_variable, 4, env=env, timeout=120)
    _check_stages(outcome.results, {0: [0, 2], 1: [1, 3]})


def two_stages_consecutive_by_the_variable(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    stage, dp, peer = _layout(rank, strided=False)
    return _run_pipeline(rank, stage, dp, peer)


@pytest.mark.multiprocess
def test_the_consecutive_layout_through_the_variable_scopes_each_stage_without_a_call():
    env = rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S, scope="consecutive:2")
    outcome = run_ranks(two_stages_consecutive_by_the_variable, 4, env=env, timeout=120)
    _check_stages(outcome.results, {0: [0, 1], 1: [2, 3]})


# ---------------------------------------------------------------- the user forgot


def two_stages_unscoped(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    stage, dp, peer = _layout(rank, strided=False)
    start = time.monotonic()
    try:
        _run_pipeline(rank, stage, dp, peer, steps=2)
    except cc.CollectiveError as e:
        return {
            "type": type(e).__name__,
            "message": str(e),
            "ranks": list(e.ranks),
            "seconds": time.monotonic() - start,
        }
    except RuntimeError as e:  # stage 1: its recv ends when stage 0 gives up and exits
        return {"type": "recv", "message": str(e), "seconds": time.monotonic() - start}
    return {"type": None}


@pytest.mark.multiprocess
def test_without_scope_the_first_stage_stops_at_the_timeout_and_the_error_names_scope():
    outcome = run_ranks(two_stages_unscoped, 4, env=SHORT_ENV, timeout=90)
    for r in outcome.results[:2]:
        assert r["type"] == "CollectiveTimeoutError", r
        assert r["ranks"] == [2, 3], r
        assert r["seconds"] < SHORT_TIMEOUT_S + 8, r
        assert "compiler_collectives.scope(" in r["message"], r["message"]
        assert "COMPILER_COLLECTIVES_SCOPE" in r["message"], r["message"]
    for r in outcome.results[2:]:
        assert r["type"] is not None, r  # never a hang, never a success


def stages_compile_different_frames_at_once(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_stage0 if rank < 2 else _stage1, backend="eager")
    start = time.monotonic()
    try:
        f(torch.ones(4, 8), 2) if rank < 2 else f(torch.ones(8))
    except cc.CollectiveError as e:
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"type": None}


@pytest.mark.multiprocess
def test_without_scope_stages_compiling_at_once_get_a_desync_error_that_names_scope():
    outcome = run_ranks(stages_compile_different_frames_at_once, 4, env=ENV, timeout=90)
    for r in outcome.results:
        assert r["type"] == "CollectiveDesyncError", r
        assert r["seconds"] < 20, r
        assert "compiler_collectives.scope(" in r["message"] and "COMPILER_COLLECTIVES_SCOPE" in r["message"]


# ---------------------------------------------------------------- failures


def _step(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def stage_one_loses_a_rank(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    stage = rank // 2
    cc.scope([dist.new_group([0, 1]), dist.new_group([2, 3])][stage])
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    if rank == 3:
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        while time.monotonic() - start < 20:
            f(torch.ones(2))
            if rank != 2:
                time.sleep(0.01)
    except cc.CollectiveError as e:
        seconds = time.monotonic() - start
        # Stay alive until every survivor holds its error: peers must learn of the failure
        # from us, not from a closed socket.
        release()
        stay_until(world - 1, 30)
        return {"type": type(e).__name__, "message": str(e), "ranks": list(e.ranks), "seconds": seconds}
    return {"type": None, "seconds": time.monotonic() - start}


@pytest.mark.multiprocess
def test_a_rank_killed_in_one_stage_is_named_to_its_stage_within_seconds_and_the_other_stage_is_not_blamed():
    """No timeout is waited for (ours is 60 s): rank 3 dies inside a guard collective of its stage."""
    outcome = run_ranks(
        stage_one_loses_a_rank, 4, env=ENV, timeout=120, check=False, expect_signals={3: signal.SIGKILL}
    )
    assert not outcome.errors, outcome.errors
    peer = outcome.results[2]
    assert peer["type"] == "PeerFailureError", peer
    assert peer["ranks"] == [3], peer
    assert peer["seconds"] < 10, peer
    # The diagnosis covers the stage only: no rank of stage 0 is called absent or elsewhere.
    assert "rank 0:" not in peer["message"] and "rank 1:" not in peer["message"], peer["message"]
    # Stage 0 hears of the job's failure from rank 2's report (a pipeline cannot go on without
    # a stage), and stops with it within seconds instead of in its next send to stage 1.
    for r in outcome.results[:2]:
        assert r["type"] is not None, r
        assert r["seconds"] < 10, r
        assert "rank 2 reported" in r["message"], r["message"]


# ---------------------------------------------------------------- misuse


def scope_after_a_compile(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    torch.compile(_step, backend="eager")(torch.ones(2))
    stage_groups = [dist.new_group([0]), dist.new_group([1])]
    try:
        cc.scope(stage_groups[rank])
    except cc.CollectiveError as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


@pytest.mark.multiprocess
def test_scope_after_a_compile_is_refused_naming_reset():
    for r in run_ranks(scope_after_a_compile, 2, env=ENV, timeout=90).results:
        assert r["type"] == "ScopeError", r
        assert "before the first compile" in r["message"] and "reset()" in r["message"], r


def scope_without_this_rank(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    g = dist.new_group([0])
    try:
        cc.scope(g)
    except cc.CollectiveError as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


@pytest.mark.multiprocess
def test_a_group_without_the_calling_rank_is_refused_at_the_call():
    outcome = run_ranks(scope_without_this_rank, 2, env=ENV, timeout=90)
    assert outcome.results[0] == {"type": None}
    assert outcome.results[1]["type"] == "ScopeError"
    assert "does not contain this rank" in outcome.results[1]["message"]


def overlapping_scopes(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    a, b = dist.new_group([0, 1]), dist.new_group([1, 2])
    start = time.monotonic()
    try:
        cc.scope(a if rank < 2 else b)  # rank 1 says [0, 1], rank 2 says [1, 2]
        cc.enable(guards=True)
        f = torch.compile(_step, backend="eager")
        while time.monotonic() - start < 20:  # ranks 0 and 1 agree with each other: until stopped
            f(torch.ones(2))
            time.sleep(0.01)
    except cc.CollectiveError as e:
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    return {"type": None}


@pytest.mark.multiprocess
def test_overlapping_scopes_fail_at_the_call_naming_both_scopes_and_stop_every_rank():
    outcome = run_ranks(overlapping_scopes, 3, env=ENV, timeout=90)
    rank2 = outcome.results[2]
    assert rank2["type"] == "ScopeError", rank2
    assert "ranks [0, 1]" in rank2["message"] and "ranks [1, 2]" in rank2["message"], rank2["message"]
    for r in outcome.results:
        assert r["type"] is not None and r["seconds"] < 15, r


def scope_with_meshes(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import compiler_collectives as cc

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    out = {}
    try:
        cc.scope(mesh)
    except cc.CollectiveError as e:
        out["2d"] = type(e).__name__
    cc.scope(mesh["dp"])
    from compiler_collectives.transport import groups

    out["scope"] = list(groups.scope().ranks)
    cc.enable()
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2 + rank % 2))
    out["stats"] = cc.stats()["compiler_collectives"]
    return out


@pytest.mark.multiprocess
@pytest.mark.torch_seam
def test_a_one_dimensional_device_mesh_is_a_scope_and_a_two_dimensional_one_is_refused():
    outcome = run_ranks(scope_with_meshes, 4, env=ENV, timeout=120)
    for rank, r in enumerate(outcome.results):
        assert r["2d"] == "ScopeError", r
        assert r["scope"] == ([0, 1] if rank < 2 else [2, 3]), r
        assert r["stats"] == 1, r


PIPELINE_STEPS = 3


def pipelining_schedule_scoped_to_the_stage(rank: int, world: int, schedule: str) -> dict:
    """torch.distributed.pipelining on a 2x2 ("pp", "dp") mesh, each stage's submodule compiled.

    Each dp rank has its own sequence length (fixed over the steps: a pipeline
    stage allocates its receive buffers from the first step's shapes), so the
    stage's dp ranks must agree to make that dim dynamic.
    """
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import compiler_collectives as cc
    from compiler_collectives.transport import groups

    cc.enable(guards=True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage_index, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    cc.scope(mesh["dp"])  # the ranks that run this stage's program
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    submod = full[2 * stage_index : 2 * stage_index + 2]
    recorder = GraphRecorder()
    stage = PipelineStage(
        torch.compile(submod, backend=recorder), stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group()
    )
    # loss_fn on every stage: a schedule without it skips the backward set-up on that stage.
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = schedule_class(stage, n_microbatches=2, loss_fn=lambda out, target: F.mse_loss(out, target))
    length = 3 + dp
    generator = torch.Generator().manual_seed(100 + dp)
    for _ in range(PIPELINE_STEPS):
        x, y = torch.randn(4, length, 8, generator=generator), torch.randn(4, length, 8, generator=generator)
        for p in submod.parameters():
            p.grad = None
        if stage_index == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])
        for p in submod.parameters():
            dist.all_reduce(p.grad, group=mesh["dp"].get_group())
    return {
        **summary(recorder),
        "stage": stage_index,
        "transport": cc.stats()["guard_transport"],
        "scope": list(groups.scope().ranks),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.torch_seam
def test_torch_pipelining_stages_compile_alike_within_each_stage_under_scope(schedule):
    outcome = run_ranks(pipelining_schedule_scoped_to_the_stage, 4, args=(schedule,), env=ENV, timeout=180)
    results = outcome.results
    for ranks in ([0, 1], [2, 3]):  # mesh["dp"]: the ranks of one stage
        a, b = (results[r] for r in ranks)
        assert a["stage"] == b["stage"] and a["scope"] == b["scope"] == ranks, (a, b)
        assert a["graphs"] == b["graphs"] and a["compiles"] == b["compiles"], (a, b)
        assert a["transport"] == b["transport"] == "shm", (a, b)
        # The sequence length differs between the dp ranks: dynamic on both, in every graph
        # (its inputs: the stage's weight and bias, then the [microbatch, length, 8] activations).
        assert a["graphs"] and all(g[-1] == [2, "s", 8] for g in a["graphs"]), a
        assert a["audit_divergences"] == 0 and a["forced_recompiles"] == b["forced_recompiles"], (a, b)
    assert results[0]["stage"] == 0 and results[2]["stage"] == 1
