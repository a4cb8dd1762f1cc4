"""The compile-once scale model (``scripts/once_scale_model.py``, issue 30): its key properties,
without processes."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "once_scale_model.py"


@pytest.fixture(scope="module")
def m():
    spec = importlib.util.spec_from_file_location("once_scale_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


GBPS_10 = 10e9 / 8  # bytes/s
MB_100 = 100e6


def test_todays_busiest_link_carries_one_copy_per_other_host(m):
    f = m.Figures()
    busiest = {h: m.today(h, MB_100, GBPS_10, f)["busiest_bytes"] for h in (2, 16, 128, 1024, 2048)}
    assert all(busiest[h] == (h - 1) * MB_100 for h in busiest)
    # Linear in the hosts: twice the hosts, about twice the bytes through the source's link.
    assert busiest[2048] / busiest[1024] == pytest.approx(2, rel=1e-3)
    # Every rank of another host gets its own copy when the ranks share one key.
    job = m.Figures(keys="job")
    assert m.today(128, MB_100, GBPS_10, job)["busiest_bytes"] == 127 * 8 * MB_100


def test_the_new_design_meets_the_issue_target_and_today_does_not(m):
    # The issue's target (2.5x) holds with the code's 1 MiB pieces; 4 MiB pieces pay one 4 MiB
    # piece step per level: about 3.1x at depth 10 (docs/benchmarks.md).
    f = m.Figures()
    floor = MB_100 / GBPS_10
    new = m.new(1024, MB_100, GBPS_10, f)
    today = m.today(1024, MB_100, GBPS_10, f)
    assert new["depth"] == 10  # log2 of 1,024 dirs with fan-out 2
    assert 2 * floor < new["time_s"] <= 2.5 * floor
    assert today["time_s"] >= 1023 * floor
    assert m.Figures().chunk_mib == 1  # COMPILER_COLLECTIVES_ONCE_CHUNK_BYTES' default
    assert 3 * floor < m.new(1024, MB_100, GBPS_10, m.Figures(chunk_mib=4))["time_s"] < 3.3 * floor
    # The busiest link carries fan-out copies, whatever the number of hosts.
    assert new["busiest_bytes"] == m.new(2048, MB_100, GBPS_10, f)["busiest_bytes"] == 2 * MB_100
    # One host on a GPU job: no two ranks share a key, nothing travels.
    assert m.new(1, MB_100, GBPS_10, f)["time_s"] == m.today(1, MB_100, GBPS_10, f)["time_s"] == 0


def test_the_exchanges_as_built_meet_issue_37s_target_where_before_they_took_seconds(m):
    f = m.Figures()
    built, before = m.exchanges(1024, GBPS_10, f), m.before37(1024, GBPS_10, f)
    assert built["time_s"] <= 0.1  # the target recorded in docs/benchmarks.md
    assert before["time_s"] > 1.0
    # Log-depth: sixteen times the hosts, four more leader rounds.
    assert m.exchanges(2048, GBPS_10, f)["rounds"] - m.exchanges(128, GBPS_10, f)["rounds"] == 4


def test_a_first_graph_and_a_miss_round_take_under_20_ms_at_1024_hosts_where_decoding_every_payload_took_170(m):
    f = m.Figures()
    built = m.exchanges(1024, GBPS_10, f)
    assert built["missed"] == 1024 * 8 - 8  # the worst miss round: every rank that loads missed
    assert built["first_graph_s"] <= m.TARGET_FIRST_GRAPH_S == 0.02  # issue 43's target
    assert built["with_miss_s"] <= 0.02
    # Before, every rank decoded every contributor's payload: 164 ms of offers at 20 µs each.
    assert built["before43_first_graph_s"] > 0.15 and built["before43_with_miss_s"] > 0.15
    # Reading the table is most of what is left; a rank receives a few bytes per rank, not an offer.
    assert built["offers_read_s"] < built["offers_s"]
    assert built["first_graph_bytes_per_rank"] < built["before43_first_graph_bytes_per_rank"] / 4


def test_a_first_graph_still_takes_milliseconds_not_a_world_rings_hops(m):
    f = m.Figures()
    built = m.exchanges(1024, GBPS_10, f)
    assert built["offers_s"] < m.all_gather(1024, GBPS_10, f)["time_s"] / 25
    assert built["first_graph_s"] == pytest.approx(built["time_s"] + built["offers_s"] + built["layout_s"])


def test_the_models_table_is_the_size_the_code_packs(m):
    from compiler_collectives.agreements.wire.once import Loaded, Offer, encode_row
    from compiler_collectives.transport import Table

    # 16 ranks on 2 hosts: a key and a graph per index on a host, a dir per host.
    key, graph, boot = "a" + "q" * 51, "e" * 64, "0" * 36  # AOTAutograd's key; a graph digest; a boot id
    offers = [
        Offer(
            key[:-1] + str(r % 8),
            None,
            False,
            f"{boot[:-1]}{r // 8}:2049:1234567",
            [],
            1 << 30,
            graph[:-1] + str(r % 8),
            0,
            m.BUILD,
        )
        for r in range(16)
    ]
    table = Table(m.OFFER_COLUMNS, 16)
    for r, o in enumerate(offers):
        table.fold(Table.of_row(r, encode_row(world_size=8192, seq=100, body=o), 16), ValueError, int)
    distinct = sum(len(table.column(c)[0]) for c in range(m.OFFER_COLUMNS))
    f = m.Figures()
    assert m.offer_table(2, GBPS_10, f)["set_bytes"] == len(table.pack())
    assert distinct == 2 * 8 + 2 + (m.OFFER_COLUMNS - 3)
    miss = Loaded("miss", "the entry's guards fail this rank's size hints")  # once.protocol.loaded's reason
    outcomes = Table.of_row(0, encode_row(world_size=8192, seq=100, body=miss), 1)
    assert m.table_bytes(1, m.LOADED_COLUMNS, 3, m.OUTCOME_HEAD_BYTES + m.OUTCOME_BYTES + m.REASON_BYTES) == len(
        outcomes.pack()
    )


def test_the_tables_costs_are_measured_on_the_code(m):
    figures = m.calibrate_tables(hosts=4)
    assert set(figures) == {"row_us", "value_us", "fold_us"} and all(v > 0 for v in figures.values())


def test_the_bytes_per_rank_of_the_exchanges_as_built_do_not_grow_with_the_world(m):
    f = m.Figures()
    built = {m.exchanges(h, GBPS_10, f)["bytes_per_rank"] for h in (8, 128, 1024, 2048)}
    assert len(built) == 1
    before = [m.before37(h, GBPS_10, f)["bytes_per_rank"] for h in (8, 1024)]
    assert before[1] > 100 * before[0]


def test_the_model_takes_its_shapes_from_the_code(m):
    from compiler_collectives.agreements.once import keys
    from compiler_collectives.agreements.wire.once import Loaded, encode_once, row_columns
    from compiler_collectives.health import liveness
    from compiler_collectives.transport import HostTree
    from compiler_collectives.transport.hierarchy import doubling_plan

    f = m.Figures()
    assert m.record_bytes(f) == 8 * (HostTree.HEAD + keys.record_width(f.ranks_per_host))
    assert m.ENTRY_HEAD == HostTree.ENTRY_HEAD
    assert (m.OFFER_COLUMNS, m.LOADED_COLUMNS) == (row_columns("keys"), row_columns("loaded"))
    miss = Loaded("miss", "the entry's guards fail this rank's size hints")  # once.protocol.loaded's reason
    assert m.LOADED_BYTES == len(encode_once(rank=8191, world_size=8192, seq=100, body=miss))
    assert m.stale_after(f.heartbeat_s) == liveness.stale_after(f.heartbeat_s)
    for hosts in (2, 3, 5, 8, 1000, 1024):
        assert m._rounds(hosts) == max(len(doubling_plan(i, hosts)) for i in range(hosts))


def test_the_busiest_store_carries_the_heartbeats_and_compile_onces_waits_cost_two_requests_a_graph(m):
    f = m.Figures()
    one = m.store(1024, f)
    assert one["heartbeat_per_s"] == 2 * 8192 / f.heartbeat_s
    # As built (issue 43), every rank but the sources blocks on the sources' posts and asks nothing
    # while it waits: their records come with its heartbeat.
    assert one["compile_wait_per_s"] == 0
    assert one["busiest_per_s"] == one["heartbeat_per_s"]
    # Per graph: one wait for all its sources' posts and one read of them; the sources' posts.
    assert one["compile_wait_per_graph"] == (8192 - 8) * 2 + 8
    # Issue 37: the sources' records read once per 3 s (a 1 s heartbeat's stale_after), and per
    # graph a connection, a wait and a get and a first read of each source.
    assert one["issue37_compile_wait_per_s"] == (8192 - 8) / 3.0
    assert one["issue37_compile_wait_per_graph"] == (8192 - 8) * (1 + 5 * 8 + f.compile_s / 3.0) + 8
    # Before issue 37 item 2, it polled every source's post and liveness every 0.2 s.
    assert one["before_compile_wait_per_s"] == (8192 - 8) * 8 * 4 / 0.2
    # One host of a GPU job shares nothing: nobody waits.
    assert m.store(1, f)["compile_wait_per_graph"] == 0
