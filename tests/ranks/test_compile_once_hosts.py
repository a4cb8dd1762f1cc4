"""Compile once across hosts (issue 37 item 3): its exchanges go over the host tree
(``transport/hosttree.py``), not world-sized all-gathers, and a key per device index settles
without the gather.

Two "hosts" of two ranks (``GROUP_RANK``, as torchrun's agents split them, set in each rank before
our groups exist: the pool's ranks serve these tests), a cache dir per host.
The graph depends on the rank's index on its host, as a GPU job's key holds its device
(``cuda:k``): ranks 0 and 2 share one key, ranks 1 and 3 another. Three graphs: the first gathers
every offer (a generation's first graph learns the dirs); the second is settled by one MIN over
the tree; the third differs between ranks 0 and 2 (index 0 of each host): the MIN sees it and
the gather of offers over the tree plans it. On every graph the results are one gather of the
sources' alone and the load reports are flags. Those graphs are matmuls and views only (no C++
kernel: keys are the subject), told apart by what they multiply (``x @ w``, ``x @ w.t()``, ...).

Where the hosts' builds differ, each compiles its own kernels: that graph has C++ kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.fixtures import cache_per_rank
from tests.harness import run_ranks
from tests.rank_env import rank_env
from tests.rankside import on_host, patch

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.torch_seam,
]

ENV = rank_env(timeout_s=60, inductor_single_thread=True)
INDEX = 0  # the rank's index on its host: Dynamo guards on it, so the graph (and key) differ by it


# Matmuls and views: no C++ kernel, forward or backward. Every graph below is unlike every
# other, so that none finds an entry an earlier one left in its host's dir.


def _first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w if INDEX == 0 else x @ w.t()


def _second(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w) @ w if INDEX == 0 else (x @ w) @ w.t()


RANK = 0


def _third(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Rank 0 differs from rank 2, which has its index: not a key per index any more.
    return (x @ w.t()) @ w if RANK == 0 else (x @ w.t()) @ w.t() if INDEX == 0 else x @ (w @ w)


def job(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    on_host(rank, world, 2)  # ranks 0 and 1 on host 0, ranks 2 and 3 on host 1
    global INDEX, RANK
    INDEX, RANK = rank % 2, rank
    cc.enable()
    out: dict = {"right": [], "stats": []}
    for step in (_first, _second, _third):
        x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10 - 1 + rank
        w_ref = torch.linspace(-1, 1, 16).reshape(4, 4).requires_grad_(True)
        step(x, w_ref).sum().backward()
        w = torch.linspace(-1, 1, 16).reshape(4, 4).requires_grad_(True)
        torch.compile(step, backend="inductor")(x, w).sum().backward()
        out["right"].append(torch.allclose(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6))
        stats = cc.stats()
        out["stats"].append({k: stats[k] for k in ("once_keys_reduced", "once_gathers", "once_tree_exchanges")})
    out["records"] = [(r["state"], r["source"]) for r in cc.stats()["compile_once"]]
    return out


def two_hosts(tmp_path) -> dict[int, dict[str, str]]:
    """Four ranks' cache dirs, one per host (``on_host(rank, 4, 2)``'s)."""
    for host in (0, 1):
        os.makedirs(tmp_path / f"host{host}")
    return cache_per_rank(tmp_path, 4, per_dir=2, name="host")


@pytest.mark.timeout(400)
@pytest.mark.release_independent  # the settling is ours; keys by index: test_compile_once_keys' reduce test
def test_keys_that_differ_by_index_on_a_host_settle_over_the_host_tree_without_a_world_gather(tmp_path):
    per_rank = two_hosts(tmp_path)
    results = run_ranks(job, 4, env=ENV, rank_env=per_rank, timeout=360).results
    for r in results:
        assert r["right"] == [True, True, True], r
        first, second, third = r["stats"]
        # The first graph gathers the offers once; the results and load reports never do.
        assert first["once_gathers"] == 1 and first["once_keys_reduced"] == 0, r
        assert second["once_gathers"] == 1 and second["once_keys_reduced"] == 1, r
        assert third["once_gathers"] == 2 and third["once_keys_reduced"] == 1, r
        # Per graph: the keys, the result broadcasts, the load report's flags.
        assert second["once_tree_exchanges"] - first["once_tree_exchanges"] == 3, r
        assert third["once_tree_exchanges"] - second["once_tree_exchanges"] == 3, r
    assert [results[r]["records"][2][0] for r in (0, 2)] == ["compiled locally"] * 2
    assert sorted(results[r]["records"][2][0] for r in (1, 3)) == ["compiled", "loaded"]
    # Index k's ranks share a key across the hosts: one compiles, the other loads from it.
    for graph in range(2):
        by_index = {k: sorted(results[r]["records"][graph] for r in (k, k + 2)) for k in (0, 1)}
        for k, pair in by_index.items():
            states = sorted(s for s, _ in pair)
            assert states == ["compiled", "loaded"], (graph, k, by_index)
            assert {src for _, src in pair} <= {k, k + 2}, (graph, k, by_index)


def _shared(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """C++ kernels (the relu, the sum, their backward): what a build fingerprint is about."""
    return torch.relu(x @ w).sum()


def job_with_builds(rank: int, world: int) -> dict:
    """Every rank has the same graph; the ranks of host 1 say they build kernels for another CPU."""
    import compiler_collectives as cc
    from compiler_collectives.agreements.once import build

    on_host(rank, world, 2)  # ranks 0 and 1 on host 0, ranks 2 and 3 on host 1
    if os.environ["GROUP_RANK"] == "1":
        real = build.fingerprint
        patch(build, "fingerprint", lambda compiler: "avx512_amx " + real(compiler))  # a host with another CPU
    cc.enable()
    x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10 - 1
    w_ref = torch.linspace(-1, 1, 16).reshape(4, 4).requires_grad_(True)
    _shared(x, w_ref).backward()
    w = torch.linspace(-1, 1, 16).reshape(4, 4).requires_grad_(True)
    torch.compile(_shared, backend="inductor")(x, w).backward()
    with torch.no_grad():
        w -= 0.1 * w.grad  # a step: the parameters every rank ends with
    stats = cc.stats()
    (record,) = stats["compile_once"]
    return {
        "right": torch.allclose(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6),
        "w": w.detach().tolist(),
        "record": {k: record[k] for k in ("state", "source", "why")},
        "bytes_received": stats["once_bytes_received"],
    }


@pytest.mark.timeout(400)
@pytest.mark.release_independent  # the fingerprint's parts: unit tests; kernels served: the warm-cache test
def test_hosts_of_different_build_fingerprints_each_compile_their_own_kernels_with_equal_parameters(tmp_path):
    per_rank = two_hosts(tmp_path)
    results = run_ranks(job_with_builds, 4, env=ENV, rank_env=per_rank, timeout=360).results
    for rank, r in enumerate(results):
        assert r["right"], r
        assert r["w"] == results[0]["w"], (rank, r)
        # Each host's ranks share among themselves; nothing crosses to the other build.
        assert r["record"]["source"] // 2 == rank // 2, (rank, r)
        assert "share no artifact with other builds" in r["record"]["why"], r
        assert r["bytes_received"] == 0, r  # its source shares its cache dir: no byte travels
    for host in (0, 1):
        assert sorted(results[r]["record"]["state"] for r in (2 * host, 2 * host + 1)) == ["compiled", "loaded"]
