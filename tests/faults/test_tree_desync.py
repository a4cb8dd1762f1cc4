"""A desync between compile once's exchanges over the host tree (``transport.hosttree``) and its
artifact transfer (``agreements.once.transfer``), issue 43: a rank in a MIN or a gather over the
tree while its peer is in the transfer of a graph's pieces fails at once, and so does the peer,
each naming what the other is in, instead of both waiting for COMPILER_COLLECTIVES_TIMEOUT.

Two real gloo ranks on one "host" (rank 0 its leader, rank 1 its one peer in the tree): rank 0 is
the artifact's source and rank 1 its one receiver. The transfer is of compile once #7; the tree
exchange, of #8's keys (the next graph's, where one rank went on without the other).
"""

from __future__ import annotations

import os
import time

import pytest

from compiler_collectives.transport.tree_exchange import NOTICE_GRACE_S
from tests.harness import run_ranks
from tests.rank_env import rank_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

TIMEOUT_S = 12  # COMPILER_COLLECTIVES_TIMEOUT: what a rank would otherwise wait before it raised
BUNDLE = bytes(range(256)) * 64  # four pieces of 4 KiB


def desync_job(rank: int, world: int, in_tree: int | None, op: str, slow_s: float = 0.0) -> dict:
    """``slow_s``: the rank in the tree posts each receive that long after its send (a loaded
    machine's scheduling, made certain): its peer has found the desync and raised by then."""
    import torch.distributed as dist

    from compiler_collectives.agreements import phases
    from compiler_collectives.agreements.once import transfer
    from compiler_collectives.agreements.wire.once import ManifestFile, Result
    from compiler_collectives.transport import HostTree

    os.environ["GROUP_RANK"] = "0"
    if slow_s and rank == in_tree:
        from compiler_collectives.transport import tree_exchange

        receive = tree_exchange.Exchange._receive

        def slow_receive(self, peer):  # type: ignore[no-untyped-def]
            time.sleep(slow_s)
            return receive(self, peer)

        tree_exchange.Exchange._receive = slow_receive
    pg = dist.group.WORLD
    where = lambda: f"rank {rank}"  # noqa: E731
    tree = HostTree.build(pg, lambda per_host: 2, where, phases.HOST_TREE)
    result = Result("compiled", None, [ManifestFile("a", "0" * 64, len(BUNDLE))], [], 4096)
    result.chunks = transfer.chunk_digests(BUNDLE, 4096)
    link = transfer.Link(pg, (0, 1), rank, 7, where, lambda error: error, tree)
    start = time.monotonic()
    try:
        if rank == in_tree and op == "min":
            tree.min_ints(pg, [rank, 0], where, stamp=HostTree.stamp(phases.ONCE_KEYS, 8))
        elif rank == in_tree:
            tree.gather(pg, b"offer", HostTree.stamp(phases.ONCE_KEYS, 8), 1 << 20, where)
        elif rank == 0:
            transfer.send(link, BUNDLE, result, transfer.Route(transfer.RECEIVE, None, (1,), receivers=(1,)))
        else:
            got = transfer.receive(link, result, transfer.Route(transfer.RECEIVE, 0), 0)
            return {"type": None, "bytes": got.data == BUNDLE}
    except Exception as e:  # noqa: BLE001 - the test asserts on what each rank raised
        return {"type": type(e).__name__, "message": str(e), "s": time.monotonic() - start}
    return {"type": None, "s": time.monotonic() - start}


ENV = rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=TIMEOUT_S + 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["min", "gather"])
@pytest.mark.parametrize("in_tree", [0, 1], ids=["source-in-tree", "receiver-in-tree"])
def test_a_rank_in_a_tree_exchange_while_its_peer_is_in_the_transfer_fails_at_once_naming_both(in_tree, op):
    results = run_ranks(desync_job, 2, args=(in_tree, op), env=ENV, timeout=90, check=False).results
    assert [r["type"] for r in results] == ["CollectiveDesyncError"] * 2, results
    assert all(r["s"] < TIMEOUT_S / 3 for r in results), results
    tree, transferring = results[in_tree], results[1 - in_tree]
    exchange = "the MIN" if op == "min" else "the gather"
    assert (
        f"is in compile once's artifact transfer #7 while this rank is in {exchange} of compile once's keys #8"
        in (tree["message"])
    ), tree
    assert (
        f"is in {exchange} of compile once's keys #8 while this rank is in compile once's artifact transfer #7"
        in (transferring["message"])
    ), transferring


@pytest.mark.timeout(120)
def test_a_rank_that_found_the_desync_waits_until_its_peer_slow_to_receive_took_its_record_then_ends():
    """The receiver in the tree gather posts its receive a second after its record went to the
    source, which found the desync at once, raised, and ended its process: the receiver still gets
    the source's record (our error naming it), not gloo's "Connection closed by peer"."""
    outcome = run_ranks(desync_job, 2, args=(1, "gather", 1.0), env=ENV, timeout=90, check=False)
    results = outcome.results
    assert [r["type"] for r in results] == ["CollectiveDesyncError"] * 2, results
    assert "is in compile once's artifact transfer #7" in results[1]["message"], results[1]
    assert results[0]["s"] < NOTICE_GRACE_S + 1.0, results[0]


@pytest.mark.timeout(120)
def test_a_source_and_its_receiver_meet_then_pass_the_pieces():
    source, receiver = run_ranks(desync_job, 2, args=(None, ""), env=ENV, timeout=90).results
    assert source["type"] is None and receiver == {"type": None, "bytes": True}, (source, receiver)
