"""Real distributed workloads under the service, with ranks that see different shapes (issue: workloads)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness import run_ranks
from tests.rankside import GraphRecorder, summary


class MLP(torch.nn.Module):
    # A user-defined module: Dynamo does not start frames inside torch's own
    # files, so DDP around a bare nn.Sequential would compile nothing.
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 256)
        # ~2 MiB of parameters: with 1 MiB buckets DDP (and DDPOptimizer) split it
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(7))
        self.out = torch.nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        for layer in self.hidden:
            x = torch.relu(layer(x))
        return self.out(x)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP()


def ddp_with_ddp_optimizer(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import compiler_collectives as cc

    cc.enable(guards=True)
    torch._dynamo.config.optimize_ddp = True
    rec = GraphRecorder()
    compiled_model = DDP(_mlp(), bucket_cap_mb=1)
    eager_model = DDP(_mlp(), bucket_cap_mb=1)
    compiled = torch.compile(compiled_model, backend=rec)
    same_grads = []
    for step, batch in enumerate((5 + rank, 9 + 3 * rank, 7)):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(batch, 16, generator=g)
        for model in (compiled_model, eager_model):
            model.zero_grad()
        compiled(x).square().mean().backward()
        eager_model(x).square().mean().backward()
        same_grads.append(all(
            torch.allclose(a.grad, b.grad, atol=1e-5)
            for a, b in zip(compiled_model.parameters(), eager_model.parameters())
        ))
    out = summary(rec)
    out["same_grads"] = same_grads
    return out


def test_ddp_with_the_ddp_optimizer_gets_the_same_graphs_and_bucket_split_on_every_rank():
    outcome = run_ranks(ddp_with_ddp_optimizer, 2, timeout=120)
    r0, r1 = outcome.results
    assert r0["same_grads"] == [True] * 3 and r1["same_grads"] == [True] * 3
    # The split fingerprint: one recorded graph per DDPOptimizer submodule,
    # with its input shapes (dynamic dims as "s").
    assert r0["graphs"] == r1["graphs"]
    assert len(r0["graphs"]) > 1, "expected DDPOptimizer to split the graph into buckets"
    assert any("s" in shape for g in r0["graphs"] for shape in g), r0["graphs"]
    # DDP's own forward graph-breaks, so several frames compile: the same on every rank
    assert r0["collectives"] == r1["collectives"] >= 1
    assert r0["compiles"] == r1["compiles"]


def functional_collectives(rank: int, world: int) -> dict:
    import torch.distributed._functional_collectives as funcol

    import compiler_collectives as cc

    cc.enable(guards=True)
    group = dist.group.WORLD

    def f(x: torch.Tensor) -> torch.Tensor:
        local = x.sum(0)  # the rank-dependent dim is reduced away first
        summed = funcol.all_reduce(local, "sum", group)
        gathered = funcol.all_gather_single(local, 0, group)
        scattered = funcol.reduce_scatter_single(gathered, "sum", 0, group)
        return summed * 2 + scattered

    rec = GraphRecorder(backend="aot_eager")
    compiled = torch.compile(f, backend=rec)
    results = []
    # The ranks disagree: rank 0 always has 3 rows, so alone it would keep one
    # static graph; rank 1's rows change, so alone it would recompile with a
    # dynamic dim at its second call, and the graphs' collectives would no
    # longer pair up.
    for n in ((3, 3, 3) if rank == 0 else (4, 8, 7)):
        x = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)
        results.append(bool(torch.allclose(compiled(x), f(x))))
    out = summary(rec)
    out["results"] = results
    return out


def test_ranks_whose_local_shapes_disagree_compile_the_same_functional_collective_graph():
    outcome = run_ranks(functional_collectives, 2, timeout=120)
    r0, r1 = outcome.results
    for r in (r0, r1):
        assert r["results"] == [True] * 3, r
    # Afterwards they agree: one compile each, the row dim dynamic on both, same graph.
    assert r0["graphs"] == r1["graphs"] == [[["s", 4]]], (r0["graphs"], r1["graphs"])
    assert r0["compiles"] == r1["compiles"] == 1


def dtensor_redistribute(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import compiler_collectives as cc

    cc.enable(guards=True)
    mesh = init_device_mesh("cpu", (world,))

    def f(x: torch.Tensor, scale: int) -> torch.Tensor:
        dt = DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
        return dt.redistribute(mesh, [Replicate()]).to_local() * scale

    rec = GraphRecorder(backend="aot_eager")
    compiled = torch.compile(f, backend=rec)
    results = []
    # The ranks disagree: rank 1's scale changes at every call, rank 0's never
    # does. Alone, rank 1 would recompile with a symbolic scale at its second
    # call while rank 0 runs its cached graph, and their all-gathers would not pair up.
    for rows, scale in zip((2, 4, 3, 6), ((2, 2, 2, 2) if rank == 0 else (2, 3, 4, 5))):
        x = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 100 * rank
        results.append(bool(torch.allclose(compiled(x, scale), f(x, scale))))
    out = summary(rec)
    out["results"] = results
    return out


def test_ranks_that_disagree_about_a_scalar_compile_the_same_dtensor_graphs_together():
    outcome = run_ranks(dtensor_redistribute, 2, timeout=180)
    r0, r1 = outcome.results
    for r in (r0, r1):
        assert r["results"] == [True] * 4, r
    # Afterwards they agree: the same graphs, compiled at the same calls, with the
    # scale symbolic on both ranks although rank 0 only ever saw one value.
    assert r0["graphs"] == r1["graphs"], (r0["graphs"], r1["graphs"])
    assert r0["symbolic_ints"] == r1["symbolic_ints"] and r0["symbolic_ints"][-1] >= 1, r0
    assert r0["compiles"] == r1["compiles"] >= 2
    assert r0["collectives"] == r1["collectives"]


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def shapes_change_mid_run(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    rec = GraphRecorder()
    torch.manual_seed(0)
    model = Small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step_fn = torch.compile(model, backend=rec)
    losses = []
    for step in range(12):
        # From step 6 on, rank 1 alone feeds 3-d batches: a recompile on that
        # rank only, which the guard collective turns into one on every rank.
        shape = (4 + step % 3, 8) if (rank == 0 or step < 6) else (2, 4 + step % 3, 8)
        x = torch.ones(shape)
        loss = step_fn(x).sum()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        losses.append(round(loss.item(), 4))
    out = summary(rec)
    out["steps"] = len(losses)
    return out


def test_when_one_rank_changes_shapes_mid_run_every_rank_recompiles_together_and_finishes():
    outcome = run_ranks(shapes_change_mid_run, 2, timeout=120)
    r0, r1 = outcome.results
    assert r0["steps"] == r1["steps"] == 12
    assert r0["compiles"] == r1["compiles"]
    assert r0["collectives"] == r1["collectives"]
    assert r0["forced_recompiles"] >= 1  # rank 0 hit, was overruled, recompiled with rank 1
