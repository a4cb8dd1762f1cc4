"""The host tree (``transport/hosttree.py``): a MIN and a gather by host (compile once's, in the
agreements layer), on real gloo ranks, without a compile.

Ranks are split into "hosts" by ``GROUP_RANK``, as torchrun's agents split them; five ranks on
three hosts of two, two and one rank: hosts of unequal size, and a host count that is not a power
of two (the leaders' recursive doubling takes its extra steps). The gather is also taken on five
hosts of one rank and on one host of five, in the same job, and the all-gather of one int per rank
that builds the tree (Bruck's: its last round sends fewer than it holds). So is the table gather:
rows of byte strings whose equal values every rank receives once.
"""

from __future__ import annotations

import os

import pytest

from tests.harness import run_ranks
from tests.rank_env import rank_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

HOST_OF = [0, 0, 1, 1, 2]


def tree_job(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from compiler_collectives.transport import HostTree
    from compiler_collectives.transport.p2p import gather_ints, run_p2p

    pg = dist.group.WORLD
    where = lambda: f"rank {rank}"  # noqa: E731
    out: dict = {"gather": {}, "table": {}, "ints": run_p2p(lambda: gather_ints(pg, 1000 + 7 * rank), where)}
    for layout in (HOST_OF, [0, 1, 2, 3, 4], [0] * 5):
        os.environ["GROUP_RANK"] = str(layout[rank])
        tree = HostTree.build(pg, lambda per_host: 2 + per_host, where)
        if layout is HOST_OF:
            out["hosts"], out["width"] = [list(h) for h in tree.hosts], tree.width
            # Each rank's values: the MIN of every rank's, in every element.
            out["min"] = [tree.min_ints(pg, [10 - rank, rank, 100 + (rank * 7) % 5], where) for _ in range(3)]
        got = []
        # Every rank's payload, of unequal sizes (rank 0's empty); then two ranks'; one rank's; none.
        for step, contributors in enumerate(([0, 1, 2, 3, 4], [1, 4], [3], [])):
            payload = f"{rank}:{step}".encode() * rank if rank in contributors else None
            got.append(tree.gather(pg, payload, HostTree.stamp(7, step), 1 << 20, where))
        out["gather"][len(tree.hosts)] = got
        tables = []
        for step, contributors in enumerate(([0, 1, 2, 3, 4], [1, 4], [])):
            row = table_row(rank) if rank in contributors else None
            table = tree.gather_table(pg, row, 3, HostTree.stamp(8, step), 1 << 20, where)
            columns = [table.column(c) for c in range(3)]
            tables.append(
                {
                    "rows": {r: [vals[ix[k]] for vals, ix in columns] for k, r in enumerate(table.ranks())},
                    "distinct": [len(vals) for vals, _ in columns],
                }
            )
        out["table"][len(tree.hosts)] = tables
    return out


def table_row(rank: int) -> list[bytes]:
    """Rank ``rank``'s row: a value every rank has, one shared by rank parity, one of its own."""
    return [b"same", b"even" if rank % 2 == 0 else b"odd", f"rank {rank}".encode() * rank]


@pytest.fixture(scope="module")
def tree_results() -> list[dict]:
    """One job of five ranks takes every exchange of the tests below."""
    return run_ranks(tree_job, 5, timeout=90).results


@pytest.mark.timeout(120)
def test_every_rank_gets_every_min_and_every_contribution_to_a_gather_on_hosts_of_any_layout(tree_results):
    results = tree_results
    expected = [
        {i: f"{i}:{step}".encode() * i for i in contributors}
        for step, contributors in enumerate(([0, 1, 2, 3, 4], [1, 4], [3], []))
    ]
    for r in results:
        assert r["hosts"] == [[0, 1], [2, 3], [4]] and r["width"] == 4
        assert r["min"] == [[6, 0, 100]] * 3
        assert r["gather"] == {3: expected, 5: expected, 1: expected}
        assert r["ints"] == [1000 + 7 * i for i in range(5)]


@pytest.mark.timeout(120)
def test_a_table_gather_gives_every_rank_every_row_with_each_distinct_value_once(tree_results):
    results = tree_results
    expected = [
        {"rows": {i: table_row(i) for i in range(5)}, "distinct": [1, 2, 5]},
        {"rows": {1: table_row(1), 4: table_row(4)}, "distinct": [1, 2, 2]},
        {"rows": {}, "distinct": [0, 0, 0]},
    ]
    for r in results:
        assert r["table"] == {3: expected, 5: expected, 1: expected}


def mismatch_job(rank: int, world: int) -> dict:
    """Rank 1 gathers while ranks 0 (their host's leader) and 2 take a MIN."""
    import time

    import torch.distributed as dist

    from compiler_collectives.transport import HostTree, Phases

    os.environ["GROUP_RANK"] = "0"
    pg = dist.group.WORLD
    where = lambda: f"rank {rank}"  # noqa: E731
    # The caller names its phases; the tree quotes them.
    tree = HostTree.build(pg, lambda per_host: 2, where, Phases({3: "the test's offers"}, "Take turns."))
    start = time.monotonic()
    try:
        if rank == 1:
            tree.gather(pg, b"offer", HostTree.stamp(3, 5), 1 << 20, where)
        else:
            tree.min_ints(pg, [rank, 0], where, stamp=HostTree.stamp(3, 5))
    except Exception as e:  # noqa: BLE001 - the test asserts on what each rank raised
        return {"type": type(e).__name__, "message": str(e), "ranks": e.ranks, "s": time.monotonic() - start}
    return {"type": None, "s": time.monotonic() - start}


@pytest.mark.timeout(120)
def test_a_rank_in_a_gather_while_its_peers_take_a_min_is_named_at_once_by_them_and_names_them():
    # COMPILER_COLLECTIVES_TIMEOUT is the wait a rank would otherwise take before it raised.
    env = rank_env(timeout_s=8, pg_timeout_s=10)
    results = run_ranks(mismatch_job, 3, env=env, timeout=90).results
    assert [r["type"] for r in results] == ["CollectiveDesyncError"] * 3, results
    assert all(r["s"] < 4 for r in results), results
    leader, gathering, other = results
    assert leader["ranks"] == (1,) and "rank 1 is in the gather of the test's offers #5" in leader["message"]
    assert gathering["ranks"] == (0,) and "rank 0 is in the MIN of the test's offers #5" in gathering["message"]
    assert all(r["message"].endswith("the ranks are at different exchanges.\nTake turns.") for r in results), results
    assert set(other["ranks"]) == {0, 1} and "rank 0 told this rank" in other["message"], other
