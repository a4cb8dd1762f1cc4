"""The byte all-gather and the guard channel on real gloo groups (multi-process).

Rank functions are module-level (the harness pickles them by reference) and
return plain data; the parent asserts on every rank's result.
"""

from __future__ import annotations

import pytest

from compiler_collectives.transport.gloo import HEADER_BYTES
from tests.fixtures import GUARD_TRANSPORTS, guard_env
from tests.harness import run_ranks
from tests.rankside import patch

# Every test here starts rank processes or subprocesses: the multi-process tier.
pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

MAX = 1 << 20


def _payload(rank: int, length: int) -> bytes:
    """Distinct, rank-specific content, so a misplaced slot shows up."""
    return bytes((rank * 31 + i * 7) % 256 for i in range(length))


# ---------------------------------------------------------------- rank functions


def gather(rank: int, world: int, lengths: list[int], slot_bytes: int) -> tuple[list[bytes], int]:
    import torch.distributed as dist

    from compiler_collectives.transport import all_gather_bytes

    payloads, rounds = all_gather_bytes(
        dist.group.WORLD, _payload(rank, lengths[rank]), max_bytes=MAX, slot_bytes=slot_bytes
    )
    return [bytes(p) for p in payloads], rounds


def gather_with_default_settings(rank: int, world: int, lengths: list[int]) -> tuple[list[bytes], int, int]:
    from compiler_collectives import config
    from compiler_collectives.transport import all_gather_bytes, groups

    slot = config.settings.inline_slot_bytes
    payloads, rounds = all_gather_bytes(
        groups.compile_pg(),
        _payload(rank, lengths[rank]),
        max_bytes=config.settings.max_payload_bytes,
        slot_bytes=slot,
    )
    return [bytes(p) for p in payloads], rounds, slot


def gather_in_another_phase(rank: int, world: int) -> dict:
    """Rank 1 gathers in phase 8 while rank 0 gathers in phase 7; the caller names both."""
    import torch.distributed as dist

    from compiler_collectives.transport import Phases, all_gather_bytes

    phases = Phases({7: "the caller's first exchange", 8: "its second"}, "Take turns.")
    try:
        all_gather_bytes(dist.group.WORLD, b"x", max_bytes=16, slot_bytes=16, phase=7 + rank, phases=phases)
    except Exception as e:  # noqa: BLE001 - the test asserts on what each rank raised
        return {"type": type(e).__name__, "message": str(e), "ranks": list(e.ranks)}
    return {"type": None}


class _AnnouncesFalseLength:
    """Stands in for transport._LEN on one rank: the header claims ``claim`` bytes."""

    def __init__(self, real, claim: int) -> None:
        self.real = real
        self.size = real.size
        self.claim = claim

    def pack_into(self, buf, offset: int, n: int) -> None:
        self.real.pack_into(buf, offset, self.claim)

    def unpack(self, data):
        return self.real.unpack(data)

    def unpack_from(self, data, offset=0):
        return self.real.unpack_from(data, offset)


def gather_with_an_oversized_rank(rank: int, world: int, culprit: int, mode: str, max_bytes: int) -> dict:
    """``culprit`` announces more than ``max_bytes``: really ("real") or in its header only ("forged")."""
    import torch
    import torch.distributed as dist

    from compiler_collectives.errors import WireFormatError
    from compiler_collectives.transport import gloo as transport

    allocated: list[int] = []  # every buffer all_gather_bytes allocates, in bytes
    real_empty = torch.empty

    def recording_empty(*size, **kwargs):
        t = real_empty(*size, **kwargs)
        allocated.append(t.numel() * t.element_size())
        return t

    def recording_bytearray(n=0, *args):
        b = bytearray(n, *args)
        allocated.append(len(b))
        return b

    payload = _payload(rank, 10)
    if rank == culprit:
        if mode == "real":
            payload = _payload(rank, max_bytes + 1)
        else:
            patch(transport, "_LEN", _AnnouncesFalseLength(transport._LEN, 2**60))
    torch.empty = recording_empty
    transport.bytearray = recording_bytearray  # shadows the builtin in that module only
    try:
        transport.all_gather_bytes(dist.group.WORLD, payload, max_bytes=max_bytes, slot_bytes=64)
    except WireFormatError as e:
        return {
            "type": type(e).__name__,
            "message": str(e),
            "ranks": list(e.ranks),
            "kind": e.kind,
            "largest_allocation": max(allocated),
        }
    except Exception as e:  # noqa: BLE001 - reported to the parent as a failure
        return {"type": type(e).__name__, "message": str(e)}
    finally:
        torch.empty = real_empty
        del transport.bytearray
    return {"type": None}


