"""Ranks that disagree about the setup fail at once, on every rank, naming the cause (issue 11).

Settings are read when compiler_collectives is imported, so a setting that
differs on one rank is given to that rank's environment only (``rank_env``),
the way a variable set on one node would be; the rank functions import the
package themselves.

The setup record itself and its wire format: ``tests/unit/test_setup_record.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.harness import run_ranks
from tests.rank_env import rank_env
from tests.rankside import patch

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
        patch(version, "__version__", "0.0.9")  # as if an older wheel were installed on that node
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
