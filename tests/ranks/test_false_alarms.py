"""Never stop a correct job: entry agreement looks at collectives only (issue 22).

A frame's cache entries are compared by the collectives they run, per phase,
at the deepest level the backend produced; which levels exist, and whether an
entry has a graph at all, never count. Entries compiled together and then
picked differently at run time by the ranks' own guards must run on when a
job without the service would: the sweep at the end trains small DDP models
through every such case and compares with plain eager training.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.fixtures import shared_cache
from tests.harness import run_ranks
from tests.rank_env import rank_env
from tests.rankside import caught, kept_logs, line_of

# Every test here starts rank processes: the multi-process tier.
pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

TIMEOUT_S = 30
ENV = rank_env(timeout_s=TIMEOUT_S)
# Rows per rank and phase: two compiles together (static, then dynamic with the
# dim <= 20), then the ranks' guards pick different entries (32 rows: the
# static one; 8 rows: the dynamic one), both ways round.
PHASES = [(32, 32), (8, 12), (32, 8), (8, 32), (32, 8)]


# ---------------------------------------------------------------- lazy and eager backwards


def _two_formulas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.size(0) > 20:
        return torch.tanh(x @ w).sum()
    return ((x @ w) ** 2).mean()


def _train_phases(rank: int, step: object, w: torch.Tensor) -> tuple[list[float], torch.Tensor]:
    losses = []
    for rows in PHASES:
        x = torch.arange(rows[rank] * 4, dtype=torch.float32).reshape(rows[rank], 4) / 100
        loss = step(x, w)  # type: ignore[operator]
        loss.backward()
        grad = w.grad.clone()
        dist.all_reduce(grad)  # DDP's all-reduce: outside the graph
        w.grad = None
        with torch.no_grad():
            w -= 0.1 * grad
        losses.append(float(loss))
    return losses, w.detach().tolist()  # plain data: tensors would cross the queue as shared memory


def _against_eager(rank: int, step: object, backend: str) -> dict:
    """Train ``step`` eagerly, then compiled: what the compiled run raised, and both runs' results."""
    import compiler_collectives as cc

    cc.enable(guards=True)
    reference = _train_phases(rank, step, torch.ones(4, 4, requires_grad=True))
    compiled = torch.compile(step, backend=backend)
    run: dict = {}
    out = caught(lambda: run.update(run=_train_phases(rank, compiled, torch.ones(4, 4, requires_grad=True))))
    out.update(run, reference=reference, stats=cc.stats())
    return out


def _assert_ran_as_eager(r: dict) -> None:
    assert r["type"] is None, r
    losses, w = r["run"]
    ref_losses, ref_w = r["reference"]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert torch.allclose(torch.tensor(w), torch.tensor(ref_w), rtol=1e-5)


def static_and_dynamic_entries(rank: int, world: int) -> dict:
    return _against_eager(rank, _two_formulas, "aot_eager")


@pytest.mark.timeout(180)
def test_a_static_entry_beside_a_dynamic_one_without_collectives_runs_on_with_no_entry_check():
    # The static entry's backward would be lowered lazily and the dynamic one's eagerly:
    # neither which levels exist nor when they were lowered makes a program.
    for r in run_ranks(static_and_dynamic_entries, 2, env=ENV, timeout=150).results:
        _assert_ran_as_eager(r)
        assert r["stats"]["entry_mixed_frames"] == 0
        assert r["stats"]["entry_checks"] == 0
        assert r["stats"]["audit_lazy_backwards"] == 0


# ---------------------------------------------------------------- a graph break on some ranks


