"""The host tree (``transport/hosttree.py``): compile once's MIN and broadcast by host, on real gloo
ranks, without a compile.

Ranks are split into "hosts" by ``GROUP_RANK``, as torchrun's agents split them; five ranks on
three hosts of two, two and one rank: hosts of unequal size, and a host count that is not a power
of two (the leaders' recursive doubling takes its extra steps).
"""

from __future__ import annotations

import os

import pytest

from tests.harness import run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

HOST_OF = [0, 0, 1, 1, 2]


def tree_job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from compiler_collectives.transport import HostTree

    os.environ["GROUP_RANK"] = str(HOST_OF[rank])
    pg = dist.group.WORLD
    where = lambda: f"rank {rank}"  # noqa: E731
    tree = HostTree.build(pg, lambda per_host: 2 + per_host, where)
    out: dict = {"hosts": [list(h) for h in tree.hosts], "width": tree.width}
    # Each rank's values: the MIN of every rank's, in every element.
    out["min"] = [tree.min_ints(pg, [10 - rank, rank, 100 + (rank * 7) % 5], where) for _ in range(3)]
    out["broadcast"] = []
    for root in range(world):
        payload = f"from {root}".encode() * (root + 1) if rank == root else None
        out["broadcast"].append(tree.broadcast(pg, root, payload, 40 + root, 1 << 20, where))
    return out


@pytest.mark.timeout(120)
def test_ranks_on_hosts_of_unequal_size_all_get_every_min_and_every_broadcast():
    results = run_ranks(tree_job, 5, timeout=90).results
    for r in results:
        assert r["hosts"] == [[0, 1], [2, 3], [4]] and r["width"] == 4
        assert r["min"] == [[6, 0, 100]] * 3
        assert r["broadcast"] == [(40 + root, f"from {root}".encode() * (root + 1)) for root in range(5)]
