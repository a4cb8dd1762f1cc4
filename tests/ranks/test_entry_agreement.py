"""Entry agreement: every rank runs a cache entry with the same collective program, on every call (issue 16)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks
from tests.rank_env import rank_env
from tests.rankside import caught, line_of

# Every test here starts rank processes: the multi-process tier.
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_seam]

TIMEOUT_S = 30
ENV = rank_env(timeout_s=TIMEOUT_S)
TRANSPORTS = ["auto", "gloo"]


# ---------------------------------------------------------------- the three phases


def _step(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    if x.size(0) > 20:
        x = funcol.all_reduce(x, "sum", dist.group.WORLD)  # the lone all_reduce
    return x * 2


def three_phases(rank: int, world: int) -> dict:
    import compiler_collectives as cc
    from compiler_collectives.agreements import entry as entry_agreement

    cc.enable(guards=True)
    step = torch.compile(_step, backend="aot_eager")
    phases = [(32, 32), (8, 12), (32, 8)]
    out: dict = {"phases": []}
    for phase, rows in enumerate(phases):
        result = caught(lambda rows=rows: step(torch.ones(rows[rank], 4)))
        out["phases"].append(result)
        if result["type"] is not None:
            break
        dist.all_reduce(torch.ones(3 + phase))  # the loop's next collective
        if phase == 1:
            out["after_phase_1"] = cc.stats()
    out["stats"] = cc.stats()
    out["frames"] = entry_agreement.frames()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ranks_hitting_entries_with_different_collectives_raise_before_the_lone_all_reduce_runs(transport):
    env = rank_env(timeout_s=TIMEOUT_S, guard_transport=transport)
    outcome = run_ranks(three_phases, 2, env=env, timeout=180)  # a rank killed by a signal fails here
    line = line_of(__file__, "the lone all_reduce")
    for _rank, r in enumerate(outcome.results):
        p0, p1, p2 = r["phases"]
        assert p0["type"] is None and p1["type"] is None, r
        # phases 0 and 1 left two entries with different programs: checks from then on
        assert r["after_phase_1"]["entry_mixed_frames"] == 1
        assert r["after_phase_1"]["entry_divergences"] == 0
        assert p2["type"] == "ProgramDivergenceError", p2
        message = p2["message"]
        assert "the ranks hit different cache entries of this frame" in message
        assert "no rank has run its entry" in message
        assert "rank 0: cache entry #0, compile 0/0" in message
        assert "rank 1: cache entry #1, compile 0/1" in message
        assert "_c10d_functional.all_reduce.default(sum) on ranks [0, 1]" in message
        assert f"test_entry_agreement.py:{line} in _step" in message
        assert "no collective #1 (0 collective(s) in all)" in message
        assert p2["seconds"] < 20
        assert r["stats"]["entry_divergences"] == 1
        (entries,) = r["frames"].values()
        assert [e["compile_id"] for e in entries] == ["0/0", "0/1"]


# ---------------------------------------------------------------- LRU order

_REDUCE = {"now": True}


@torch._dynamo.assume_constant_result
def _reduce_now() -> bool:
    return _REDUCE["now"]  # read at trace time, never guarded: each entry keeps its own answer


def _two_inputs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    s = x.sum() + y.sum()
    if _reduce_now():
        s = funcol.all_reduce(s, "sum", dist.group.WORLD)  # LRU all_reduce
    return s


def _dyn(n: int) -> torch.Tensor:
    t = torch.ones(n)
    torch._dynamo.mark_dynamic(t, 0)
    return t


def lru_order(rank: int, world: int, programs: str) -> dict:
    import compiler_collectives as cc

    torch._dynamo.config.automatic_dynamic_shapes = False  # dynamic only where marked
    cc.enable(guards=True)
    f = torch.compile(_two_inputs, backend="aot_eager")
    reduce_in = {"differ": (True, False, True, False), "agree": (True, True, True, True)}[programs]
    # Every rank creates four entries, in the same order (E0..E3):
    for reduce, (x, y) in zip(
        reduce_in,
        [
            (_dyn(6), torch.ones(4)),  # E0: x any, y 4
            (torch.ones(4), _dyn(6)),  # E1: x 4, y any
            (torch.ones(8), _dyn(6)),  # E2: x 8, y any
            (torch.ones(10), _dyn(6)),
        ],
    ):  # E3: x 10, y any
        _REDUCE["now"] = reduce
        f(x, y)
    # Then each rank touches other entries (with the same program at each call),
    # so that the first entry accepting (4 rows, 4 rows) is E0 on rank 0, E1 on rank 1:
    f(*((torch.ones(6), torch.ones(4)) if rank == 0 else (torch.ones(8), torch.ones(6))))  # E0 | E2
    f(*((torch.ones(10), torch.ones(6)) if rank == 0 else (torch.ones(4), torch.ones(6))))  # E3 | E1
    before = cc.stats()
    result = caught(lambda: f(torch.ones(4), torch.ones(4)))
    return {"result": result, "before": before, "after": cc.stats()}


@pytest.mark.timeout(300)
def test_lru_order_differing_across_ranks_with_entries_whose_programs_differ_raises():
    outcome = run_ranks(lru_order, 2, args=("differ",), env=ENV, timeout=240)
    line = line_of(__file__, "LRU all_reduce")
    for r in outcome.results:
        assert r["before"]["entry_divergences"] == 0 and r["before"]["compiler_collectives"] == 4
        assert r["result"]["type"] == "ProgramDivergenceError", r
        message = r["result"]["message"]
        assert "rank 0: cache entry #0, compile 0/0" in message
        assert "rank 1: cache entry #1, compile 0/1" in message
        assert f"test_entry_agreement.py:{line} in _two_inputs" in message
        assert r["after"]["compiler_collectives"] == 4  # both hit: nothing recompiled


@pytest.mark.timeout(300)
def test_lru_order_differing_across_ranks_with_entries_whose_programs_agree_costs_no_check():
    outcome = run_ranks(lru_order, 2, args=("agree",), env=ENV, timeout=240)
    for r in outcome.results:
        assert r["result"]["type"] is None, r
        before, after = r["before"], r["after"]
        assert after["entry_mixed_frames"] == 0
        assert after["entry_checks"] == 0  # no extra collective ...
        assert after["guard_collectives"] - before["guard_collectives"] == 1  # ... beside the guard's
        assert after["compiler_collectives"] == before["compiler_collectives"] == 4  # a hit on both


# ---------------------------------------------------------------- inductor: one rank's cache warm


def _reduce_a_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """An all_reduce of a matmul's output: inductor reduces the mm's buffer in place, so the graph
    has no C++ kernel to build (a graph input would be copied by one) in each of the six compiles
    below. What is tested is the cache and the audit, not the kernels."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x @ w, "sum", dist.group.WORLD)  # cached all_reduce