def guard_rounds(rank: int, world: int, rounds: list[tuple], transport: str) -> list[tuple[bool, bool]]:
    """One agree per round on the guard channel; round = (hit per rank, seq per rank[, call site per rank])."""
    from compiler_collectives.transport import groups

    channel = groups.guard_channel()
    assert channel.name == transport, channel.name
    out = []
    for hits, seqs, *sites in rounds:
        site = sites[0][rank] if sites else 0
        out.append(tuple(channel.agree(hits[rank], seqs[rank], site)))
    return out


def describe_groups(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from compiler_collectives.transport import GlooGuardChannel, ShmGuardChannel, all_gather_bytes, groups

    compile_pg = groups.compile_pg()
    guard_pg = groups.guard_pg()
    # Both usable, for their own collective.
    gathered, _ = all_gather_bytes(compile_pg, bytes([rank]), max_bytes=16, slot_bytes=16)
    agreed = groups.guard_channel().agree(True, 1)
    return {
        "compile_backend": dist.get_backend(compile_pg),
        "guard_backend": dist.get_backend(guard_pg),
        "compile_name": compile_pg.name(),
        "guard_name": guard_pg.name(),
        "distinct": compile_pg is not guard_pg,
        "distinct_names": dist.get_process_group_ranks(compile_pg) == list(range(world))
        and compile_pg.group_name != guard_pg.group_name,
        "not_world": compile_pg is not dist.group.WORLD and guard_pg is not dist.group.WORLD,
        "cached": groups.compile_pg() is compile_pg and groups.guard_pg() is guard_pg,
        "channel_cached": isinstance(groups.guard_channel(), (GlooGuardChannel, ShmGuardChannel))
        and groups.guard_channel() is groups.guard_channel(),
        "sizes": [compile_pg.size(), guard_pg.size()],
        "existing": sorted(groups.existing()),
        "gathered": [bytes(p) for p in gathered],
        "agreed": agreed,
    }


def groups_under_a_fake_default_group(rank: int, world: int, store_path: str) -> dict:
    """The default group uses torch's non-communicating "fake" backend, not gloo."""
    import datetime

    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the backend)

    from compiler_collectives.transport import all_gather_bytes, groups

    store = dist.FileStore(store_path, world)
    dist.init_process_group("fake", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        compile_pg, guard_pg = groups.compile_pg(), groups.guard_pg()
        gathered, _ = all_gather_bytes(compile_pg, bytes([rank]), max_bytes=16, slot_bytes=16)
        return {
            "default_backend": dist.get_backend(),
            "backends": [dist.get_backend(compile_pg), dist.get_backend(guard_pg)],
            "gathered": [bytes(p) for p in gathered],
            "agreed": groups.guard_channel().agree(rank == 0, 5 + rank),
        }
    finally:
        groups.forget()
        dist.destroy_process_group()


# ---------------------------------------------------------------- all_gather_bytes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_payloads_of_different_lengths_come_back_exact_and_in_rank_order(world):
    lengths = [5, 300, 17][:world]
    outcome = run_ranks(gather, world, args=(lengths, 4096), timeout=45)
    expected = [_payload(r, lengths[r]) for r in range(world)]
    for rank, (payloads, rounds) in enumerate(outcome.results):
        assert payloads == expected, f"rank {rank}"
        assert rounds == 1


@pytest.mark.timeout(60)
def test_a_payload_larger_than_the_inline_slot_takes_exactly_two_rounds_and_is_exact():
    lengths = [40, 5000, 0]  # rank 1 does not fit a 64-byte slot
    outcome = run_ranks(gather, 3, args=(lengths, 64), timeout=45)
    expected = [_payload(r, n) for r, n in enumerate(lengths)]
    for rank, (payloads, rounds) in enumerate(outcome.results):
        assert rounds == 2, f"rank {rank}"
        assert payloads == expected, f"rank {rank}"


@pytest.mark.timeout(60)
def test_ranks_in_different_phases_raise_a_desync_in_the_callers_words_for_its_phases():
    results = run_ranks(gather_in_another_phase, 2, timeout=45).results
    for rank, r in enumerate(results):
        assert r["type"] == "CollectiveDesyncError" and r["ranks"] == [1 - rank], r
        assert "rank 0: the caller's first exchange\n  rank 1: its second\n" in r["message"], r["message"]
        assert r["message"].endswith("Nothing was applied. Take turns."), r["message"]


@pytest.mark.timeout(60)
def test_payloads_that_all_fit_the_inline_slot_take_one_round():
    lengths = [64, 1]  # exactly the slot size still fits
    outcome = run_ranks(gather, 2, args=(lengths, 64), timeout=45)
    expected = [_payload(r, n) for r, n in enumerate(lengths)]
    for payloads, rounds in outcome.results:
        assert rounds == 1
        assert payloads == expected


@pytest.mark.timeout(60)
def test_a_payload_over_the_default_inline_slot_is_gathered_on_the_compile_group_in_two_rounds():
    lengths = [4097, 10]  # the default slot is 4096 bytes
    outcome = run_ranks(gather_with_default_settings, 2, args=(lengths,), timeout=45)
    expected = [_payload(r, n) for r, n in enumerate(lengths)]
    for payloads, rounds, slot in outcome.results:
        assert slot == 4096
        assert rounds == 2
        assert payloads == expected


@pytest.mark.timeout(60)
def test_empty_payloads_come_back_empty():
    outcome = run_ranks(gather, 2, args=([0, 0], 64), timeout=45)
    for payloads, rounds in outcome.results:
        assert payloads == [b"", b""]
        assert rounds == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["real", "forged"])
