"""The compile-once scale model (``scripts/once_scale_model.py``, issue 30): its key properties,
without processes."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "once_scale_model.py"


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


def test_the_new_key_exchange_moves_bytes_per_rank_that_do_not_grow_with_the_world(m):
    f = m.Figures()
    matched = [m.new_keys(h, GBPS_10, f)["bytes_per_rank"] for h in (8, 128, 1024, 2048)]
    assert len(set(matched)) == 1 and matched[0] < 1024
    gathered = [m.all_gather(h, GBPS_10, f)["bytes_per_rank"] for h in (8, 1024)]
    assert gathered[1] > 100 * gathered[0]  # today's grows with the world
    # A mismatch falls back to today's all-gather.
    assert m.new_keys(1024, GBPS_10, f, match=False)["bytes_per_rank"] > gathered[1]