def inductor_with_caches(rank: int, world: int, swap_reduce_op_on_rank_1: bool) -> dict:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    import compiler_collectives as cc

    class SwapReduceOp(CustomGraphPass):
        """A post-grad pass whose cache identity hides what it does: sum becomes max when on."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            if swap_reduce_op_on_rank_1 and dist.get_rank() == 1:
                for node in graph.nodes:
                    if node.target is torch.ops._c10d_functional.all_reduce.default:
                        node.args = (node.args[0], "max", *node.args[2:])

        def uuid(self) -> str:
            return "swap-reduce-op"  # the same whether on or off: a cache hit cannot tell

    torch._inductor.config.post_grad_custom_post_pass = SwapReduceOp()
    cc.enable(guards=True)
    compiled = torch.compile(_reduce_a_product, backend="inductor")
    out = caught(lambda: compiled(torch.ones(4, 2), torch.ones(2, 2)))
    out["stats"] = cc.stats()
    return out


@pytest.mark.timeout(1300)
def test_a_rank_with_a_warm_inductor_cache_still_has_every_level_compared_and_a_cached_divergencecaught(tmp_path):
    dirs = {name: str(tmp_path / name) for name in ("warm", "cold_a", "cold_b", "cold_c")}

    def run(rank0: str, swap: bool):
        per_rank = {0: {"TORCHINDUCTOR_CACHE_DIR": dirs[rank0]}, 1: {"TORCHINDUCTOR_CACHE_DIR": dirs["warm"]}}
        # The cold rank compiles while the warm one waits: a loaded box needed minutes for C++ kernels.
        # Compile once off: with it the warm rank would serve its entry to the cold one and nothing
        # would be compiled again; this is the audit's own path, for keys that differ across ranks.
        env = rank_env(timeout_s=180, compile_once=False)
        return run_ranks(inductor_with_caches, 2, args=(swap,), env=env, rank_env=per_rank, timeout=400).results

    warmup = run("cold_a", False)  # fills rank 1's cache dir
    assert [r["type"] for r in warmup] == [None, None], warmup
    assert all(r["stats"]["audit_cache_recompiles"] == 0 for r in warmup)

    # Rank 1 loads the graph from its cache, rank 0 compiles it.
    same = run("cold_b", False)
    for rank, r in enumerate(same):
        assert r["type"] is None, r
        assert r["stats"]["audit_cache_recompiles"] == (1 if rank == 1 else 0)
        assert r["stats"]["audit_levels_not_compared"] == 0  # every level compared on both ranks
        assert r["stats"]["audit_exchanges"] == 2  # the first found levels missing on rank 1

    # Now rank 1's post-grad pass changes the reduce op, but its cache entry
    # still matches: only compiling again shows the difference.
    swapped = run("cold_c", True)
    line = line_of(__file__, "cached all_reduce")
    for r in swapped:
        assert r["type"] == "ProgramDivergenceError", r
        assert r["level"] == "inductor_forward"
        assert "rank 1: _c10d_functional.all_reduce_.default(max)" in r["message"]
        assert "rank 0: _c10d_functional.all_reduce_.default(sum)" in r["message"]
        assert f"test_entry_agreement.py:{line} in _reduce_a_product" in r["message"]


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-x", "-q"])