def test_a_rank_announcing_more_than_max_bytes_makes_every_rank_raise_naming_it(mode):
    # "forged": rank 1's header claims 2**60 bytes; allocating that would fail
    # with another error, so a WireFormatError on every rank also shows that no
    # rank tried. Every allocation is recorded and must stay at slot size.
    max_bytes = 1000
    outcome = run_ranks(gather_with_an_oversized_rank, 3, args=(1, mode, max_bytes), timeout=45)
    announced = max_bytes + 1 if mode == "real" else 2**60
    for rank, r in enumerate(outcome.results):
        assert r["type"] == "WireFormatError", (rank, r)
        assert f"rank 1 announced a {announced}-byte" in r["message"], r["message"]
        assert r["ranks"] == [1]
        assert r["kind"] == "compiler"
        assert r["largest_allocation"] <= HEADER_BYTES + 64, f"rank {rank} allocated {r['largest_allocation']} bytes"


# ---------------------------------------------------------------- guard channels

# Each guard-channel test runs on both mechanisms (GUARD_TRANSPORTS).


@pytest.mark.timeout(60)
@GUARD_TRANSPORTS
def test_guard_channel_agree_reports_all_hit_and_in_step_when_every_rank_hits(transport):
    rounds = [([True] * 3, [4] * 3)]
    outcome = run_ranks(guard_rounds, 3, args=(rounds, transport), env=guard_env(transport), timeout=45)
    assert outcome.results == [[(True, True)]] * 3


@pytest.mark.timeout(60)
@GUARD_TRANSPORTS
def test_guard_channel_agree_reports_a_miss_on_any_rank_to_every_rank(transport):
    rounds = [
        ([True, False, True], [9, 9, 9]),
        ([False, False, False], [10, 10, 10]),
        ([True, True, False], [11, 11, 11]),
        ([True, True, True], [12, 12, 12]),  # nothing carries over from earlier calls
    ]
    outcome = run_ranks(guard_rounds, 3, args=(rounds, transport), env=guard_env(transport), timeout=45)
    expected = [(False, True), (False, True), (False, True), (True, True)]
    assert outcome.results == [expected] * 3


@pytest.mark.timeout(60)
@GUARD_TRANSPORTS
def test_guard_channel_agree_reports_ranks_out_of_step_when_call_numbers_differ(transport):
    rounds = [
        ([True, True, True], [7, 3, 5]),
        ([True, False, True], [100, 100, 2**40]),
        ([False, True, True], [0, 1, 0]),
        ([True, True, True], [6, 6, 6]),
    ]
    outcome = run_ranks(guard_rounds, 3, args=(rounds, transport), env=guard_env(transport), timeout=45)
    # out of step is never reported as "all hit"
    expected = [(False, False), (False, False), (False, False), (True, True)]
    assert outcome.results == [expected] * 3


