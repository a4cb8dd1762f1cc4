"""The multi-process harness itself: no test passes while a rank aborts (issue 11)."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import signal
import time

import pytest

from tests.harness import MachineHold, RanksFailed, machine_lock, run_ranks

# Every test here starts rank processes or subprocesses: the multi-process tier.
pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]


def report_then_abort_at_exit(rank: int, world: int) -> str:
    import multiprocessing.util

    if rank == 1:
        # Runs while the process exits, after the result went to the parent:
        # the way a C++ std::terminate at teardown looks from outside.
        multiprocessing.util.Finalize(None, os.abort, exitpriority=-10)  # after the result queue is flushed (-5)
    return "ok"


def test_a_rank_that_aborts_after_reporting_its_result_fails_the_test():
    with pytest.raises(RanksFailed, match=r"rank 1 was ended by signal SIGABRT .*after reporting its result"):
        run_ranks(report_then_abort_at_exit, 2, init=False, timeout=60)


def test_a_rank_that_aborts_fails_the_test_even_when_the_test_inspects_the_outcome_itself():
    with pytest.raises(RanksFailed, match="SIGABRT"):
        run_ranks(report_then_abort_at_exit, 2, init=False, timeout=60, check=False)


def test_a_signal_the_test_expects_for_that_rank_is_accepted_and_must_happen():
    outcome = run_ranks(report_then_abort_at_exit, 2, init=False, timeout=60, expect_signals={1: signal.SIGABRT})
    assert outcome.results == ["ok", "ok"]
    assert outcome.exitcodes == [0, -signal.SIGABRT]
    with pytest.raises(RanksFailed, match="rank 0 was expected to end by signal SIGKILL"):
        run_ranks(
            report_then_abort_at_exit, 2, init=False, timeout=60, expect_signals={0: signal.SIGKILL, 1: signal.SIGABRT}
        )


def tensor_result(rank: int, world: int) -> object:
    import torch

    return {"rank": rank, "values": torch.arange(4.0) + rank}


def test_a_ranks_tensor_result_arrives_by_value_not_through_its_process():
    # Torch's queue pickler shares a tensor through a file descriptor that the
    # parent fetches from the rank's process, which may have exited by then.
    results = run_ranks(tensor_result, 2, init=False, timeout=60).results
    for rank, result in enumerate(results):
        assert result["values"].tolist() == [rank + 0.0, rank + 1.0, rank + 2.0, rank + 3.0]
        assert not result["values"].is_shared()


def sees_compiler_collectives_imported(rank: int, world: int) -> bool:
    import sys

    return "compiler_collectives" in sys.modules


def test_a_rank_has_not_imported_compiler_collectives_before_its_own_code_does():
    # The forkserver preloads tests.harness: had that imported the package, it would
    # have read its settings there, before a rank's env was in place.
    assert run_ranks(sees_compiler_collectives_imported, 2, init=False, timeout=60).results == [False, False]


def inductors_compile_threads(rank: int, world: int) -> int:
    import torch._inductor.config

    return torch._inductor.config.compile_threads


@pytest.mark.torch_seam  # inductor reads the variable at its import: a torch release could move that
def test_a_rank_compiles_on_the_inductor_thread_count_its_env_sets_though_the_forkserver_imported_inductor():
    # The forkserver preloads inductor, which decided its thread count there (from the machine's
    # cores, or the parent's env); each rank's own env must win. Two counts: the forkserver's
    # can equal one of them, never both.
    rank_env = {0: {"TORCHINDUCTOR_COMPILE_THREADS": "1"}, 1: {"TORCHINDUCTOR_COMPILE_THREADS": "3"}}
    assert run_ranks(inductors_compile_threads, 2, init=False, rank_env=rank_env, timeout=60).results == [1, 3]


def _hold_machine(path: str, exclusive: bool, name: str, entered, release, order) -> None:
    with machine_lock(path, exclusive=exclusive):
        order.put(name)
        entered.set()
        release.wait(60)


def _gate_is_held(path: str) -> bool:
    with open(path + ".gate", "a+") as gate:
        try:
            fcntl.flock(gate, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(gate, fcntl.LOCK_UN)
        return False


def test_a_whole_machine_test_waits_for_running_tests_and_no_new_test_starts_before_it(tmp_path):
    """Side by side (tests/conftest.py): the exclusive holder gets the machine next, alone."""
    ctx = mp.get_context("fork")
    path = str(tmp_path / "suite")
    order = ctx.Queue()
    events = {name: (ctx.Event(), ctx.Event()) for name in ("running", "alone", "next")}
    procs = []

    def start(name: str, exclusive: bool) -> None:
        entered, release = events[name]
        procs.append(ctx.Process(target=_hold_machine, args=(path, exclusive, name, entered, release, order)))
        procs[-1].start()

    try:
        start("running", exclusive=False)
        assert events["running"][0].wait(30)
        start("alone", exclusive=True)
        deadline = time.monotonic() + 30
        while not _gate_is_held(path):  # the whole-machine test is now waiting for the machine
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start("next", exclusive=False)
        assert not events["alone"][0].wait(0.5)  # a test still runs
        assert not events["next"][0].wait(0.5)  # and no new one starts ahead of the waiting one
        events["running"][1].set()
        assert events["alone"][0].wait(30)
        assert not events["next"][0].wait(0.5)  # nothing beside it
        events["alone"][1].set()
        assert events["next"][0].wait(30)
        events["next"][1].set()
        assert [order.get(timeout=10) for _ in range(3)] == ["running", "alone", "next"]
    finally:
        for _, release in events.values():
            release.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0]


def _whole_machine_tests_in_a_row(path: str, steps, done, order) -> None:
    """One worker's tests in a row, each (whole-machine?, next whole-machine?): run each when ``steps`` says."""
    hold = MachineHold(path)
    for name, exclusive, next_exclusive in [("alone-1", True, True), ("alone-2", True, False)]:
        steps.get(timeout=30)
        hold.before(exclusive)
        order.put(name)
        hold.after(exclusive, next_exclusive)
        done.put(name)


