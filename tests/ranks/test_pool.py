"""The pool of ranks (``tests/pool.py``): reused from test to test, and never passing one
test's leftovers or failure on to the next."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.harness import RanksFailed, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]


def pid(rank: int, world: int) -> int:
    return os.getpid()


def leave_a_thread_of_ours(rank: int, world: int) -> int:
    threading.Thread(target=time.sleep, args=(120,), name="compiler_collectives-planted", daemon=True).start()
    return os.getpid()


def leave_a_setting_changed(rank: int, world: int) -> int:
    from compiler_collectives import config

    config.set_value("timeout_s", 7.0)
    return os.getpid()


def leave_a_variable_set(rank: int, world: int) -> int:
    os.environ["COMPILER_COLLECTIVES_PLANTED"] = "1"
    return os.getpid()


def kill_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return os.getpid()


def hang_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(120)
    return os.getpid()


def compile_and_guard(rank: int, world: int) -> tuple[int, float]:
    import torch

    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(lambda x: x.sin() * 2, backend="eager")
    for n in (3, 4 + rank):  # rank 1 recompiles: every rank does
        y = f(torch.ones(n))
    return os.getpid(), float(y.sum())


def test_consecutive_tests_run_in_the_same_rank_processes():
    first = run_ranks(compile_and_guard, 2).results
    second = run_ranks(compile_and_guard, 2).results
    assert [p for p, _ in first] == [p for p, _ in second]
    assert first == second  # and behave alike: the second starts from the pool's state, not the first's


@pytest.mark.parametrize(
    ("leak", "named"),
    [
        (leave_a_thread_of_ours, "threads ['compiler_collectives-planted'] still running"),
        (leave_a_setting_changed, "settings changed and not put back (timeout_s: "),
    ],
    ids=["thread", "setting"],
)
def test_a_test_that_leaves_state_of_ours_behind_fails_naming_it_and_the_next_runs_on_fresh_ranks(leak, named):
    before = run_ranks(pid, 2).results
    with pytest.raises(RanksFailed, match="was left holding, after the test") as failed:
        run_ranks(leak, 2)
    assert named in str(failed.value)
    after = run_ranks(compile_and_guard, 2).results
    assert not set(before) & {p for p, _ in after}


def sees_the_variable(rank: int, world: int) -> str | None:
    return os.environ.get("COMPILER_COLLECTIVES_PLANTED")


def test_a_variable_a_test_sets_in_its_ranks_is_gone_for_the_next_test():
    assert run_ranks(leave_a_variable_set, 2).results == run_ranks(pid, 2).results  # the same ranks
    assert run_ranks(sees_the_variable, 2).results == [None, None]


def test_a_pool_rank_killed_by_a_test_fails_that_test_and_is_replaced_for_the_next():
    before = run_ranks(pid, 2).results
    with pytest.raises(RanksFailed, match="rank 1 was ended by signal SIGKILL"):
        run_ranks(kill_rank_1, 2)
    after = run_ranks(compile_and_guard, 2).results
    assert not set(before) & {p for p, _ in after}


def test_a_test_that_hangs_times_out_and_the_next_runs_on_fresh_ranks():
    before = run_ranks(pid, 2).results
    with pytest.raises(RanksFailed, match=r"ranks \[1\] still running after 3s: killed"):
        run_ranks(hang_rank_1, 2, timeout=3)
    after = run_ranks(compile_and_guard, 2).results
    assert not set(before) & {p for p, _ in after}


@pytest.mark.fresh_ranks("the test is of the fresh path: its ranks must not come from a pool")
def test_a_test_marked_fresh_ranks_gets_processes_of_its_own_every_time():
    assert run_ranks(pid, 2).results != run_ranks(pid, 2).results
