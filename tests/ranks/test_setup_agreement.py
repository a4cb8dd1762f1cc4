"""Ranks that disagree about the setup fail at once, on every rank, naming the cause (issue 11).

Settings are read when compiler_collectives is imported, so a setting that
differs on one rank is given to that rank's environment only (``rank_env``),
the way a variable set on one node would be; the rank functions import the
package themselves.
"""

from __future__ import annotations

import time

import msgpack
import pytest
import torch

from tests.harness import run_ranks
from tests.rank_env import rank_env

# Multi-process tests here: release independent (tests/tiers.py).
pytestmark = pytest.mark.release_independent

# Long enough that only the setup check, never a timeout, can end these jobs in time.
ENV = rank_env(timeout_s=60, pg_timeout_s=1800)


def _step(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def compile_and_call(rank: int, world: int, guards: bool) -> dict:
    import compiler_collectives as cc
    from compiler_collectives import config

    cc.enable(guards=guards or None)
    f = torch.compile(_step, backend="eager")
    start = time.monotonic()
    try:
        for _ in range(3):
            f(torch.ones(2 + rank))
    except cc.CollectiveError as e:
        return {
            "type": type(e).__name__,
            "message": str(e),
            "ranks": list(e.ranks),
            "seconds": time.monotonic() - start,
            "desync_check": config.settings.guard_desync_check,
        }
    return {"type": None, "seconds": time.monotonic() - start, "stats": cc.stats()}


@pytest.mark.multiprocess
def test_a_collective_shaping_setting_set_on_one_rank_only_fails_every_rank_within_seconds_naming_it():
    outcome = run_ranks(
        compile_and_call,
        3,
        args=(True,),
        env=ENV,
        timeout=90,
        rank_env={1: rank_env(guard_desync_check=False)},
    )
    assert [r["desync_check"] for r in outcome.results] == [True, False, True]  # the env really differed
    for r in outcome.results:
        assert r["type"] == "SetupMismatchError", r
        assert r["seconds"] < 10.0, r
        assert r["ranks"] == [1], r
        # The item, rank 0's value (shared by every rank not named) and rank 1's.
        assert (
            "COMPILER_COLLECTIVES_GUARD_DESYNC_CHECK: rank 0 (and every rank not named here): True; rank 1: False"
        ) in r["message"], r["message"]
    # The same error on every rank, but for the rank that reports it.
    assert len({r["message"].split(": ", 1)[1] for r in outcome.results}) == 1


@pytest.mark.multiprocess
def test_the_guard_switch_on_one_rank_only_fails_every_rank_naming_the_switch():
    outcome = run_ranks(compile_and_call, 2, args=(False,), env=ENV, timeout=90, rank_env={0: rank_env(guards=True)})
    for r in outcome.results:
        assert r["type"] == "SetupMismatchError", r
        assert r["seconds"] < 10.0, r
        assert "COMPILER_COLLECTIVES_GUARDS: rank 0: True; rank 1: False" in r["message"], r["message"]


def other_package_version_on_rank_1(rank: int, world: int) -> dict:
    from compiler_collectives import version

    if rank == 1:
        version.__version__ = "0.0.9"  # as if an older wheel were installed on that node
    return compile_and_call(rank, world, False)


@pytest.mark.multiprocess
def test_a_different_package_version_on_one_rank_is_named_with_both_versions():
    outcome = run_ranks(other_package_version_on_rank_1, 2, env=ENV, timeout=90)
    import compiler_collectives

    for r in outcome.results:
        assert r["type"] == "SetupMismatchError", r
        assert (f"compiler_collectives version: rank 0: '{compiler_collectives.__version__}'; rank 1: '0.0.9'") in r[
            "message"
        ], r["message"]


def several_differences(rank: int, world: int) -> dict:
    from compiler_collectives import config

    if rank == 2:
        config.set_value("inline_slot_bytes", 512)
    return compile_and_call(rank, world, False)


@pytest.mark.multiprocess
def test_every_differing_item_and_every_differing_rank_is_named():
    outcome = run_ranks(
        several_differences,
        4,
        env=ENV,
        timeout=90,
        rank_env={3: rank_env(exchange_inputs_first=False, max_payload_bytes=1000)},
    )
    for r in outcome.results:
        assert r["type"] == "SetupMismatchError", r
        assert r["ranks"] == [2, 3], r
        message = r["message"]
        assert (
            "COMPILER_COLLECTIVES_INLINE_SLOT_BYTES: rank 0 (and every rank not named here): 4096; "
            "rank 2: 512; rank 3: 4096"
        ) in message, message
        assert (
            "COMPILER_COLLECTIVES_EXCHANGE_INPUTS_FIRST: rank 0 (and every rank not named here): True; "
            "rank 2: True; rank 3: False" in message
        ), message
        assert "COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES" in message


@pytest.mark.multiprocess
def test_settings_that_may_differ_do_not_stop_the_job():
    outcome = run_ranks(
        compile_and_call,
        2,
        args=(True,),
        env=ENV,
        timeout=90,
        rank_env={
            1: rank_env(
                timing=True,
                timeout_s=45,
                heartbeat_s=0.5,
                extra={"COMPILER_COLLECTIVES_LOG_LEVEL": "ERROR"},  # retired: read only to warn
            )
        },
    )
    for r in outcome.results:
        assert r["type"] is None, r
        assert r["stats"]["guard_collectives"] == 2


# ---------------------------------------------------------------- the record itself (no ranks)


def test_the_setup_record_holds_every_must_match_setting_and_the_versions():
    import compiler_collectives
    from compiler_collectives import config
    from compiler_collectives.agreements import setup as setup_agreement

    record = setup_agreement.local_record({"transport protocol version": 2})
    for row in config.MUST_MATCH:
        assert row.env in record, row.env
    for row in config.SETTINGS_TABLE:
        if not row.must_match:
            assert row.env not in record, row.env
    assert record["compiler_collectives version"] == compiler_collectives.__version__
    assert record["torch version"] == torch.__version__
    assert record["transport protocol version"] == 2
    # The switches, as they are now (the seams register them).
    assert "TORCH_COMPILER_COLLECTIVES" in record
    assert "torch._dynamo.config.automatic_dynamic_shapes" in record


@pytest.mark.parametrize(
    "data",
    [
        b"\x80\x04K\x01.",  # a pickle
        b"\xc1",  # not msgpack
        b"\x93\x01\x00\x91\x92\x01\x02",  # an item named by an int
    ],
)
def test_a_malformed_setup_record_is_refused_by_validation(data):
    from compiler_collectives.agreements import wire
    from compiler_collectives.errors import WireFormatError

    with pytest.raises(WireFormatError):
        wire.decode_setup(data, sender=0)


class _Store:
    """Enough of a c10d store for the setup check on one rank, with the other ranks' keys set."""

    def __init__(self, keys: dict) -> None:
        self.keys = dict(keys)

    def set(self, key: str, value) -> None:
        self.keys[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.keys[key]

    def check(self, keys: list) -> bool:
        return all(k in self.keys for k in keys)

    def wait(self, keys: list, timeout) -> None:
        if not self.check(keys):
            raise RuntimeError(f"timed out waiting for {keys}")

    def add(self, key: str, n: int) -> int:
        self.keys[key] = str(int(self.keys.get(key, b"0")) + n).encode()
        return int(self.keys[key])


MALFORMED_RECORDS = {
    "not msgpack": b"\xc1",
    "truncated": msgpack.packb([1, 3, [["torch version", "2.13.0"]]], use_bin_type=True)[:-3],
    "an item named by an int": msgpack.packb([1, 3, [[1, 2]]], use_bin_type=True),
    "a list as a value": msgpack.packb([1, 3, [["torch version", [2, 13]]]], use_bin_type=True),
    "an item named twice": msgpack.packb([1, 3, [["a", 1], ["a", 2]]], use_bin_type=True),
    "another sender": msgpack.packb([1, 2, []], use_bin_type=True),
    "a map": msgpack.packb({"format": 1}, use_bin_type=True),
    "extra data": msgpack.packb([1, 3, []], use_bin_type=True) + b"\x00",
    "too many items": msgpack.packb([1, 3, [[f"i{i}", i] for i in range(600)]], use_bin_type=True),
    "oversized": msgpack.packb([1, 3, [["x", "y" * 500]] * 200], use_bin_type=True),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_RECORDS))
def test_a_malformed_setup_record_raises_wire_format_error_naming_its_sender_and_the_check_names_it(case):
    from compiler_collectives.agreements import setup as setup_agreement
    from compiler_collectives.agreements import wire
    from compiler_collectives.errors import SetupMismatchError, WireFormatError

    data = MALFORMED_RECORDS[case]
    with pytest.raises(WireFormatError) as caught:
        wire.decode_setup(data, sender=3)
    assert caught.value.ranks == (3,), caught.value
    assert str(caught.value).startswith("bad setup-record payload from rank 3: "), caught.value
    # The setup check on rank 0 (rank 3 posted the record and counted itself as differing):
    # the unreadable record is a difference, named with its sender, not a crash.
    store = _Store(
        {
            "setup/1": msgpack.packb([1, 1, []], use_bin_type=True),
            "setup/2": msgpack.packb([1, 2, []], use_bin_type=True),
            "setup/3": data,
            "setup/arrived": b"3",
            "setup/mismatches": b"1",
            "setup/mismatch/1": b"3",
        }
    )
    with pytest.raises(SetupMismatchError) as mismatch:
        setup_agreement.agree(store, 0, 4, 5.0, {})
    assert mismatch.value.ranks == (3,)
    message = str(mismatch.value)
    assert "readable setup record: rank 0 (and every rank not named here): <not sent>; rank 3: " in message, message
    assert "no (bad setup-record payload from rank 3: " in message, message
