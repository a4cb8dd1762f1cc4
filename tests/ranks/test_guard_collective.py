"""The guard collective: if any rank must recompile, every rank recompiles (issue: guards)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from tests.harness import release, run_ranks, stay_until
from tests.rank_env import rank_env
from tests.rankside import GraphRecorder, summary

# Every test here starts rank processes or subprocesses: the multi-process tier.
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_seam]


def _step(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * 2


def _train_like_loop(rank: int, guards: bool, before_call: Callable[[int], None] = lambda call: None) -> dict:
    """Compiled step, then a user all-reduce; on call 2 only rank 1's dtype changes."""
    import compiler_collectives as cc

    cc.enable(guards=guards)
    rec = GraphRecorder()
    f = torch.compile(_step, backend=rec)
    totals = []
    for call in range(3):
        before_call(call)
        dtype = torch.float64 if (rank == 1 and call == 1) else torch.float32
        y = f(torch.ones(4, dtype=dtype))
        total = y.sum().float().reshape(1)
        dist.all_reduce(total)  # the user's own collective on the default group
        totals.append(total.item())
    out = summary(rec)
    out["totals"] = totals
    return out


def one_rank_misses_with_guards(rank: int, world: int) -> dict:
    return _train_like_loop(rank, guards=True)


# How long each rank must stay in the call where rank 1's dtype changes before its stack is
# read: both ranks then wait on each other there, which only a hang explains. The ranks
# met in call 1's all-reduce just before, so no start-up skew counts against it.
STUCK_S = 3.0


def _where(thread_id: int) -> list[str]:
    """The stack of a thread of this process, innermost last, as "folder/file.py:function"."""
    frame = sys._current_frames()[thread_id]
    return [
        f"{os.path.basename(os.path.dirname(f.filename))}/{os.path.basename(f.filename)}:{f.name}"
        for f in traceback.extract_stack(frame)
    ]


def one_rank_misses_without_guards(rank: int, world: int) -> dict:
    """The guard-collective loop without guard collectives; a watchdog thread writes where
    this rank is STUCK_S after it began the call where rank 1's dtype changes, and ends
    the process once both ranks have written (the loop never returns when it hangs)."""
    entered = threading.Event()
    main = threading.get_ident()

    def watch() -> None:
        entered.wait()
        time.sleep(STUCK_S)
        with open(os.path.join(os.environ["HARNESS_JOB_DIR"], f"stuck.{rank}.json"), "w") as out:
            json.dump(_where(main), out)
        release("stuck")
        stay_until(world, 30, "stuck")  # both stacks read while both ranks still wait
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    return _train_like_loop(rank, guards=False, before_call=lambda call: call == 1 and entered.set())


def test_when_one_rank_misses_its_guards_every_rank_recompiles_and_the_job_finishes():
    outcome = run_ranks(one_rank_misses_with_guards, 2, timeout=60)
    expected = 2 * float(torch.ones(4).sin().sum() * 2)
    for _rank, r in enumerate(outcome.results):
        assert r["totals"] == pytest.approx([expected] * 3)
        assert r["compiles"] == 2
        assert r["collectives"] == 2
    assert outcome.results[0]["forced_recompiles"] == 1  # rank 0 hit but was overruled
    assert outcome.results[1]["forced_recompiles"] == 0


def test_without_the_desync_check_every_rank_still_recompiles_together():
    env = rank_env(guard_desync_check=False)
    outcome = run_ranks(one_rank_misses_with_guards, 2, timeout=60, env=env)
    for r in outcome.results:
        assert r["compiles"] == 2 and r["collectives"] == 2
    assert outcome.results[0]["forced_recompiles"] == 1


@pytest.mark.fresh_ranks("its ranks hang by design and end their own processes")
def test_without_guard_collectives_the_same_loop_hangs(tmp_path):
    """A hang is both ranks waiting on each other: each rank's stack is read STUCK_S after it
    began call 2, while our timeout (120 s) and the default group's are far off."""
    outcome = run_ranks(
        one_rank_misses_without_guards,
        2,
        timeout=60,
        check=False,
        env=rank_env(timeout_s=120, pg_timeout_s=120, extra={"HARNESS_JOB_DIR": str(tmp_path)}),
    )
    assert outcome.results == [None, None] and not outcome.timed_out, outcome  # neither finished its loop
    stuck = {rank: json.loads((tmp_path / f"stuck.{rank}.json").read_text()) for rank in (0, 1)}
    # Rank 1 waits in the compiler collective of its recompile, rank 0 in the user's all-reduce.
    assert "agreements/compiler.py:exchange" in stuck[1], stuck[1]
    assert stuck[0][-1] == "distributed/distributed_c10d.py:all_reduce", stuck[0]
    for rank in (0, 1):  # ... each from the loop's own call
        assert "ranks/test_guard_collective.py:_train_like_loop" in stuck[rank], stuck[rank]