def test_consecutive_whole_machine_tests_keep_the_machine_and_no_other_test_starts_between_them(tmp_path):
    """Side by side (tests/conftest.py): the machine is emptied once for whole-machine tests in a row."""
    ctx = mp.get_context("fork")
    path = str(tmp_path / "suite")
    order, steps, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    entered, release = ctx.Event(), ctx.Event()
    worker = ctx.Process(target=_whole_machine_tests_in_a_row, args=(path, steps, done, order))
    other = ctx.Process(target=_hold_machine, args=(path, False, "other", entered, release, order))
    worker.start()
    try:
        steps.put("go")
        assert done.get(timeout=30) == "alone-1"
        other.start()  # another worker's test, between the two whole-machine tests
        assert not entered.wait(1.0)  # the first let go of nothing: the machine is still the worker's
        steps.put("go")
        assert done.get(timeout=30) == "alone-2"
        assert entered.wait(30)  # the last whole-machine test of the row let it go
        release.set()
        assert [order.get(timeout=10) for _ in range(3)] == ["alone-1", "alone-2", "other"]
    finally:
        release.set()
        for p in (worker, other):
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert [worker.exitcode, other.exitcode] == [0, 0]


class _RunTemp:
    """What ``once_per_run`` asks of pytest's ``tmp_path_factory``: the run's temp dir."""

    def __init__(self, path) -> None:
        self.path = path

    def getbasetemp(self):
        return self.path


def test_a_job_that_tests_on_several_workers_share_runs_once_and_each_reads_its_result(tmp_path, monkeypatch):
    import threading

    from tests.fixtures import once_per_run

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    runs, got = [], []

    def job(where):
        runs.append(where)
        time.sleep(0.3)  # the other asker arrives while it runs, and waits
        (where / "left").write_text("x")
        return {"pair": (1, 2)}

    askers = [threading.Thread(target=lambda: got.append(once_per_run(_RunTemp(tmp_path), "j", job))) for _ in range(2)]
    for t in askers:
        t.start()
    for t in askers:
        t.join(10)
    assert runs == [tmp_path / "once-j"] and (tmp_path / "once-j" / "left").exists()
    assert got == [{"pair": [1, 2]}] * 2  # as JSON holds it, for the runner and the reader alike


def test_a_shared_job_that_failed_fails_each_test_that_asks_with_its_traceback(tmp_path, monkeypatch):
    from tests.fixtures import once_per_run

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)

    def job(where):
        raise RuntimeError("the ranks broke")

    with pytest.raises(RuntimeError, match="the ranks broke"):
        once_per_run(_RunTemp(tmp_path), "j", job)
    with pytest.raises(pytest.fail.Exception, match=r"(?s)j, the job these tests share, failed.*the ranks broke"):
        once_per_run(_RunTemp(tmp_path), "j", job)
