"""Compile once without processes: how each loading rank gets its source's bytes (``transfer.routes``):
one receiving rank per cache dir, a tree of those receivers rooted at the source, and pieces
whose digests every receiver checks."""

from __future__ import annotations

import hashlib

import pytest

from compiler_collectives.agreements import once
from compiler_collectives.agreements.once import transfer
from compiler_collectives.agreements.wire.once import ManifestFile, Offer, Result

SOURCE = 0


def result(size: int = 10_000) -> Result:
    return Result("ok", None, [ManifestFile("aotautograd/k/e", b"s" * 32, size)], [], 4096, [b"c" * 32])


def job(hosts: int, per_host: int, *, limit: int = 1 << 30) -> tuple[dict[int, once.Plan], dict[int, Offer]]:
    """``hosts`` cache dirs of ``per_host`` ranks each (rank r in dir r // per_host); one key."""
    offers = {
        r: Offer("k", None, r == SOURCE, f"host{r // per_host}:1:1", [], limit, "", 0) for r in range(hosts * per_host)
    }
    return once.decide(offers, seq=1), offers


def routes(hosts: int, per_host: int, fanout: int = 2, **kw: int) -> dict[int, transfer.Route]:
    plans, offers = job(hosts, per_host, **kw)
    assert plans[SOURCE].role == once.SERVE
    return transfer.routes(SOURCE, result(), plans, offers, "aot", fanout)


def test_the_ranks_of_the_sources_dir_read_in_place():
    r = routes(4, 2)
    assert r[1] == transfer.Route(transfer.SHARED)


def test_each_other_dir_has_one_receiver_and_its_other_ranks_read_its_install():
    r = routes(4, 2)
    receivers = sorted(rank for rank, route in r.items() if route.mode == transfer.RECEIVE and rank != SOURCE)
    assert receivers == [2, 4, 6]
    for receiver in receivers:
        assert r[receiver].readers == (receiver + 1,)
        assert r[receiver + 1] == transfer.Route(transfer.READ, via=receiver)


def test_the_source_sends_to_at_most_its_fanout_and_every_receiver_has_one_parent_in_the_tree():
    r = routes(4, 2)
    assert r[SOURCE].children == (2, 4)
    assert (r[2].parent, r[2].children) == (SOURCE, (6,))
    assert (r[4].parent, r[4].children) == (SOURCE, ())
    assert (r[6].parent, r[6].children) == (2, ())


@pytest.mark.parametrize(("hosts", "fanout", "depth"), [(2, 2, 1), (4, 2, 2), (8, 2, 3), (1024, 2, 10), (9, 1, 8)])
def test_the_tree_reaches_every_dir_once_within_log_fanout_levels(hosts, fanout, depth):
    r = routes(hosts, 1, fanout)
    parents = {rank: route.parent for rank, route in r.items() if rank != SOURCE}
    assert sorted(parents) == list(range(1, hosts))
    assert all(len(route.children) <= fanout for route in r.values())
    assert sorted(c for route in r.values() for c in route.children) == list(range(1, hosts))

    def level(rank: int) -> int:
        return 0 if rank == SOURCE else 1 + level(parents[rank])

    assert max(level(rank) for rank in r) == depth


def test_a_rank_whose_limit_the_artifact_exceeds_gets_no_bytes_and_is_no_receiver():
    plans, offers = job(2, 2)
    offers[2] = Offer("k", None, False, "host1:1:1", [], 100, "", 0)
    r = transfer.routes(SOURCE, result(), plans, offers, "aot", 2)
    assert r[2].mode == transfer.NONE
    assert r[3] == transfer.Route(transfer.RECEIVE, SOURCE, (), ())
    assert r[SOURCE].children == (3,)


def test_the_chunk_digests_cover_the_bundle_in_pieces():
    bundle = bytes(range(256)) * 40  # 10 240 bytes: pieces of 4096, 4096, 2048
    digests = transfer.chunk_digests(bundle, 4096)
    assert digests == [hashlib.sha256(bundle[i : i + 4096]).digest() for i in (0, 4096, 8192)]