def in_flight_user_collective(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(4))  # compile: no guard collective yet
    t = torch.ones(1) * (rank + 1)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)  # cannot finish until rank 1 joins
        f(torch.ones(4))  # guard collective while the user's all-reduce is pending
        work.wait()
    else:
        f(torch.ones(4))  # guard collective first ...
        dist.all_reduce(t)  # ... then join the user's all-reduce
    return {"sum": t.item(), "guard_collectives": cc.stats()["guard_collectives"]}


def test_the_guard_collective_does_not_wait_for_a_user_collective_in_flight():
    outcome = run_ranks(in_flight_user_collective, 2, timeout=60)
    for r in outcome.results:
        assert r["sum"] == 3.0
        assert r["guard_collectives"] == 1


def steady_state(rank: int, world: int, calls: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    rec = GraphRecorder()
    f = torch.compile(_step, backend=rec)
    for _ in range(calls):
        f(torch.ones(4))
    return summary(rec)


@pytest.mark.parametrize("world", [2, 4])
def test_when_every_rank_hits_there_are_no_recompiles_and_one_guard_collective_per_call(world):
    calls = 25
    outcome = run_ranks(steady_state, world, args=(calls,))
    for r in outcome.results:
        assert r["compiles"] == 1
        # the first call compiles; a frame without compiled code has nothing to guard
        assert r["guard_collectives"] == calls - 1
        assert r["forced_recompiles"] == 0


def guards_not_requested(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()  # compiler collectives only
    f = torch.compile(_step, backend="eager")
    for _ in range(5):
        f(torch.ones(4))
    return {"guard_collectives": cc.stats()["guard_collectives"], "active": cc.guards_enabled()}


def test_guard_collectives_are_off_unless_asked_for():
    outcome = run_ranks(guards_not_requested, 2)
    for r in outcome.results:
        assert r == {"guard_collectives": 0, "active": False}


def guards_through_torch_switch(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    torch._dynamo.config.enable_compiler_collectives = True
    torch.compiler.set_enable_guard_collectives(True)
    f = torch.compile(_step, backend="eager")
    for _ in range(4):
        f(torch.ones(4))
    return {"guard_collectives": cc.stats()["guard_collectives"], "active": cc.guards_enabled()}


def test_torch_set_enable_guard_collectives_drives_our_implementation():
    outcome = run_ranks(guards_through_torch_switch, 2)
    for r in outcome.results:
        assert r == {"guard_collectives": 3, "active": True}


def guard_switch_read_while_calling(rank: int, world: int, calls: int) -> dict:
    import sys
    import threading

    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(4))
    stop = threading.Event()
    reads = []

    def reader() -> None:  # e.g. a monitoring thread, or enabled() in other code
        while not stop.is_set():
            reads.append(cc.guards_enabled())

    sys.setswitchinterval(1e-5)  # switch threads as often as the interpreter allows
    thread = threading.Thread(target=reader)
    before = cc.stats()["guard_collectives"]
    thread.start()
    try:
        for _ in range(calls):
            f(torch.ones(4))
    finally:
        stop.set()
        thread.join()
    return {"guard_collectives": cc.stats()["guard_collectives"] - before, "reads": len(reads), "all_on": all(reads)}


@pytest.mark.release_independent  # our switch's reads under threads; torch's switch: the tests beside it
def test_reading_the_guard_switch_from_another_thread_never_makes_a_call_skip_the_collective():
    calls = 3000
    # Two ranks: with one, no guard collective runs at all (nothing to agree with).
    for r in run_ranks(guard_switch_read_while_calling, 2, args=(calls,), timeout=120).results:
        assert r["reads"] > 1000, r  # the reader really ran alongside the calls
        assert r["all_on"], r
        assert r["guard_collectives"] == calls, r


def torch_switch_before_import(rank: int, world: int) -> dict:
    torch.compiler.set_enable_guard_collectives(True)  # torch's hook, before we are imported
    import compiler_collectives as cc

    f = torch.compile(_step, backend="eager")
    for _ in range(3):
        f(torch.ones(4))
    return {"guard_collectives": cc.stats()["guard_collectives"], "active": cc.guards_enabled()}


def test_a_guard_switch_flipped_before_import_is_taken_over_by_ours():
    outcome = run_ranks(torch_switch_before_import, 2)
    for r in outcome.results:
        assert r == {"guard_collectives": 2, "active": True}


def guards_from_env_only(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    f = torch.compile(_step, backend="eager")
    for _ in range(3):
        f(torch.ones(4))
    return {"guard_collectives": cc.stats()["guard_collectives"], "active": cc.guards_enabled()}


def test_the_guard_env_var_alone_turns_guard_collectives_on():
    outcome = run_ranks(guards_from_env_only, 2, env=rank_env(guards=True))
    for r in outcome.results:
        assert r == {"guard_collectives": 2, "active": True}


def rank_keeps_missing(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    torch._dynamo.config.recompile_limit = 3
    cc.enable(guards=True)
    rec = GraphRecorder()
    f = torch.compile(_step, backend=rec)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float32, torch.float64]
    values = []
    for _call, dtype in enumerate(dtypes):
        x = torch.ones(4, dtype=dtype if rank == 0 else torch.float32)
        values.append(float(f(x).float().sum()))
        t = torch.ones(1)
        dist.all_reduce(t)
    out = summary(rec)
    out["values_ok"] = all(abs(v - float(_step(torch.ones(4)).sum())) < 0.1 for v in values)
    return out


def test_when_one_rank_keeps_missing_all_ranks_reach_the_recompile_limit_together():
    outcome = run_ranks(rank_keeps_missing, 2, timeout=90)
    r0, r1 = outcome.results
    assert r0["compiles"] == r1["compiles"] == 3  # the limit, on every rank
    assert r0["collectives"] == r1["collectives"] == 3
    assert r0["values_ok"] and r1["values_ok"]


class _Twice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def same_frame_from_different_lines(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    m = torch.compile(_Twice(), backend="eager")
    f(torch.ones(2))
    m(torch.ones(2))
    # Rank-dependent branches that still run the same compiled frames in the
    # same order are fine: identity is the compiled frame, not the caller's line.
    if rank == 0:
        f(torch.ones(2))
        m(torch.ones(2))
    else:
        y = f(torch.ones(2))
        y = m(y)
    return {"guard_collectives": cc.stats()["guard_collectives"]}


def test_the_same_compiled_frames_called_from_different_lines_are_not_a_desync():
    outcome = run_ranks(same_frame_from_different_lines, 2)
    assert [r["guard_collectives"] for r in outcome.results] == [2, 2]


def frame_identity_of(rank: int, world: int) -> dict:
    import sys

    import torch._C._dynamo.eval_frame as c_eval_frame

    import compiler_collectives  # noqa: F401
    from compiler_collectives.agreements import guard_frames

    seen = []

    def probe(hit: bool) -> bool:
        seen.append(guard_frames.frame_identity(sys._getframe(1)))
        return hit

    f = torch.compile(_step, backend="eager")
    g = torch.compile(lambda x: x - 1, backend="eager")
    m = torch.compile(_Twice(), backend="eager")
    for fn in (f, g, m):
        fn(torch.ones(2))
    c_eval_frame.set_guard_complete_hook(probe)
    try:
        for fn in (f, g, m, f):
            fn(torch.ones(2))
    finally:
        c_eval_frame.set_guard_complete_hook(None)
    return {"ids": seen}


def test_frame_identity_tells_compiled_functions_and_modules_apart_and_is_stable():
    outcome = run_ranks(frame_identity_of, 2, init=True)
    ids0, ids1 = outcome.results[0]["ids"], outcome.results[1]["ids"]
    assert ids0 == ids1  # equal across processes
    f_id, g_id, m_id, f_again = ids0
    assert len({f_id, g_id, m_id}) == 3 and f_again == f_id
