"""``destroy_process_group()`` with the package: as quick to let go of the store as torch alone (issue 36).

A job that destroys its default group and at once initializes a new one on
the same port (in-process restarts, notebooks, test suites) relies on the
store's server closing its port within torch's own destroy: a rank that
re-initializes first meets the old server while it is still up, and both
ranks hang. Our part of a destroy lets go of the store before torch's
teardown and runs our moment only after it (``dynamo/c10d_seam.py``).

Torch alone has the same race, with a window of its own destroy's length
(20-30 ms on the store's host): ranks that re-initialize the very moment their
own destroy returned hang now and then without the package too. So here the
store's host destroys last, and the other rank re-initializes a fixed while
after it entered its destroy (``REINIT_AFTER_S``): longer than torch's window,
shorter than ours was.

Each test runs real gloo ranks and real torch.compile under a hard deadline;
every wait of theirs is short, so a hang fails within seconds.
"""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import free_port, run_ranks
from tests.rank_env import rank_env
from tests.rankside import init_gloo, patch

# Every test here starts rank processes; re-init goes through c10d's store and gloo's set-up.
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_seam]

# A rank that meets the old store waits in init_process_group for its timeout: short here.
INIT_TIMEOUT_S = 10.0
# When the other ranks re-initialize: this long after rank 0 (the store's host), the last to
# destroy, entered its destroy. Torch's own takes it 20-30 ms; ours took 200-500 ms before issue 36.
REINIT_AFTER_S = 0.2


def _accepts(port: int) -> bool:
    """Whether something still accepts connections on ``port`` of this host."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _tiny(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def generations_back_to_back(
    rank: int, world: int, ports: list[int], generations: int, coordination: str, package: bool
) -> list[float]:
    if package:  # (without: the same job with torch alone, which passes too)
        import compiler_collectives as cc

        cc.enable(guards=True)
    f = torch.compile(_tiny, backend="eager")
    # Only to time the re-init (see REINIT_AFTER_S): never waited on for the store itself.
    clock = dist.FileStore(coordination, world)
    values = []
    for port in ports:
        for generation in range(generations):
            init_gloo(rank, world, f"tcp://127.0.0.1:{port}", timeout_s=INIT_TIMEOUT_S)
            values.append(float(f(torch.ones(2)).sum()) + float(f(torch.ones(2)).sum()))
            dist.barrier()
            key = f"{port}/{generation}"
            if rank == 0:  # the store's host destroys last, as a rank with more to do before it would
                clock.wait([f"{key}/others"])
                clock.set(key, repr(time.time()))
                dist.destroy_process_group()
            else:
                dist.destroy_process_group()
                if clock.add(f"{key}/done", 1) == world - 1:
                    clock.set(f"{key}/others", "")
                entered = float(clock.get(key))
                time.sleep(max(0.0, entered + REINIT_AFTER_S - time.time()))
    return values


@pytest.mark.timeout(150)
def test_generations_on_the_same_port_back_to_back_never_hang(tmp_path):
    """Ten times three generations on one port each, guards on (our groups, channel and heartbeat
    made and let go each time). Before the fix nearly every such job hung."""
    rounds, generations = 10, 3
    outcome = run_ranks(
        generations_back_to_back,
        2,
        args=([free_port() for _ in range(rounds)], generations, str(tmp_path / "clock"), True),
        env=rank_env(timeout_s=10),
        init=False,
        timeout=120,
    )
    for values in outcome.results:
        assert values == [12.0] * (rounds * generations)


def when_our_moment_runs(rank: int, world: int, port: int) -> dict:
    import dataclasses

    import compiler_collectives as cc
    from compiler_collectives import runtime
    from compiler_collectives.dynamo import bound

    seen: dict[str, bool] = {}

    # The moment that ends our generation, as the c10d seam runs it, looks first whether the old
    # store's port is still open.
    ours = bound.moments.default_group_destroyed

    def probed() -> None:
        seen.setdefault("open_during_our_moment", _accepts(port))
        ours()

    patch(bound, "moments", dataclasses.replace(bound.moments, default_group_destroyed=probed))

    cc.enable(guards=True)
    f = torch.compile(_tiny, backend="eager")
    init_gloo(rank, world, f"tcp://127.0.0.1:{port}", timeout_s=INIT_TIMEOUT_S)
    f(torch.ones(2))
    f(torch.ones(2))
    # A subgroup's destroy is torch's alone: our generation goes on.
    before = runtime.current().generation.number
    subgroup = dist.new_group([0, 1])
    # Both ranks out of new_group first: a rank that destroys the subgroup while its peer still
    # connects gloo's mesh closes that connection under it ("connectFullMesh failed").
    dist.barrier()
    dist.destroy_process_group(subgroup)
    del subgroup  # (a group the user still holds keeps the store, with torch alone too)
    seen["subgroup_kept_generation"] = runtime.current().generation.number == before and not seen
    f(torch.ones(2))
    dist.barrier()
    dist.destroy_process_group()
    seen["open_after_destroy"] = _accepts(port)
    seen["new_generation"] = runtime.current().generation.number == before + 1
    return seen


def test_our_teardown_runs_only_once_the_old_stores_port_is_closed():
    """Rank 0 hosts the store: by the time our moment runs, torch's teardown has closed the
    store's server, so nothing of ours held it (and no garbage collection is waited for)."""
    outcome = run_ranks(when_our_moment_runs, 2, args=(free_port(),), init=False, timeout=60)
    host = outcome.results[0]
    assert host == {
        "subgroup_kept_generation": True,
        "open_during_our_moment": False,
        "open_after_destroy": False,
        "new_generation": True,
    }, host
