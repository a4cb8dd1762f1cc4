"""Compile once's keys: what a graph's key is made of, and how the ranks settle theirs.

What a key is made of (issue 29, part 2). The service lowers a graph's backward with its forward
(``force_non_lazy_backward_lowering``), a setting that is part of AOTAutograd's cache key. Keyed
with it, every graph would get another key than a run without the service, and no cache warmed
without it (a 1-rank run, a job with the service off) would ever serve a job with it on. The key
is computed with the user's own setting.

How they are settled (issue 30 item 3, issue 37 item 3): when every rank has the same key, one
reduce of a fixed record settles it, whatever the world size; so does a key that differs by the
rank's index on its host (a GPU job's device) and is the same for that index on every host. The
all-gather of every offer runs only at a generation's first graph and where keys differ otherwise
(``tests/ranks/test_compile_once_hosts.py`` has two hosts).

Real ranks, real inductor compiles on CPU (gloo), a cache dir per rank. ``one_step``: one training
step of a small graph. ``three_graphs``: three training steps in one job: the first graph gathers
every offer (it learns the dirs), the second is settled by the reduce (one rank compiles, the
other loads), the third differs by rank, that is by index on the host (the reduce settles it too:
each rank's key is its own, and each compiles locally).

Keys, not kernels, are the subject here: every graph is matmuls and views only (inductor calls the
library for each, forward and backward, and builds no C++ kernel), its gradient taken against a
sum computed eagerly, outside the graph. The graphs still differ where their keys must: by what
they multiply (``x @ w``, ``x @ w.t()``, ``(x @ w) @ w``).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tests.fixtures import cache_per_rank
from tests.harness import run_ranks
from tests.rank_env import rank_env
from tests.ranks.test_compile_once import _step  # a matmul: no C++ kernel, forward or backward

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.torch_seam,
]

ENV = rank_env(timeout_s=60, inductor_single_thread=True)


# ---------------------------------------------------------------- what a key is made of


def one_step(rank: int, world: int, service: bool) -> dict:
    """One compiled training step, with the service on or off; the cache keys it left."""
    from torch._dynamo.utils import counters

    if service:
        import compiler_collectives as cc

        cc.enable()
    x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10 - 1
    w = torch.linspace(-1, 1, 16).reshape(4, 4).requires_grad_(True)
    torch.compile(_step, backend="inductor")(x, w).sum().backward()
    root = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    return {
        "grad": w.grad.flatten().tolist(),
        "aot_keys": sorted(os.listdir(os.path.join(root, "aotautograd"))),
        "fx_keys": sorted(
            k for d in os.listdir(os.path.join(root, "fxgraph")) for k in os.listdir(os.path.join(root, "fxgraph", d))
        ),
        "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
        "records": cc.stats()["compile_once"] if service else [],
    }


def _run(dirs: list[str], service: bool) -> list[dict]:
    per_rank = {r: {"TORCHINDUCTOR_CACHE_DIR": d} for r, d in enumerate(dirs)}
    return run_ranks(one_step, 2, args=(service,), env=ENV, rank_env=per_rank, timeout=240).results


@pytest.fixture(scope="module")
def warmed_off(tmp_path_factory) -> tuple[list[str], list[dict]]:
    """Two cache dirs warmed by a 2-rank job with the service off; what that job saw."""
    base = tmp_path_factory.mktemp("warmed-off")
    dirs = [str(base / f"rank{r}") for r in range(2)]
    return dirs, _run(dirs, service=False)


def _copies(dirs: list[str], dest) -> list[str]:
    out = []
    for r, d in enumerate(dirs):
        shutil.copytree(d, dest / f"rank{r}", symlinks=True)
        out.append(str(dest / f"rank{r}"))
    return out


@pytest.mark.timeout(400)
def test_a_cache_warmed_with_the_service_off_is_keyed_alike_and_serves_a_job_with_it_on(tmp_path, warmed_off):
    """Warmed with the service off, then run with it on: the same AOTAutograd keys and FX graph
    compiles as a cold run with it on (the same entry either way), and every rank's lookup hits."""
    dirs, off = warmed_off
    cold_on = _run([str(tmp_path / f"cold{r}") for r in range(2)], service=True)
    for r in range(2):
        assert off[r]["aot_keys"] and off[r]["fx_keys"], off[r]  # the step was cached at both levels
        assert cold_on[r]["aot_keys"] == off[r]["aot_keys"], "the service changed the AOTAutograd cache key"
        assert cold_on[r]["fx_keys"] == off[r]["fx_keys"], "the service compiled other inductor graphs"
    warm_on = _run(_copies(dirs, tmp_path), service=True)
    assert [r["aot_hits"] for r in warm_on] == [1, 1]
    assert [r["aot_keys"] for r in warm_on] == [r["aot_keys"] for r in off]
    assert sorted(r["records"][-1]["state"] for r in warm_on) == ["loaded", "served"]
    for r in warm_on:
        assert r["grad"] == pytest.approx(off[0]["grad"], rel=1e-6)


