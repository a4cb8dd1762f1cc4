"""Compile once's key exchange (issue 30 item 3, issue 37 item 3): when every rank has the same
key, one reduce of a fixed record settles it, whatever the world size; so does a key that differs
by the rank's index on its host (a GPU job's device) and is the same for that index on every host.
The all-gather of every offer runs only at a generation's first graph and where keys differ
otherwise (``tests/ranks/test_compile_once_hosts.py`` has two hosts).

Two real ranks of one host with a cache dir each, three inductor training steps in one job: the
first graph gathers every offer (it learns the dirs), the second is settled by the reduce (one
rank compiles, the other loads), the third differs by rank, that is by index on the host (the
reduce settles it too: each rank's key is its own, and each compiles locally).
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures import cache_per_rank
from tests.harness import run_ranks
from tests.rank_env import rank_env

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.torch_seam,
]

ENV = rank_env(timeout_s=60, inductor_single_thread=True)
RANK = 0  # set per rank: Dynamo guards on it, so the third graph differs by rank


def _first(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w).sum()


def _second(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x @ w).sum()


def _third(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w) if RANK == 0 else torch.sin(x @ w)).sum()


def job(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    global RANK
    RANK = rank
    out: dict = {"right": [], "reduced": []}
    for step in (_first, _second, _third):
        x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10 - 1 + rank
        w_ref = torch.linspace(-1, 1, 16).reshape(4, 4).requires_grad_(True)
        step(x, w_ref).backward()
        w = torch.linspace(-1, 1, 16).reshape(4, 4).requires_grad_(True)
        torch.compile(step, backend="inductor")(x, w).backward()
        out["right"].append(torch.allclose(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6))
        out["reduced"].append(cc.stats()["once_keys_reduced"])
    out["states"] = [r["state"] for r in cc.stats()["compile_once"]]
    return out


@pytest.mark.timeout(400)
def test_keys_after_the_first_graph_equal_or_differing_by_host_index_are_settled_by_the_reduce(tmp_path):
    dirs = cache_per_rank(tmp_path, 2, name="dir")
    results = run_ranks(job, 2, env=ENV, rank_env=dirs, timeout=300).results
    for r in results:
        assert r["right"] == [True, True, True], r
        assert r["reduced"] == [0, 1, 2], r  # the first graph gathers
    states = [sorted(s) for s in zip(*(r["states"] for r in results))]
    assert states == [["compiled", "loaded"], ["compiled", "loaded"], ["compiled locally", "compiled locally"]]
