"""Compile once without processes: the plan every rank derives from the key exchange, the wire
format of its three messages, and which paths a loading rank may write."""

from __future__ import annotations

import pytest

from compiler_collectives.agreements import once
from compiler_collectives.agreements.fingerprint import Collective, GraphFingerprint
from compiler_collectives.agreements.once import sidecar
from compiler_collectives.agreements.wire.once import (
    WARMTH_FX,
    Loaded,
    ManifestFile,
    Offer,
    Result,
    decode_once,
    encode_once,
)
from compiler_collectives.errors import SetupMismatchError, WireFormatError


def offer(
    key: str | None,
    *,
    holds: bool = False,
    dir: str = "host:1:1",
    switches=(),
    why=None,
    warmth: int = 0,
    build: str = "avx2 g++ 12",
) -> Offer:
    return Offer(key, why, holds, dir, list(switches), 1 << 30, "", warmth, build)


def test_ranks_of_another_build_fingerprint_never_load_an_artifact_built_for_another():
    offers = {r: offer("k", dir=f"host{r // 2}", build="avx512 g++ 13" if r >= 2 else "avx2 g++ 12") for r in range(4)}
    plans = once.decide(offers, seq=1)
    for r, p in plans.items():
        assert p.source is not None and offers[p.source].build == offers[r].build, (r, p)
    assert sorted(p.role for p in plans.values()) == ["compile", "compile", "load", "load"]
    assert all("share no artifact with other builds" in p.why for p in plans.values())


def test_a_rank_alone_with_its_build_compiles_itself_and_says_its_build_differs():
    plans = once.decide({0: offer("k"), 1: offer("k"), 2: offer("k", build="neon clang 17")}, seq=1)
    assert plans[2].role == once.LOCAL and "its build 'neon clang 17' differs" in plans[2].why
    assert {plans[0].role, plans[1].role} == {once.COMPILE, once.LOAD}


def test_the_build_fingerprint_round_trips_and_an_overlong_one_is_refused():
    mine = offer("k", build="avx2 cpu:0a1b g++ 12.2.0 (abcd) torch 2.15.0")
    data = encode_once(rank=0, world_size=2, seq=1, body=mine)
    assert decode_once(data, sender=0, max_bytes=1 << 20, expected_world_size=2).body == mine
    data = encode_once(rank=0, world_size=2, seq=1, body=offer("k", build="x" * 300))
    decoded = decode_once(data, sender=0, max_bytes=1 << 20, expected_world_size=2).body
    assert isinstance(decoded, Offer) and len(decoded.build) == 256  # the sender cuts it


def test_one_rank_compiles_each_shared_key_and_the_others_load_it():
    plans = once.decide({0: offer("k"), 1: offer("k"), 2: offer("k")}, seq=1)
    compilers = [r for r, p in plans.items() if p.role == once.COMPILE]
    assert len(compilers) == 1
    assert all(p.role == once.LOAD and p.source == compilers[0] for r, p in plans.items() if r not in compilers)


def test_the_compiling_rank_changes_from_graph_to_graph_so_the_work_spreads():
    chosen = {
        next(r for r, p in once.decide({0: offer("k"), 1: offer("k")}, seq=s).items() if p.role == once.COMPILE)
        for s in (1, 2)
    }
    assert chosen == {0, 1}


def test_a_rank_whose_cache_holds_the_entry_serves_it_instead_of_anyone_compiling():
    plans = once.decide({0: offer("k"), 1: offer("k", holds=True), 2: offer("k", holds=True)}, seq=1)
    assert plans[1].role == once.SERVE
    assert plans[0].role == plans[2].role == once.LOAD and plans[0].source == plans[2].source == 1


def test_where_no_rank_holds_the_entry_a_rank_whose_fx_graph_cache_is_warm_compiles():
    for seq in (1, 2, 3):
        plans = once.decide({0: offer("k", warmth=9), 1: offer("k"), 2: offer("k", warmth=WARMTH_FX)}, seq=seq)
        assert plans[2].role == once.COMPILE and "warm FX graph cache" in plans[2].why
        assert plans[0].source == plans[1].source == 2


