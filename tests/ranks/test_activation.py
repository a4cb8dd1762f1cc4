"""How the service is switched on in live ranks (imported before the group exists, on one rank),
what torch does without it, and what a forked child keeps of its wiring and runtime. Installing and
uninstalling in this process: ``tests/unit/test_install.py``; switched on by torch's own variable
alone, at import torch, in two ranks of their own: ``tests/ranks/test_autoload.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks
from tests.rankside import GraphRecorder, init_gloo, summary
from tests.unit.test_install import EVERYTHING_WIRED_ONCE, _wired

# Multi-process tests here: torch seam (tests/tiers.py).
pytestmark = pytest.mark.torch_seam


def _fn(x: torch.Tensor) -> torch.Tensor:
    return x.cos().sum(0)


def import_before_init(rank: int, world: int, store_path: str) -> dict:
    import compiler_collectives as cc  # before any process group exists

    cc.enable()
    init_gloo(rank, world, f"file://{store_path}")
    rec = GraphRecorder()
    f = torch.compile(_fn, backend=rec)
    f(torch.ones(5 + rank, 3))
    f(torch.ones(9, 3))
    out = summary(rec)
    dist.destroy_process_group()
    return out


@pytest.mark.multiprocess
def test_importing_the_package_before_init_process_group_works(tmp_path):
    store = str(tmp_path / "store")
    outcome = run_ranks(import_before_init, 2, args=(store,), init=False)
    for r in outcome.results:
        assert r["graphs"] == [[["s", 3]]]
        assert r["collectives"] == 1


def single_rank(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    rec = GraphRecorder()
    f = torch.compile(_fn, backend=rec)
    f(torch.ones(5, 3))
    f(torch.ones(5, 3))
    return summary(rec)


@pytest.mark.multiprocess
def test_a_one_rank_gloo_group_works():
    (r,) = run_ranks(single_rank, 1).results
    assert r["graphs"] == [[[5, 3]]]
    assert r["collectives"] == 1 and r["restarts_skipped"] == 1
    assert r["guard_collectives"] == 0  # one rank: nothing to agree with, no guard collective runs


def torch_own_on_gloo(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.uninstall()
    torch._dynamo.config.enable_compiler_collectives = True
    f = torch.compile(_fn, backend="eager")
    try:
        f(torch.ones(5 + rank, 3))
    except Exception as e:  # noqa: BLE001 - we report what torch raised
        return {"raised": type(e).__name__, "message": str(e)[:500]}
    return {"raised": None}


def ours_on_gloo(rank: int, world: int) -> dict:
    import compiler_collectives  # noqa: F401

    torch._dynamo.config.enable_compiler_collectives = True
    f = torch.compile(_fn, backend="eager")
    out = f(torch.ones(5 + rank, 3))
    return {"ok": bool(torch.allclose(out, _fn(torch.ones(5 + rank, 3))))}


@pytest.mark.fresh_ranks("torch's own implementation runs here: our package must not be installed in the ranks")
@pytest.mark.multiprocess
def test_torch_own_compiler_collective_fails_on_gloo_where_ours_works():
    theirs = run_ranks(torch_own_on_gloo, 2, timeout=60)
    for r in theirs.results:
        assert r["raised"] is not None, "torch's own implementation unexpectedly ran on gloo/CPU"
    ours = run_ranks(ours_on_gloo, 2, timeout=60)
    assert all(r["ok"] for r in ours.results)


@pytest.mark.multiprocess
def test_a_forked_child_keeps_the_wiring():
    import os

    import compiler_collectives  # noqa: F401  (its fork handler runs in the child)

    pid = os.fork()
    if pid == 0:  # the child: after_fork_in_child has run
        code = 1
        try:
            code = 0 if _wired() == EVERYTHING_WIRED_ONCE else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.multiprocess
def test_a_forked_child_builds_its_own_runtime_under_its_parents_number():
    import os

    from compiler_collectives import health, runtime, transport
    from compiler_collectives.agreements import generation, guard_state

    parent = runtime.current()
    before = parent.generation
    pid = os.fork()
    if pid == 0:  # the child: the fork handler built the child's runtime
        code = 1
        try:
            child = runtime.current()
            now = child.generation
            checks = [
                child is not parent,
                child.settings is parent.settings and child.ledger is parent.ledger,
                now.number == before.number,
                all(getattr(now, part) is not getattr(before, part) for part in ("latch", "transport", "agreements")),
                now.guard is not before.guard,
                health.latch is now.latch and generation.current() is now.agreements,
                guard_state.state is now.guard and transport.groups.number == now.number,
            ]
            code = 0 if all(checks) else 10 + checks.index(False)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert runtime.current() is parent and parent.generation is before  # the parent's is untouched