def _break_when_long(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.size(0) > 20:
        print(f"long input: {x.size(0)} rows")  # a graph break before any tensor operation
    return torch.relu(x @ w).sum()


def graph_break_on_some_ranks(rank: int, world: int) -> dict:
    import logging

    lines = kept_logs("compiler_collectives", "INFO")
    logging.getLogger("compiler_collectives").setLevel(logging.INFO)
    return dict(_against_eager(rank, _break_when_long, "eager"), logs=list(lines))


@pytest.mark.timeout(180)
def test_a_graph_break_taken_by_some_ranks_beside_an_entry_without_collectives_runs_on():
    for r in run_ranks(graph_break_on_some_ranks, 2, env=ENV, timeout=150).results:
        _assert_ran_as_eager(r)
        assert r["stats"]["entry_divergences"] == 0
        # Three calls picked different entries (one with the break, one without):
        # each rank went on alone into its own entry's frames, and met again after.
        assert r["stats"]["diverged_paths"] == 3
        # Our logs were captured: entry agreement's line for the entry that made the frame
        # mixed, where it would also warn of an entry without a graph beside others ...
        mixed = [line for line in r["logs"] if "runs other collectives than entry #0" in line]
        assert len(mixed) == 1, r["logs"]
        # ... which it does not: no entry runs a collective.
        assert not any("without a graph" in line for line in r["logs"]), r["logs"]


# ---------------------------------------------------------------- reset


def _reduce_when_long(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    if x.size(0) > 20:
        x = funcol.all_reduce(x, "sum", dist.group.WORLD)
    return x * 2


def reset_then_calls(rank: int, world: int, how: str) -> dict:
    import compiler_collectives as cc
    from compiler_collectives.agreements import entry as entry_agreement

    cc.enable(guards=True)
    step = torch.compile(_reduce_when_long, backend="aot_eager")
    for rows in PHASES[:2]:  # a static entry that all-reduces, a dynamic one that does not
        step(torch.ones(rows[rank], 4))
    before = cc.stats()
    {"torch.compiler": torch.compiler.reset, "torch._dynamo": torch._dynamo.reset, "ours": cc.reset}[how]()
    frames_after_reset = entry_agreement.frames()
    for _ in range(20):
        step(torch.ones(8, 4))
    after = cc.stats()
    return {
        "mixed_before": before["entry_mixed_frames"],
        "frames_after_reset": frames_after_reset,
        "checks": after["entry_checks"] - before["entry_checks"],
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["torch.compiler", "torch._dynamo", "ours"])
def test_a_reset_clears_entry_agreement_and_later_calls_pay_no_entry_check(how):
    for r in run_ranks(reset_then_calls, 2, args=(how,), env=ENV, timeout=200).results:
        assert r["mixed_before"] == 1
        assert r["frames_after_reset"] == {}
        assert r["checks"] == 0


# ---------------------------------------------------------------- scopes name global ranks


def _stage_step(x: torch.Tensor, group_name: str) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    if x.size(0) > 20:
        x = funcol.all_reduce(x, "sum", group_name)  # stage all_reduce
    return x * 2


def scoped_entries(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    stage_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stage = stage_groups[rank // 2]
    cc.scope(stage)
    cc.enable(guards=True)
    step = torch.compile(_stage_step, backend="aot_eager")
    dp = rank % 2
    name = stage.group_name
    out: dict = {}
    for phase, rows in enumerate(PHASES[:3]):
        if rank < 2:
            rows = (8, 8)  # stage 0 stays on one entry
        out = caught(lambda rows=rows: step(torch.ones(rows[dp], 4), name))
        if out["type"] is not None:
            out["phase"] = phase
            break
    return out


@pytest.mark.timeout(240)
def test_under_a_scope_an_entry_divergence_names_global_ranks_in_its_message_and_fields():
    results = run_ranks(scoped_entries, 4, env=ENV, timeout=200).results
    assert results[0]["type"] is None and results[1]["type"] is None, results[:2]
    for rank in (2, 3):
        r = results[rank]
        assert r["type"] == "ProgramDivergenceError" and r["phase"] == 2, r
        assert "entry collective #" in r["message"] and f"on rank {rank}" in r["message"]
        assert "rank 2: cache entry #0" in r["message"], r["message"]
        assert "rank 3: cache entry #1" in r["message"], r["message"]
        assert "rank 0" not in r["message"] and "rank 1:" not in r["message"]
        assert r["ranks"] == [3]  # the odd one out on a tie: rank 2's group is kept
        line = line_of(__file__, "stage all_reduce")
        assert f"test_false_alarms.py:{line}" in r["message"]


# ---------------------------------------------------------------- backwards that differ are caught


class _ReduceGrad(torch.autograd.Function):
    """Identity forward; the backward all-reduces the gradient."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(grad, "sum", dist.group.WORLD)  # backward all_reduce


def _reduce_grad_when_long(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = x @ w
    if x.size(0) > 20:
        y = _ReduceGrad.apply(y)
    return y.sum()


def backwards_differ(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    step = torch.compile(_reduce_grad_when_long, backend="aot_eager")
    w = torch.ones(4, 4, requires_grad=True)
    backwards_run = []
    w.register_hook(lambda g: backwards_run.append(True))
    out: dict = {}
    for phase, rows in enumerate(PHASES[:3]):
        out = caught(lambda rows=rows: step(torch.ones(rows[rank], 4), w).backward())
        if out["type"] is not None:
            out["phase"] = phase
            break
    out["backwards_run"] = len(backwards_run)
    return out


@pytest.mark.timeout(180)
def test_entries_whose_backwards_run_different_collectives_are_caught_before_any_rank_runs_one():
    line = line_of(__file__, "backward all_reduce")
    for r in run_ranks(backwards_differ, 2, env=ENV, timeout=150).results:
        assert r["type"] == "ProgramDivergenceError" and r["phase"] == 2, r
        assert r["level"] == "backward"
        assert "collective #1 of the backward program" in r["message"]
        assert "rank 0: cache entry #0, compile 0/0" in r["message"]
        assert "rank 1: cache entry #1, compile 0/1" in r["message"]
        assert f"test_false_alarms.py:{line} in backward" in r["message"]
        assert r["backwards_run"] == 2  # phases 0 and 1 only: phase 2 ran neither forward nor backward


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-x", "-q"])


# ---------------------------------------------------------------- the sweep: nothing raises


class _Net(torch.nn.Module):
    """Matmuls only, forward and backward (no bias, no activation; the loss is taken outside):
    inductor builds no C++ kernel for any of its entries. What is tested is which entries the
    ranks run, not the kernels: the two formulas differ by a permutation of the hidden features,
    so an entry run for the wrong rows would not match eager training."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16, bias=False)
        self.out = torch.nn.Linear(16, 4, bias=False)
        self.swap = torch.eye(16).roll(1, 0)  # a constant, not a parameter or buffer: DDP leaves it be

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if x.size(0) > 20:  # a branch on the size: long inputs take another formula ...
            print(f"rank {dist.get_rank()}: {x.size(0)} rows")  # ... and a graph break
            h = h @ self.swap
        return self.out(h)


# Per rank, per step: the rows of two micro-batches (gradient accumulation: two
# forwards, then one backward). Steps 0-1 compile together (static, then dynamic
# below 21 rows); later steps let each rank's guards pick its own entries.
SWEEP = [((32, 32), (32, 32)), ((8, 12), (9, 13)), ((32, 8), (8, 32)), ((10, 32), (32, 11)), ((32, 32), (8, 8))]


def _sweep_train(rank: int, model: torch.nn.Module, step: object) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for micro in SWEEP:
        loss = sum(
            step(torch.linspace(-1, 1, micro[m][rank] * 8).reshape(-1, 8) * (m + 1)).pow(2).mean()  # type: ignore[operator]
            for m in range(2)
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def sweep(rank: int, world: int, backend: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import compiler_collectives as cc

    cc.enable(guards=True)
    torch.manual_seed(0)
    net = _Net()
    reference = DDP(_Net())
    reference.load_state_dict(DDP(net).state_dict())
    ref_losses = _sweep_train(rank, reference, reference)
    model = DDP(net)
    run: dict = {}
    out = caught(lambda: run.update(losses=_sweep_train(rank, model, torch.compile(model, backend=backend))))
    out.update(
        run,
        ref_losses=ref_losses,
        stats=cc.stats(),
        params=[p.detach() for p in model.parameters()],
        ref_params=[p.detach() for p in reference.parameters()],
    )
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_ddp_training_whose_ranks_pick_different_entries_runs_on_and_matches_eager(backend, tmp_path):
    env = rank_env(
        timeout_s=TIMEOUT_S, extra={**shared_cache(tmp_path, "inductor"), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    )
    tolerance = 1e-3 if backend == "inductor" else 1e-5
    for r in run_ranks(sweep, 2, args=(backend,), env=env, timeout=540).results:
        assert r["type"] is None, r
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=tolerance)
        for p, ref in zip(r["params"], r["ref_params"]):
            assert torch.allclose(p, ref, rtol=tolerance, atol=tolerance * 1e-2)
        assert r["stats"]["entry_divergences"] == 0 and r["stats"]["audit_divergences"] == 0
        assert r["stats"]["diverged_paths"] >= 1  # the ranks did take different entries