@pytest.mark.timeout(300)
def test_a_loader_whose_lookup_hits_its_own_entry_runs_it_as_its_own_cache_hit(tmp_path, warmed_off):
    """Rank 1's cache holds its own entry for the key, named to come first in torch's lookup (it
    tries a key's entries in name order): its lookup hits that one, not the one rank 0 sent, and
    compile once says so instead of taking rank 0's fingerprints for it."""
    dirs, _ = warmed_off
    mine = _copies(dirs, tmp_path)
    (key,) = os.listdir(os.path.join(mine[1], "aotautograd"))
    entry_dir = os.path.join(mine[1], "aotautograd", key)
    (entry,) = os.listdir(entry_dir)
    os.rename(os.path.join(entry_dir, entry), os.path.join(entry_dir, "0" * len(entry)))
    results = _run(mine, service=True)
    loader = results[1]["records"][-1]
    assert (loader["state"], loader["source"]) == ("loaded", 0)
    assert "hit an entry this rank's cache already held for its key, not the one rank 0 sent" in loader["why"]
    assert results[1]["aot_hits"] == 1
    assert results[1]["grad"] == pytest.approx(results[0]["grad"], rel=1e-6)


@pytest.mark.timeout(300)
def test_where_no_rank_holds_the_entry_the_rank_whose_fx_graph_cache_is_warm_compiles(tmp_path):
    """Rank 0's dir lost its AOTAutograd entries but keeps the FX graph compiles the key took
    there; rank 1's is empty. Rank 0 compiles (from its FX graph cache), not the rank whose
    turn it is (rank 1, for the first graph), and rank 1 loads."""
    first = _run([str(tmp_path / "a0"), str(tmp_path / "a1")], service=True)
    compiled = next(r for r, res in enumerate(first) if res["records"][-1]["state"] == "compiled")
    assert compiled == 1, "the turn changed: this test needs the rank that compiles a first graph cold"
    warm = tmp_path / "warm"
    shutil.copytree(tmp_path / "a1", warm, symlinks=True)
    shutil.rmtree(warm / "aotautograd")
    results = _run([str(warm), str(tmp_path / "empty")], service=True)
    rank0, rank1 = (r["records"][-1] for r in results)
    assert rank0["state"] == "compiled" and "warm FX graph cache" in rank0["why"]
    assert (rank1["state"], rank1["source"]) == ("loaded", 0)
    assert results[0]["fx_hits"] > 0
    assert results[1]["grad"] == pytest.approx(results[0]["grad"], rel=1e-6)


# ---------------------------------------------------------------- how the ranks settle keys

RANK = 0  # set per rank: Dynamo guards on it, so the third graph differs by rank

# Three graphs of matmuls and views (no C++ kernel), each unlike the others, so that no graph
# finds an entry an earlier one left in its rank's dir.


def _first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


def _second(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w) @ w


def _third(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t() if RANK == 0 else (x @ w.t()) @ w


def three_graphs(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    global RANK
    RANK = rank
    out: dict = {"right": [], "reduced": []}
    for step in (_first, _second, _third):
        x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10 - 1 + rank
        w_ref = torch.linspace(-1, 1, 16).reshape(4, 4).requires_grad_(True)
        step(x, w_ref).sum().backward()
        w = torch.linspace(-1, 1, 16).reshape(4, 4).requires_grad_(True)
        torch.compile(step, backend="inductor")(x, w).sum().backward()
        out["right"].append(torch.allclose(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6))
        out["reduced"].append(cc.stats()["once_keys_reduced"])
    out["states"] = [r["state"] for r in cc.stats()["compile_once"]]
    return out


@pytest.mark.timeout(400)
def test_keys_after_the_first_graph_equal_or_differing_by_host_index_are_settled_by_the_reduce(tmp_path):
    dirs = cache_per_rank(tmp_path, 2, name="dir")
    results = run_ranks(three_graphs, 2, env=ENV, rank_env=dirs, timeout=300).results
    for r in results:
        assert r["right"] == [True, True, True], r
        assert r["reduced"] == [0, 1, 2], r  # the first graph gathers
    states = [sorted(s) for s in zip(*(r["states"] for r in results))]
    assert states == [["compiled", "loaded"], ["compiled", "loaded"], ["compiled locally", "compiled locally"]]