def test_where_no_rank_holds_the_entry_nor_its_fx_compiles_the_rank_with_the_fullest_cache_dir_compiles():
    for seq in (1, 2, 3):
        plans = once.decide({0: offer("k", warmth=2), 1: offer("k", warmth=5), 2: offer("k")}, seq=seq)
        assert plans[1].role == once.COMPILE and "warmest cache dir (5 FX graph entries)" in plans[1].why


def test_ranks_equally_warm_take_turns_to_compile():
    chosen = {
        next(
            r
            for r, p in once.decide({0: offer("k", warmth=1), 1: offer("k", warmth=1)}, seq=s).items()
            if p.role == once.COMPILE
        )
        for s in (1, 2)
    }
    assert chosen == {0, 1}


def test_a_rank_that_holds_the_entry_serves_it_before_a_rank_whose_fx_graph_cache_is_warm():
    plans = once.decide({0: offer("k", warmth=WARMTH_FX), 1: offer("k", holds=True)}, seq=1)
    assert plans[1].role == once.SERVE and plans[0].role == once.LOAD


def test_a_key_no_other_rank_has_and_an_uncacheable_graph_compile_locally():
    plans = once.decide({0: offer("a"), 1: offer("b"), 2: offer(None, why="BypassAOTAutogradCache: x")}, seq=1)
    assert [p.role for p in plans.values()] == [once.LOCAL] * 3
    assert "no other rank" in plans[0].why and "BypassAOTAutogradCache" in plans[2].why


def test_ranks_that_share_a_key_still_share_when_another_rank_differs():
    plans = once.decide({0: offer("a"), 1: offer("b"), 2: offer("a"), 3: offer("b")}, seq=2)
    assert {plans[0].role, plans[2].role} == {once.COMPILE, once.LOAD}
    assert {plans[1].role, plans[3].role} == {once.COMPILE, once.LOAD}


def test_a_loading_rank_knows_whether_it_shares_the_compiling_rank_cache_dir():
    dirs = {0: "h:1:1", 1: "h:1:1", 2: "h:2:7"}
    for seq in (1, 2, 3):
        plans = once.decide({r: offer("k", dir=d) for r, d in dirs.items()}, seq=seq)
        source = next(r for r, p in plans.items() if p.role == once.COMPILE)
        assert all(p.shares_dir == (dirs[r] == dirs[source]) for r, p in plans.items() if r != source)


def test_torch_compile_time_collectives_make_every_rank_compile():
    on = ["_sync_decision_cross_ranks"]
    plans = once.decide({0: offer("k", switches=on), 1: offer("k", switches=on)}, seq=1)
    assert all(p.role == once.LOCAL and "_sync_decision_cross_ranks" in p.why for p in plans.values())


def test_torch_compile_time_collective_switches_that_differ_across_ranks_are_a_setup_mismatch():
    with pytest.raises(SetupMismatchError, match="rank 1: _sync_decision_cross_ranks"):
        once.decide({0: offer("k"), 1: offer("k", switches=["_sync_decision_cross_ranks"])}, seq=1)


# ---------------------------------------------------------------- wire


def _fingerprint() -> GraphFingerprint:
    return GraphFingerprint(
        "aot_forward", [Collective("all_reduce", "ranks [0, 1]", "sum", ("f32[4]",), "", "x.py:1")], b"h" * 8, 3
    )


@pytest.mark.parametrize(
    "body",
    [
        offer("k", holds=True, switches=["_sync_decision_cross_ranks"]),
        offer("k", warmth=WARMTH_FX),
        Result("ok", None, [ManifestFile("aotautograd/k/e", b"s" * 32, 10)], [_fingerprint()], 4096, [b"c" * 32]),
        Result("failed", "RuntimeError: boom", [], []),
        Loaded("miss", "the entry's guards fail this rank's size hints"),
    ],
)
def test_every_compile_once_message_survives_the_wire(body):
    data = encode_once(rank=1, world_size=2, seq=7, body=body)
    decoded = decode_once(data, sender=1, max_bytes=1 << 20, expected_world_size=2)
    assert (decoded.rank, decoded.seq, decoded.body) == (1, 7, body)


