"""Compile once's key settling without processes: each rank's record, the element-wise MIN the
host tree takes of them (done here over the list), and every rank's offers read back from it.

Where the record settles the keys, every rank's plans (``decide`` over the offers it read back)
are the plans an all-gather of the real offers gives; where it does not, no rank settles (they
all take the all-gather)."""

from __future__ import annotations

from compiler_collectives.agreements import once
from compiler_collectives.agreements.once import keys
from compiler_collectives.agreements.wire.once import WARMTH_FX, Offer
from compiler_collectives.transport import HostTree


def offer(key: str | None, *, holds: bool = False, dir: str = "d", warmth: int = 0, switches=(), why=None) -> Offer:
    return Offer(key, why, holds, dir, list(switches), 1 << 30, "g", warmth)


def trees(hosts: list[list[int]]) -> list[HostTree]:
    """Each group rank's view of a tree with these hosts (group ranks, ascending per host)."""
    place = {r: (h, j) for h, ranks in enumerate(hosts) for j, r in enumerate(ranks)}
    n, width = len(place), keys.record_width(max(len(h) for h in hosts))
    placed = tuple(place[i] for i in range(n))
    return [HostTree(i, tuple(tuple(h) for h in hosts), placed, width) for i in range(n)]


def settle(offers: list[Offer], *, seq: int = 1, hosts=None, kept=None, members=None):
    """Every group rank's settled offers (None: not settled) for ``offers`` in group-rank order."""
    n = len(offers)
    members = list(members if members is not None else range(n))
    views = trees(hosts or [list(range(n))])
    if kept is None:
        kept = keys.known(members, dict(zip(members, offers)))  # as the last all-gather left it
    records = [keys.record(o, kept, members=members, tree=t, seq=seq, level="aot") for o, t in zip(offers, views)]
    assert len({len(r) for r in records}) == 1 and len(records[0]) == views[0].width
    out = [min(column) for column in zip(*records)]
    return [keys.offers(out, o, kept, members=members, tree=t, seq=seq) for o, t in zip(offers, views)]


def plans_everywhere(offers: list[Offer], seq: int = 1, **kw) -> list[dict[int, once.Plan]]:
    settled = settle(offers, seq=seq, **kw)
    assert all(s is not None for s in settled), settled
    return [once.decide(s, seq) for s in settled]  # type: ignore[arg-type]


def test_equal_keys_settle_to_the_plans_the_gathered_offers_give():
    offers = [offer("k"), offer("k"), offer("k")]
    for seq in (1, 2, 3):  # the compiling rank turns from graph to graph, in the record as in decide
        assert plans_everywhere(offers, seq) == [once.decide(dict(enumerate(offers)), seq)] * 3


def test_each_rank_reads_its_own_key_back_and_a_placeholder_for_the_others_it_cannot_see():
    offers = [offer("k0"), offer("k1"), offer("k0"), offer("k1")]
    settled = settle(offers, hosts=[[0, 1], [2, 3]])
    assert settled[0] is not None and settled[1] is not None
    assert settled[0][0].key == settled[0][2].key == "k0" and settled[0][1].key not in ("k0", "k1")
    assert settled[1][1].key == "k1" and settled[1][0].key not in ("k0", "k1")


def test_a_key_per_device_index_settles_across_hosts_as_a_gpu_job_does():
    # Index 0 of each host has k0, index 1 has k1: two groups of equal keys, across hosts.
    offers = [offer("k0"), offer("k1"), offer("k0"), offer("k1")]
    expected = once.decide(dict(enumerate(offers)), 1)
    assert plans_everywhere(offers, hosts=[[0, 1], [2, 3]]) == [expected] * 4
    assert {p.source for p in expected.values()} == {expected[0].source, expected[1].source}
    assert expected[0].source != expected[1].source


def test_the_lowest_rank_holding_the_entry_serves_it():
    offers = [offer("k"), offer("k", holds=True), offer("k", holds=True)]
    plans = plans_everywhere(offers)
    assert plans == [once.decide(dict(enumerate(offers)), 1)] * 3
    assert plans[0][1].role == once.SERVE and plans[0][0].source == plans[0][2].source == 1


def test_the_warmest_rank_compiles():
    offers = [offer("k", warmth=3), offer("k", warmth=WARMTH_FX), offer("k", warmth=5)]
    plans = plans_everywhere(offers)
    assert plans == [once.decide(dict(enumerate(offers)), 1)] * 3
    assert plans[0][1].role == once.COMPILE


def test_global_ranks_of_a_subgroup_name_the_offers():
    offers = [offer("k"), offer("k")]
    settled = settle(offers, members=[4, 6])
    assert all(s is not None and sorted(s) == [4, 6] for s in settled)


def test_ranks_without_a_key_for_the_same_reason_settle_as_local():
    offers = [offer(None, why="not cacheable"), offer(None, why="not cacheable")]
    plans = plans_everywhere(offers)
    assert all(p.role == once.LOCAL and "not cacheable" in p.why for p in plans[0].values())


def test_a_key_that_differs_within_an_index_is_not_settled_anywhere():
    # Index 0 has k on host 0 and k2 on host 1: only the gather can tell who shares.
    offers = [offer("k"), offer("k"), offer("k2"), offer("k")]
    assert settle(offers, hosts=[[0, 1], [2, 3]]) == [None] * 4


def test_keyless_ranks_for_different_reasons_are_not_settled():
    assert settle([offer(None, why="a"), offer(None, why="b")]) == [None, None]


def test_without_a_kept_table_no_rank_settles():
    # A generation's first graph: nothing kept yet; every rank puts "invalid" into the record.
    offers = [offer("k"), offer("k")]
    views = trees([[0, 1]])
    records = [keys.record(o, None, members=[0, 1], tree=t, seq=1, level="aot") for o, t in zip(offers, views)]
    out = [min(c) for c in zip(*records)]
    assert [keys.offers(out, o, None, members=[0, 1], tree=t, seq=1) for o, t in zip(offers, views)] == [None, None]


def test_a_rank_whose_cache_dir_changed_since_the_kept_table_unsettles_every_rank():
    kept = keys.known([0, 1], {0: offer("k"), 1: offer("k")})
    assert settle([offer("k"), offer("k", dir="moved")], kept=kept) == [None, None]


def test_a_kept_table_of_other_members_unsettles_every_rank():
    kept = keys.known([0, 1, 2], {0: offer("k"), 1: offer("k"), 2: offer("k")})
    assert settle([offer("k"), offer("k")], kept=kept) == [None, None]


def test_switches_that_differ_are_not_settled_so_the_gather_names_them():
    assert settle([offer("k", switches=["a"]), offer("k")]) == [None, None]