@pytest.mark.timeout(60)
@GUARD_TRANSPORTS
def test_guard_channel_agree_reports_ranks_out_of_step_when_frames_differ(transport):
    rounds = [
        ([True] * 3, [1] * 3, [2**45, 2**45, 2**45]),
        ([True] * 3, [2] * 3, [17, 17, 18]),
        ([True] * 3, [3] * 3, [0, 5, 5]),
    ]
    outcome = run_ranks(guard_rounds, 3, args=(rounds, transport), env=guard_env(transport), timeout=45)
    expected = [(True, True), (False, False), (False, False)]
    assert outcome.results == [expected] * 3


def guard_without_desync_check(rank: int, world: int) -> list:
    from compiler_collectives.transport import GlooGuardChannel, groups

    channel = GlooGuardChannel(groups.guard_pg(), check_desync=False)
    return [channel.agree(True, 1, rank), channel.agree(rank == 0, 2 + rank, 0), channel.agree(True, 9, 9)]


@pytest.mark.timeout(60)
def test_guard_channel_without_the_desync_check_agrees_on_hits_only():
    outcome = run_ranks(guard_without_desync_check, 2, timeout=45)
    assert outcome.results == [[(True, True), (False, True), (True, True)]] * 2


def guard_describe_all(rank: int, world: int, transport: str) -> list:
    from compiler_collectives.transport import groups

    assert groups.guard_channel().name == transport
    return groups.guard_channel().describe_all(10 + rank, 7 * rank)


@pytest.mark.timeout(60)
@GUARD_TRANSPORTS
def test_guard_channel_describe_all_tells_every_rank_where_each_rank_was(transport):
    outcome = run_ranks(guard_describe_all, 3, args=(transport,), env=guard_env(transport), timeout=45)
    assert outcome.results == [[(10, 0), (11, 7), (12, 14)]] * 3


# ---------------------------------------------------------------- groups


@pytest.mark.timeout(60)
def test_our_groups_are_gloo_distinct_for_compile_and_guard_and_created_once():
    outcome = run_ranks(describe_groups, 2, timeout=45)
    for _rank, r in enumerate(outcome.results):
        assert r["compile_backend"] == "gloo"
        assert r["guard_backend"] == "gloo"
        assert r["compile_name"] == "gloo" and r["guard_name"] == "gloo"
        assert r["distinct"] and r["distinct_names"]
        assert r["not_world"]
        assert r["cached"] and r["channel_cached"]
        assert r["sizes"] == [2, 2]
        assert r["existing"] == ["compile", "guard"]
        assert r["gathered"] == [b"\x00", b"\x01"]
        assert r["agreed"] == (True, True)


@pytest.mark.timeout(60)
def test_our_groups_are_gloo_and_really_communicate_when_the_default_group_is_not_gloo(tmp_path):
    outcome = run_ranks(groups_under_a_fake_default_group, 2, args=(str(tmp_path / "store"),), init=False, timeout=45)
    for r in outcome.results:
        assert r["default_backend"] == "fake"
        assert r["backends"] == ["gloo", "gloo"]
        assert r["gathered"] == [b"\x00", b"\x01"]
        assert r["agreed"] == (False, False)


# ---------------------------------------------------------------- waiting in slices


def gather_with_tiny_wait_slices(rank: int, world: int, rounds: int) -> dict:
    import datetime
    import time

    import torch.distributed as dist

    from compiler_collectives.transport import gloo

    # Slices of a millisecond (the finest gloo takes): over many operations, some
    # complete between a slice's timeout and the look at the operation that follows.
    patch(gloo, "WAIT_SLICE", datetime.timedelta(milliseconds=1))
    import random

    rng = random.Random(rank)
    failures = []
    for i in range(rounds):
        if rank == 1:
            time.sleep(rng.uniform(0.0008, 0.0013))  # rank 0's operation completes near a slice's end
        try:
            payloads, _ = gloo.all_gather_bytes(dist.group.WORLD, bytes([rank, i % 256]), max_bytes=16, slot_bytes=16)
            assert [bytes(p) for p in payloads] == [bytes([r, i % 256]) for r in range(world)]
        except Exception as e:  # noqa: BLE001 - reported to the parent
            failures.append(f"{type(e).__name__}: {e}")
    return {"failures": failures}


@pytest.mark.timeout(90)
def test_a_wait_in_slices_returns_the_operation_outcome_even_when_it_completes_between_two_slices():
    outcome = run_ranks(gather_with_tiny_wait_slices, 2, args=(1500,), timeout=60)
    for r in outcome.results:
        assert r["failures"] == [], r["failures"][:3]
