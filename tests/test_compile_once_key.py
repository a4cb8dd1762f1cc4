"""A warm cache stays warm when the service is turned on (issue 29, part 2).

The service lowers a graph's backward with its forward (``force_non_lazy_backward_lowering``),
a setting that is part of AOTAutograd's cache key. Keyed with it, every graph would get another
key than a run without the service, and no cache warmed without it (a 1-rank run, a job with the
service off) would ever serve a job with it on. The key is computed with the user's own setting.

Real ranks, real inductor compiles on CPU (gloo): one training step of a small graph, a cache
dir per rank.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_ranks

pytestmark = pytest.mark.multiprocess

ENV = {"COMPILER_COLLECTIVES_TIMEOUT": "60", "TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "1"}


def _step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w).sum()


def job(rank: int, world: int, service: bool) -> dict:
    """One compiled training step, with the service on or off; the cache keys it left."""
    from torch._dynamo.utils import counters

    if service:
        import compiler_collectives as cc

        cc.enable()
    x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10 - 1
    w = torch.linspace(-1, 1, 16).reshape(4, 4).requires_grad_(True)
    torch.compile(_step, backend="inductor")(x, w).backward()
    root = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    return {
        "grad": w.grad.flatten().tolist(),
        "aot_keys": sorted(os.listdir(os.path.join(root, "aotautograd"))),
        "fx_keys": sorted(
            k for d in os.listdir(os.path.join(root, "fxgraph")) for k in os.listdir(os.path.join(root, "fxgraph", d))
        ),
        "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "records": cc.stats()["compile_once"] if service else [],
    }


def _run(dirs: list[str], service: bool) -> list[dict]:
    rank_env = {r: {"TORCHINDUCTOR_CACHE_DIR": d} for r, d in enumerate(dirs)}
    return run_ranks(job, 2, args=(service,), env=ENV, rank_env=rank_env, timeout=240).results


@pytest.mark.timeout(400)
def test_a_cache_warmed_with_the_service_off_is_keyed_alike_and_serves_a_job_with_it_on(tmp_path):
    """Warmed with the service off, then run with it on: the same AOTAutograd keys and FX graph
    compiles as a cold run with it on (the same entry either way), and every rank's lookup hits."""
    warm = [str(tmp_path / f"warm{r}") for r in range(2)]
    off = _run(warm, service=False)
    cold_on = _run([str(tmp_path / f"cold{r}") for r in range(2)], service=True)
    for r in range(2):
        assert cold_on[r]["aot_keys"] == off[r]["aot_keys"], "the service changed the AOTAutograd cache key"
        assert cold_on[r]["fx_keys"] == off[r]["fx_keys"], "the service compiled other inductor graphs"
    warm_on = _run(warm, service=True)
    assert [r["aot_hits"] for r in warm_on] == [1, 1]
    assert [r["aot_keys"] for r in warm_on] == [r["aot_keys"] for r in off]
    assert sorted(r["records"][-1]["state"] for r in warm_on) == ["loaded", "served"]
    for r in warm_on:
        assert r["grad"] == pytest.approx(off[0]["grad"], rel=1e-6)
