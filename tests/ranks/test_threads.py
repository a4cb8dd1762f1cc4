"""Thread ownership (issue 22): one thread per rank compiles and runs compiled code, the rest are refused.

The owner is the thread of the rank's first compiled call, a compiling call
included. Any other thread's call raises ``ConcurrentThreadsError`` at its own
call site before it enters any exchange, did not run, and leaves nothing
behind that the owner could see. Threads are never compared across ranks.

Each test runs one two-rank gloo job under a hard deadline. A counter the
compiled function bumps (a global tensor, mutated in the graph) tells whether
a refused call ran.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.harness import run_ranks
from tests.rank_env import rank_env
from tests.rankside import caught

pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

ENV = rank_env(timeout_s=6, pg_timeout_s=1800)

RUNS = torch.zeros(3)  # how often _f, _g and _warm ran, in this rank process


def _f(x: torch.Tensor) -> torch.Tensor:
    RUNS[0] += 1
    return x * 3


def _g(x: torch.Tensor) -> torch.Tensor:
    RUNS[1] += 1
    return x - 3


def _warm(x: torch.Tensor) -> torch.Tensor:
    RUNS[2] += 1
    return x + 1


def _fresh(x: torch.Tensor) -> torch.Tensor:
    return x * 5


def _grows(x: torch.Tensor) -> torch.Tensor:
    return x.sum() + x.numel()


def _in_thread(name: str, fn) -> None:
    thread = threading.Thread(target=fn, name=name)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"{name} still running"


def _report(out: dict) -> dict:
    import compiler_collectives as cc

    first = cc.health.latch.first_failure
    stats = cc.stats()
    return {
        **out,
        "poisoned": None if first is None else str(first),
        "guard_collectives": stats["guard_collectives"],
        "compiler_collectives": stats["compiler_collectives"],
    }


# ---------------------------------------------------------------- 1: the first call compiles


def owner_compiles_then_a_helper_calls(rank: int, world: int, rounds: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_f, backend="eager")
    g = torch.compile(_g, backend="eager")
    x = torch.ones(2)
    out = []

    def one_round(i: int) -> dict:
        record: dict = {}

        def owner() -> None:
            record["first"] = [float(f(x).sum()), float(g(x).sum())]  # both compile
            g_runs = float(RUNS[1])

            def helper() -> None:
                record["helper"] = caught(lambda: g(x))

            _in_thread(f"helper-{i}", helper)
            record["helper_g_ran"] = float(RUNS[1]) - g_runs
            later = [caught(lambda: f(x)) for _ in range(3)] + [caught(lambda: g(x)) for _ in range(3)]
            record["later"] = [c["type"] for c in later]

        _in_thread(f"owner-{i}", owner)
        return record

    for i in range(rounds):
        # Every round starts with no live owner (the last round's owner ended) and cold frames:
        # the owner's first calls compile, and never reach the guard hook before the helper does.
        torch._dynamo.reset()
        out.append(one_round(i))
    return _report({"rounds": out})


@pytest.mark.timeout(120)
def test_a_helper_calling_after_the_owner_only_compiled_is_refused_and_the_owner_runs_on():
    rounds = 3
    outcome = run_ranks(owner_compiles_then_a_helper_calls, 2, args=(rounds,), env=ENV, timeout=90)
    for r in outcome.results:
        assert len(r["rounds"]) == rounds, r
        for i, record in enumerate(r["rounds"]):
            assert record["first"] == [6.0, -4.0], record
            helper = record["helper"]
            assert helper["type"] == "ConcurrentThreadsError", record
            assert f"'helper-{i}'" in helper["message"] and f"'owner-{i}'" in helper["message"], helper
            assert record["helper_g_ran"] == 0.0, record  # the refused call did not run
            assert record["later"] == [None] * 6, record
        assert r["poisoned"] is None, r
    # Both ranks ran the same collectives: every owner call after the first compiles is one.
    assert outcome.results[0]["guard_collectives"] == outcome.results[1]["guard_collectives"] == 6 * rounds


# ---------------------------------------------------------------- 2: a refusal stays with the helper


def owner_recompiles_while_a_helper_loops(rank: int, world: int, compiles: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    torch._dynamo.config.recompile_limit = compiles + 4
    warm = torch.compile(_warm, backend="eager")
    grows = torch.compile(_grows, backend="eager", dynamic=False)  # a new size: a recompile
    warm(torch.ones(2))
    warm(torch.ones(2))  # a guard collective: the main thread owns this rank's collectives
    warm_runs = float(RUNS[2])
    stop = threading.Event()
    helper_calls: list = []

    def helper() -> None:
        while not stop.is_set() and len(helper_calls) < 500:
            helper_calls.append(caught(lambda: warm(torch.ones(2)))["type"])

    thread = threading.Thread(target=helper, name="helper")
    thread.start()
    owner = [caught(lambda n=n: grows(torch.ones(n))) for n in range(3, 3 + compiles)]
    stop.set()
    thread.join(60)
    return _report(
        {
            "owner": [o["type"] for o in owner],
            "owner_messages": [o.get("message") for o in owner if o["type"]],
            "helper": sorted(set(helper_calls), key=str),
            "helper_calls": len(helper_calls),
            "warm_ran_in_helper": float(RUNS[2]) - warm_runs,
        }
    )


@pytest.mark.timeout(120)
def test_a_helper_s_refusals_never_surface_in_the_owner_that_recompiles_on_every_call():
    compiles = 10
    outcome = run_ranks(owner_recompiles_while_a_helper_loops, 2, args=(compiles,), env=ENV, timeout=90)
    for r in outcome.results:
        assert r["owner"] == [None] * compiles, r["owner_messages"]
        assert r["helper"] == ["ConcurrentThreadsError"] and r["helper_calls"] > 0, r
        assert r["warm_ran_in_helper"] == 0.0, r  # no refused call ran
        assert r["poisoned"] is None, r
    assert outcome.results[0]["guard_collectives"] == outcome.results[1]["guard_collectives"], outcome.results
    assert outcome.results[0]["compiler_collectives"] == outcome.results[1]["compiler_collectives"], outcome.results


# ---------------------------------------------------------------- 3: the compiler collective refuses too


def _exchanges(stats: dict) -> int:
    return stats["compiler_collectives"] + stats["compiler_input_exchanges"]


def a_helper_compiles_a_new_function(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_f, backend="eager")
    fresh = torch.compile(_fresh, backend="eager")
    f(torch.ones(2))  # compiles: the main thread owns this rank's collectives
    compiles_before = _exchanges(cc.stats())
    record: dict = {}

    def helper() -> None:
        # torch keeps config overrides per thread: enable() in the main thread leaves this
        # thread's compiles without the compiler collective (TORCH_COMPILER_COLLECTIVES=1 reaches
        # every thread). Switch it on here, as a job with the variable set has it.
        cc.enable()
        record["helper"] = caught(lambda: fresh(torch.ones(2)))  # not compiled yet

    _in_thread("helper", helper)
    record["helper_exchanges"] = _exchanges(cc.stats()) - compiles_before
    # The owner's next compiles pair up with the other rank's.
    record["owner"] = [float(fresh(torch.ones(2)).sum()), float(f(torch.ones(3)).sum()), float(f(torch.ones(2)).sum())]
    return _report(record)


@pytest.mark.timeout(120)
def test_a_helper_calling_a_function_not_compiled_yet_is_refused_before_the_compiler_collective():
    outcome = run_ranks(a_helper_compiles_a_new_function, 2, env=ENV, timeout=90)
    for r in outcome.results:
        helper = r["helper"]
        assert helper["type"] == "ConcurrentThreadsError", r
        assert "'helper'" in helper["message"] and "'MainThread'" in helper["message"], helper
        assert "did not run" in helper["message"], helper
        assert r["helper_exchanges"] == 0, r  # no compiler collective entered
        assert r["owner"] == [10.0, 9.0, 6.0], r
        assert r["poisoned"] is None, r
    assert outcome.results[0]["compiler_collectives"] == outcome.results[1]["compiler_collectives"], outcome.results
