"""A peer's failure report keeps its type (issue 22, "never stop a correct job").

A rank that learns of a peer's failure from a report (the store report its
heartbeat reads, or the shared-memory failure word) raises ``PeerFailureError``
naming the rank that failed and why. It never re-types that into a desync
blaming a rank that is alive and did nothing wrong (it only stopped because
it heard of the same failure). A rank that left the job (its own signal
handler raised while it waited) reaches same-host peers through the failure
word as fast as a crash does, and reads as "left", not as a crash.

The failure word itself, read and written in one process: ``tests/unit/test_failure_word.py``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from tests.fixtures import NAMED_WITHIN_SECONDS
from tests.harness import release, run_ranks, stay_until
from tests.rank_env import rank_env
from tests.rankside import caught

# Multi-process tests here: release independent (tests/tiers.py).
pytestmark = pytest.mark.release_independent

TIMEOUT_S, PG_TIMEOUT_S = 60, 120
ENV = rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S)


def _step(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def _until_poisoned(max_s: float) -> None:
    from compiler_collectives import health

    give_up = time.monotonic() + max_s
    while health.latch.first_failure is None and time.monotonic() < give_up:
        time.sleep(0.02)


def _error(call) -> dict:
    """What ``call`` raised (our error, or anything else), as data."""
    try:
        out = caught(call)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        out = {"type": type(e).__name__, "message": str(e), "ranks": None}
    return out


# ---------------------------------------------------------------- bug 7: mismatched scopes


def mismatched_scopes(rank: int, world: int) -> dict:
    """Ranks 0-1 say strided:2, ranks 2-3 consecutive:2: the scope check fails on 0 and 1 only.

    Ranks 2 and 3 agree with each other and start; rank 3 hears of rank 0's report
    first and refuses its next call, while rank 2 is already waiting for it in a
    guard collective: rank 3 did nothing wrong."""
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    if rank < 2:
        stay_until(2, 30, "started")  # ranks 2 and 3 passed their own scope check and run
        out = _error(lambda: f(torch.ones(2)))
    else:
        f(torch.ones(2))
        f(torch.ones(2))
        release("started")
        if rank == 3:
            _until_poisoned(20)  # heard of rank 0's (or 1's) report
        out = _error(lambda: [f(torch.ones(2)) for _ in range(1000)])
    release()
    stay_until(4, 30)  # alive until every rank holds its error: nobody learns it from an exit
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_scope_check_failure_reaches_the_other_scope_as_a_peer_failure_never_a_desync_blaming_a_bystander():
    env = rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S, heartbeat_s=0.5)
    outcome = run_ranks(
        mismatched_scopes,
        4,
        env=env,
        timeout=100,
        rank_env={
            0: rank_env(scope="strided:2"),
            1: rank_env(scope="strided:2"),
            2: rank_env(scope="consecutive:2"),
            3: rank_env(scope="consecutive:2"),
        },
    )
    results = outcome.results
    for r in results[:2]:
        assert r["type"] == "ScopeError", r
    for r in results:
        assert "did not enter" not in r["message"] and "desync" not in r["message"], r["message"]
    for r in results[2:]:
        # Rank 2 stopped waiting on the report, rank 3 refused on it: either way a peer's
        # report that names another rank (the reporter) is raised as a PeerFailureError.
        assert r["type"] == "PeerFailureError", r
        failed = [p for p in (0, 1) if f"rank {p} reported a collective failure" in r["message"]]
        assert failed, r["message"]  # names the rank that failed ...
        assert "name different scopes" in r["message"], r["message"]  # ... and its cause
        assert set(r["ranks"]) <= {0, 1}, r  # never a bystander of scope [2, 3]


# ---------------------------------------------------------------- a rank that left


class Preempted(Exception):
    pass


def _on_sigterm(signum, frame):
    raise Preempted("SIGTERM: this node is being preempted")


def _leave_inside_the_guard_collective(f) -> dict:
    """This rank's own SIGTERM handler raises while it waits in a guard collective."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    try:
        f(torch.ones(2))
        return {"raised": None}
    except Preempted:
        return {"raised": "Preempted"}


def left_while_a_bystander_refuses(rank: int, world: int) -> dict:
    """Rank 0 leaves; rank 1 hears of it first and refuses its next call, while rank 2 is
    already waiting for rank 1 in a guard collective: rank 1 did nothing wrong."""
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    if rank == 0:
        out = _leave_inside_the_guard_collective(f)
    else:
        if rank == 1:
            _until_poisoned(20)
        out = caught(lambda: [f(torch.ones(2)) for _ in range(1000)])
    release()
    stay_until(3, 30)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_rank_waiting_for_a_bystander_that_stopped_on_a_report_names_the_reporter_not_the_bystander():
    env = rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S, guard_transport="gloo")
    outcome = run_ranks(left_while_a_bystander_refuses, 3, env=env, timeout=80)
    assert outcome.results[0]["raised"] == "Preempted", outcome.results[0]
    for r in outcome.results[1:]:
        # Rank 1 refused on rank 0's word, rank 2 stopped waiting on it: a PeerFailureError each.
        assert r["type"] == "PeerFailureError", r
        assert r["ranks"] == [0], r
        assert "rank 0 left the job" in r["message"] and "Preempted" in r["message"], r["message"]
        assert "did not enter" not in r["message"] and "desync" not in r["message"], r["message"]


def leaves_while_its_same_host_peer_waits(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    if rank == 1:
        out = _leave_inside_the_guard_collective(f)
        release("left")
        stay_until(1, 20)  # alive until rank 0 holds its error: not noticed as an exit
        return out
    stay_until(1, 20, "left")  # rank 1 left by now
    start = time.monotonic()
    # Rank 1's word for this call was in before it left: this call may still agree, the next cannot.
    first = caught(lambda: f(torch.ones(2)))
    out = first if first["type"] else caught(lambda: f(torch.ones(2)))
    out["seconds"] = time.monotonic() - start
    out["transport"] = cc.stats()["guard_transport"]
    release()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@NAMED_WITHIN_SECONDS
def test_a_rank_that_left_reaches_its_same_host_peer_through_the_failure_word_at_once_as_left_not_as_a_crash():
    # Heartbeats 30 s apart (and a timeout past the 0.5 s rank 1 waits before it leaves): only
    # the failure word can tell rank 0 within a second.
    env = rank_env(timeout_s=10, pg_timeout_s=PG_TIMEOUT_S, heartbeat_s=30)
    outcome = run_ranks(leaves_while_its_same_host_peer_waits, 2, env=env, timeout=80)
    assert outcome.results[1]["raised"] == "Preempted", outcome.results[1]
    peer = outcome.results[0]
    assert peer["transport"] == "shm", peer
    assert peer["type"] == "PeerFailureError", peer
    assert peer["ranks"] == [1], peer
    assert peer["seconds"] < 1.5, peer
    assert "rank 1 left the job: its own code raised Preempted" in peer["message"], peer["message"]
    assert "reported a" not in peer["message"] and "exited or was killed" not in peer["message"], peer["message"]