def test_a_manifest_line_without_a_sha256_is_refused_naming_the_sender():
    bad = Result("ok", None, [ManifestFile("aotautograd/k/e", b"short", 10)], [], 4096, [b"c" * 32])
    with pytest.raises(WireFormatError, match="rank 1") as e:
        decode_once(encode_once(rank=1, world_size=2, seq=1, body=bad), sender=1, max_bytes=1 << 20)
    assert "SHA-256" in str(e.value)


@pytest.mark.parametrize(
    ("chunk_bytes", "chunks", "says"),
    [
        (4096, [], "cover the artifact"),  # 10 000 bytes need 3 pieces of 4096
        (4096, [b"c" * 32] * 4, "cover the artifact"),
        (1024, [b"c" * 32] * 10, "chunk bytes"),  # under the least piece
        (4096, [b"c" * 32, b"short", b"c" * 32], "chunk's SHA-256"),
    ],
)
def test_chunk_digests_that_do_not_cover_the_artifact_exactly_are_refused(chunk_bytes, chunks, says):
    bad = Result("ok", None, [ManifestFile("aotautograd/k/e", b"s" * 32, 10_000)], [], chunk_bytes, chunks)
    with pytest.raises(WireFormatError, match=says):
        decode_once(encode_once(rank=1, world_size=2, seq=1, body=bad), sender=1, max_bytes=1 << 20)


def test_a_payload_claiming_another_sender_is_refused():
    data = encode_once(rank=0, world_size=2, seq=1, body=Loaded("hit", None))
    with pytest.raises(WireFormatError):
        decode_once(data, sender=1, max_bytes=1 << 20)


# ---------------------------------------------------------------- where files may go


@pytest.mark.parametrize(
    "rel",
    ["aotautograd/abc/def", "fxgraph/ab/fabc/xyz", "3g/c3g2mq.main.so", "ab/cab.cpp"],
)
def test_a_loading_rank_writes_paths_inside_the_cache_layout(rel):
    assert once.safe_relpath(rel)


@pytest.mark.parametrize(
    "rel",
    ["/etc/passwd", "../x", "a/../../x", "aotautograd/./k", "a//b", ".hidden/x", "a/b c", ""],
)
def test_a_loading_rank_refuses_paths_that_leave_the_cache_dir_or_are_not_plain(rel):
    assert not once.safe_relpath(rel)


def _result(*paths: str, status: str = "ok") -> Result:
    return Result(status, None, [ManifestFile(p, b"s" * 32, 10) for p in paths], [])


def test_an_artifact_without_an_aotautograd_entry_or_with_a_stray_path_is_loaded_by_nobody():
    assert once.manifest_problem(_result("aotautograd/k/e", "fxgraph/ab/fk/x"), 1) is None
    assert "no AOTAutograd cache entry" in once.manifest_problem(_result("fxgraph/ab/fk/x"), 1)
    assert "outside the cache layout" in once.manifest_problem(_result("aotautograd/k/e", "../../etc/x"), 1)
    assert "failed" in once.manifest_problem(_result(status="failed"), 1)


# ---------------------------------------------------------------- the FX keys kept with an entry


def test_the_fx_graph_keys_a_compile_took_are_kept_and_read_back(tmp_path):
    sidecar.write_fx_keys(str(tmp_path), "akey", ["fa", "fb"])
    assert sidecar.read_fx_keys(str(tmp_path), "akey", rank=0) == ["fa", "fb"]
    assert sidecar.read_fx_keys(str(tmp_path), "other", rank=0) == []


@pytest.mark.parametrize("damage", [b"", b"\x93\x01", b"not msgpack at all", b"\x92\x01\x91\xa2.."])
def test_a_damaged_fx_key_file_reads_as_none_kept(tmp_path, damage):
    sidecar.write_fx_keys(str(tmp_path), "akey", ["fa"])
    path = tmp_path / "compiler_collectives" / "fx" / "akey"
    path.write_bytes(damage)
    assert sidecar.read_fx_keys(str(tmp_path), "akey", rank=0) == []
