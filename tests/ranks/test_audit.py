"""The program audit: ranks that compiled different collectives fail at compile time, together (issue 13).

The fingerprint of one graph and the audit's wire format: ``tests/unit/test_audit_fingerprint.py``.
"""

from __future__ import annotations

import functools
import logging
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks
from tests.rank_env import rank_env
from tests.rankside import caught, kept_logs, line_of

# Multi-process tests here: torch seam (tests/tiers.py).
pytestmark = pytest.mark.torch_seam

TIMEOUT_S = 30
ENV = rank_env(timeout_s=TIMEOUT_S)


# ---------------------------------------------------------------- divergence at the first compile


def _branch_on_size(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    y = funcol.all_reduce(x.sum(0), "sum", dist.group.WORLD)
    if x.shape[0] > 32:
        y = y + funcol.all_reduce(y, "avg", dist.group.WORLD)  # size-branch all_reduce
    return y * 2


def size_hint_branch(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    compiled = torch.compile(_branch_on_size, backend="aot_eager")
    out = caught(lambda: compiled(torch.ones(24 if rank == 0 else 40, 4)))
    # What the new user did next: a collective of their own on the default group.
    # Without the audit, rank 1's extra all_reduce meets this one and gloo aborts rank 0.
    if out["type"] is None:
        dist.all_reduce(torch.ones(4))
    out["stats"] = cc.stats()
    return out


@pytest.mark.multiprocess
def test_a_branch_on_a_size_hint_makes_every_rank_raise_program_divergence_naming_the_all_reduce_line():
    outcome = run_ranks(size_hint_branch, 2, env=ENV, timeout=120)
    line = line_of(__file__, "size-branch all_reduce")
    for r in outcome.results:
        assert r["type"] == "ProgramDivergenceError", r
        assert r["seconds"] < 60
        assert r["level"] == "dynamo"
        assert "_branch_on_size at " in r["message"]  # the frame
        assert "First difference: collective #2" in r["message"]
        assert "rank 0: no collective #2" in r["message"]
        assert "rank 1: _c10d_functional.all_reduce.default(avg) on ranks [0, 1]" in r["message"]
        assert f"test_audit.py:{line} in _branch_on_size" in r["message"]
        # One rank per version: on a tie the lowest rank's version is the reference, so the
        # odd one out named is rank 1 on both ranks.
        assert r["ranks"] == [1], r
        assert r["stats"]["audit_divergences"] == 1


def _branch_on_rank(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    y = x * 2
    if dist.get_rank() == 1:
        y = funcol.all_reduce(y, "sum", dist.group.WORLD)  # rank-branch all_reduce
    return y + 1


def rank_branch(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    compiled = torch.compile(_branch_on_rank, backend="eager")
    return caught(lambda: compiled(torch.ones(4)))


@pytest.mark.multiprocess
def test_a_collective_under_a_rank_dependent_branch_is_caught_before_any_rank_runs_it():
    outcome = run_ranks(rank_branch, 3, env=ENV, timeout=120)
    line = line_of(__file__, "rank-branch all_reduce")
    for r in outcome.results:
        assert r["type"] == "ProgramDivergenceError", r
        assert "ranks 0, 2: no collective #1 (its graph has 0 collective(s) in all)" in r["message"]
        assert "rank 1: _c10d_functional.all_reduce.default(sum) on ranks [0, 1, 2]" in r["message"]
        assert f"test_audit.py:{line} in _branch_on_rank" in r["message"]
        assert r["ranks"] == [1]  # the odd one out


def _scaled_by_rank(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x * (dist.get_rank() + 2), "sum", dist.group.WORLD)


def rank_constant(rank: int, world: int) -> dict:
    import compiler_collectives as cc
    from compiler_collectives.agreements import audit

    lines = kept_logs("compiler_collectives.audit", "INFO")
    logging.getLogger("compiler_collectives.audit").setLevel(logging.INFO)
    cc.enable()
    compiled = torch.compile(_scaled_by_rank, backend="aot_eager")
    value = compiled(torch.ones(3))
    return {
        "value": value.tolist(),
        "stats": cc.stats(),
        "reports": audit.reports(),
        "lines": [ln for ln in lines if "reported only" in ln],
    }


@pytest.mark.multiprocess
def test_graphs_that_differ_only_in_a_rank_dependent_constant_run_and_are_reported_only():
    outcome = run_ranks(rank_constant, 2, env=ENV, timeout=120)
    for r in outcome.results:
        assert r["value"] == [5.0, 5.0, 5.0]  # 2 + 3: every rank ran its graph
        assert r["stats"]["audit_divergences"] == 0
        assert r["stats"]["audit_report_only_differences"] == 1
        (report,) = r["reports"]
        assert "_scaled_by_rank" in report["frame"]
        assert set(report["levels"]) == {"dynamo", "aot_forward"}
        (line,) = r["lines"]
        assert "differ across ranks outside their collectives" in line


def rank_constant_traced(rank: int, world: int) -> None:
    import compiler_collectives as cc

    cc.enable()
    torch.compile(_scaled_by_rank, backend="eager")(torch.ones(3))


@pytest.mark.multiprocess
@pytest.mark.release_independent  # torch's structured trace is pinned by test_pt2_tooling's tlparse test
def test_each_audit_is_a_structured_trace_artifact_that_names_the_report_only_levels(tmp_path):
    import json

    env = rank_env(timeout_s=TIMEOUT_S, extra={"TORCH_TRACE": str(tmp_path)})  # read when torch is imported: spawn
    run_ranks(rank_constant_traced, 2, env=env, timeout=120, start_method="spawn")
    payloads = []
    for log_file in sorted(tmp_path.glob("*rank_*")):
        lines = log_file.read_text().splitlines()
        for i, line in enumerate(lines):
            if '"name": "compiler_collectives_audit"' in line:
                payloads.append(json.loads(lines[i + 1].strip()))
    assert [p["rank"] for p in payloads] == [0, 1]
    for p in payloads:
        assert p["report_only_levels"] == ["dynamo"]
        assert p["collectives"]["dynamo"][0].startswith("_c10d_functional.all_reduce.default(sum) on ranks [0, 1]")


def agreeing_ranks(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    compiled = torch.compile(_branch_on_size, backend="aot_eager")
    for n in (8 + rank, 12, 5 + 3 * rank):  # sizes differ, branches agree (all <= 32)
        compiled(torch.ones(n, 4))
    return cc.stats()


@pytest.mark.multiprocess
def test_ranks_with_different_sizes_but_the_same_program_pass_the_audit_with_one_exchange_per_graph():
    outcome = run_ranks(agreeing_ranks, 2, env=ENV, timeout=120)
    for s in outcome.results:
        assert s["audit_divergences"] == 0 and s["audit_report_only_differences"] == 0
        # one compile (the dim is dynamic from the start); aot_eager compiles
        # the backward lazily but nothing here needs a gradient
        assert s["audit_exchanges"] == 1
        assert s["audit_graphs"] == 2  # the Dynamo graph and the AOTAutograd inference graph


def audit_switched_off(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    compiled = torch.compile(_branch_on_size, backend="aot_eager")
    compiled(torch.ones(5 + rank, 4))
    return cc.stats()


@pytest.mark.multiprocess
def test_with_the_audit_switched_off_compiles_run_no_audit_exchange():
    env = rank_env(timeout_s=TIMEOUT_S, audit=False)
    outcome = run_ranks(audit_switched_off, 2, env=env, timeout=120)
    for s in outcome.results:
        assert s["compiler_collectives"] == 1  # compiler collectives stay on
        assert s["audit_exchanges"] == 0 and s["audit_graphs"] == 0


# ---------------------------------------------------------------- the backward


def _checkpointed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = funcol.all_reduce(x @ w, "sum", dist.group.WORLD)  # recomputed all_reduce
        return y * y

    def policy(ctx, op, *args, **kwargs):
        # Rank 1 alone recomputes the all_reduce in the backward instead of saving it.
        if op in (torch.ops._c10d_functional.all_reduce.default, torch.ops._c10d_functional.wait_tensor.default):
            return CheckpointPolicy.MUST_RECOMPUTE if dist.get_rank() == 1 else CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_SAVE

    context = functools.partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(block, x, w, use_reentrant=False, context_fn=context)


def backward_differs(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    compiled = torch.compile(_checkpointed, backend="aot_eager")
    w = torch.ones(4, 4, requires_grad=True)
    result = caught(lambda: compiled(torch.ones(2, 4), w))
    result["stats"] = cc.stats()
    return result


@pytest.mark.multiprocess
def test_a_forward_that_agrees_and_a_backward_that_differs_raise_at_compile_before_the_forward_runs():
    # The backward is lowered with its forward, so it is compared in the forward's one exchange.
    outcome = run_ranks(backward_differs, 2, env=ENV, timeout=120)
    line = line_of(__file__, "recomputed all_reduce")
    for r in outcome.results:
        assert r["type"] == "ProgramDivergenceError", r
        assert r["level"] == "aot_backward"
        assert "for the same graph's backward; no rank has run it" in r["message"]
        # Both backwards reduce the gradient; rank 1 also recomputes the forward's all_reduce.
        assert "rank 0: no collective #2 (its graph has 1 collective(s) in all)" in r["message"]
        assert f"test_audit.py:{line} in block" in r["message"]
        assert r["stats"]["audit_exchanges"] == 1  # the forward's, which holds the backward too


def backward_agrees(rank: int, world: int, rows: tuple[int, int]) -> dict:
    import compiler_collectives as cc

    cc.enable()
    compiled = torch.compile(_branch_on_size, backend="aot_eager")
    for step in range(2):
        x = torch.ones(rows[rank] + step, 4, requires_grad=True)
        compiled(x).sum().backward()
    return cc.stats()


@pytest.mark.multiprocess
def test_a_static_graphs_backward_is_lowered_with_its_forward_and_audited_in_its_exchange():
    # Static shapes: AOTAutograd alone would compile the backward at the first backward.
    outcome = run_ranks(backward_agrees, 2, args=((6, 6),), env=ENV, timeout=120)
    for s in outcome.results:
        assert s["audit_divergences"] == 0
        # step 0 (static) and step 1 (7 rows: the dim dynamic): one exchange each, backward included
        assert s["audit_exchanges"] == 2
        assert s["audit_graphs"] == 6  # per compile: Dynamo, AOT forward, AOT backward
        assert s["audit_lazy_backwards"] == 0


@pytest.mark.multiprocess
def test_a_backward_compiled_with_its_forward_is_audited_in_the_forward_exchange():
    # Sizes differ: the dim is dynamic, and AOTAutograd compiles the backward
    # together with the forward (it saves a symbolic size for the backward).
    outcome = run_ranks(backward_agrees, 2, args=((6, 9),), env=ENV, timeout=120)
    for s in outcome.results:
        assert s["audit_divergences"] == 0
        assert s["audit_exchanges"] == 1
        assert s["audit_graphs"] == 3


def levels_differ(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    # As after an AOTAutograd cache hit on some ranks only: rank 1 produces
    # Dynamo's graph alone, rank 0 also the AOTAutograd graphs (backward included).
    compiled = torch.compile(_branch_on_size, backend="aot_eager" if rank == 0 else "eager")
    x = torch.ones(6, 4, requires_grad=True)
    compiled(x).sum().backward()
    return cc.stats()


@pytest.mark.multiprocess
def test_ranks_that_produce_different_graph_levels_compare_the_shared_ones():
    outcome = run_ranks(levels_differ, 2, env=ENV, timeout=120)
    s0, s1 = outcome.results
    assert s0["audit_divergences"] == s1["audit_divergences"] == 0
    # Rank 1 lacks levels rank 0 compiled, as after a cache hit: it compiles
    # again without caches (still Dynamo's graph only) and both exchange again.
    assert (s0["audit_cache_recompiles"], s1["audit_cache_recompiles"]) == (0, 1)
    assert s0["audit_exchanges"] == s1["audit_exchanges"] == 2  # no backward exchange rank 1 would never join
    assert s0["audit_levels_not_compared"] == s1["audit_levels_not_compared"] == 2  # aot_forward, aot_backward
    assert (s0["audit_graphs"], s1["audit_graphs"]) == (3, 1)


SLOW_TIMEOUT_S, SLOW_RECOMPILE_S = 4, 7


def slow_recompile(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()

    def eager_then_slow_without_caches(gm: torch.fx.GraphModule, inputs: list) -> object:
        if torch.compiler.config.force_disable_caches:
            time.sleep(SLOW_RECOMPILE_S)  # the audit's recompile; the GIL free, its heartbeat beats
        return gm.forward

    # Rank 1 produces Dynamo's graph alone, as after a cache hit: it compiles again, slowly.
    compiled = torch.compile(_branch_on_size, backend="aot_eager" if rank == 0 else eager_then_slow_without_caches)
    x = torch.ones(6, 4, requires_grad=True)
    out = {"error": caught(lambda: compiled(x).sum().backward())}
    out["stats"] = cc.stats()
    return out


@pytest.mark.multiprocess
@pytest.mark.release_independent
def test_the_ranks_that_did_not_recompile_wait_for_a_recompile_longer_than_the_collective_timeout():
    """The wait tested: COMPILER_COLLECTIVES_TIMEOUT (4 s) against a recompile 7 s long. Rank 0
    waits for rank 1's recompile without caches (alive, up to the compile timeout) before the
    second exchange, which would measure it against the collective timeout."""
    env = rank_env(timeout_s=SLOW_TIMEOUT_S)
    r0, r1 = run_ranks(slow_recompile, 2, env=env, timeout=120).results
    assert r0["error"]["type"] is None and r1["error"]["type"] is None, (r0["error"], r1["error"])
    assert (r0["stats"]["audit_cache_recompiles"], r1["stats"]["audit_cache_recompiles"]) == (0, 1)
    assert r0["stats"]["audit_recompile_wait_s"] >= SLOW_RECOMPILE_S - 1
    assert r0["stats"]["audit_exchanges"] == r1["stats"]["audit_exchanges"] == 2


@pytest.mark.multiprocess
@pytest.mark.release_independent
def test_a_recompile_past_the_compile_timeout_is_named_on_the_waiting_rank():
    """The wait tested: COMPILER_COLLECTIVES_COMPILE_TIMEOUT (2 s) against rank 1's 7 s recompile."""
    env = rank_env(timeout_s=TIMEOUT_S, compile_timeout_s=2)
    waiting, recompiling = run_ranks(slow_recompile, 2, env=env, timeout=120, check=False).results
    assert waiting["error"]["type"] == "CompileTimeoutError"
    assert "rank 1 to compile this graph again without caches" in waiting["error"]["message"]
    assert waiting["error"]["ranks"] == [1]
    # Rank 1 heard of it while it compiled (within a heartbeat): its next exchange refuses, quoting it.
    assert recompiling["error"]["type"] == "CollectivePoisonedError"
    assert "waited 2s for rank 1" in recompiling["error"]["message"]


# ---------------------------------------------------------------- one rank fails to compile


def backend_fails_on_rank_1(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    def backend(gm, example_inputs):
        if dist.get_rank() == 1:
            raise ValueError("this backend does not like rank 1")
        return gm.forward

    cc.enable()
    compiled = torch.compile(lambda x: x * 3, backend=backend)
    start = time.monotonic()
    try:
        compiled(torch.ones(2))
    except Exception as e:  # noqa: BLE001 - rank 1 gets the backend's own error
        return {
            "type": type(e).__name__,
            "message": str(e),
            "seconds": time.monotonic() - start,
            "ranks": list(getattr(e, "ranks", ())),
        }
    return {"type": None}


@pytest.mark.multiprocess
@pytest.mark.release_independent
def test_a_rank_whose_backend_fails_makes_its_peers_raise_at_once_instead_of_waiting():
    outcome = run_ranks(backend_fails_on_rank_1, 2, env=ENV, timeout=120)
    r0, r1 = outcome.results
    assert r1["type"] == "BackendCompilerFailed" and "does not like rank 1" in r1["message"]
    assert r0["type"] == "ProgramDivergenceError", r0
    assert (
        "rank 1 failed to compile this forward graph (ValueError: this backend does not like rank 1) "
        "while the other ranks compiled it"
    ) in r0["message"]
    assert r0["ranks"] == [1]
    assert r0["seconds"] < 20  # well under COMPILER_COLLECTIVES_TIMEOUT


def _print_when_long(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    if x.size(0) > 20:
        print(f"{x.size(0)} rows")  # a graph break on long inputs
    return y.sum()


def break_on_one_rank(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    compiled = torch.compile(_print_when_long, backend="eager")
    # Sizes differ: the dim is dynamic, and each rank's trace takes the branch its own size hint takes.
    result = caught(lambda: compiled(torch.ones(32 if rank == 0 else 8, 4)))
    result["stats"] = cc.stats()
    return result


@pytest.mark.multiprocess
def test_ranks_whose_traces_break_the_graph_in_different_places_raise_at_the_audit_naming_the_break():
    line = line_of(__file__, "a graph break on long inputs")
    for r in run_ranks(break_on_one_rank, 2, env=ENV, timeout=120).results:
        assert r["type"] == "ProgramDivergenceError" and r["level"] == "graph_break", r
        assert "the ranks traced different paths through this frame in the same compile" in r["message"]
        assert f"rank 0: the graph ends at a graph break at test_audit.py:{line}" in r["message"]
        assert "rank 1: no graph break there" in r["message"]
        assert r["ranks"] == [1]  # the odd one out on a tie: rank 0's group is kept
        assert r["seconds"] < 20


def backward_fails_on_rank_1(rank: int, world: int) -> dict:
    from torch._dynamo.backends.common import aot_autograd

    import compiler_collectives as cc

    def forward_compiler(gm, example_inputs):
        return gm.forward

    def backward_compiler(gm, example_inputs):
        if dist.get_rank() == 1:
            raise ValueError("this backward compiler does not like rank 1")
        return gm.forward

    cc.enable()
    compiled = torch.compile(
        lambda x: (x * 3).sin().sum(), backend=aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler)
    )
    x = torch.ones(4, requires_grad=True)  # static: AOTAutograd alone would lower the backward lazily
    try:
        compiled(x)
    except Exception as e:  # noqa: BLE001 - rank 1 gets the backend's own error
        return {
            "type": type(e).__name__,
            "message": str(e),
            "ranks": list(getattr(e, "ranks", ())),
            "where": "forward call",
        }
    return {"type": None}


@pytest.mark.multiprocess
def test_a_backward_that_fails_to_compile_on_one_rank_raises_at_the_forwards_compile_on_every_rank():
    r0, r1 = run_ranks(backward_fails_on_rank_1, 2, env=ENV, timeout=120).results
    assert "does not like rank 1" in r1["message"] and r1["where"] == "forward call", r1
    assert r0["type"] == "ProgramDivergenceError" and r0["where"] == "forward call", r0
    assert (
        "rank 1 failed to compile this forward graph (ValueError: this backward compiler does not like rank 1)"
        in r0["message"]
    )
    assert r0["ranks"] == [1]


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-x", "-q"])
