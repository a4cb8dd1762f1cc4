"""The pool of ranks (``tests/pool.py``): reused from test to test, and never passing one
test's leftovers or failure on to the next."""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time

import pytest

from tests.harness import RanksFailed, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]


@pytest.fixture
def same_ranks(caplog: pytest.LogCaptureFixture):
    """``check(first, second)``: two jobs' pids, by rank, that a pool's ranks served. Equal, unless
    gloo's connect failed as the pool's ranks joined the later job's group (now and then, on a
    loaded machine: "Connection closed by peer"): the harness then ran it on a new pool, and
    said so. Either way nothing was left: a leak fails the job that left it."""
    caplog.set_level(logging.WARNING, logger="tests.pool")

    def check(first: list[int], second: list[int]) -> None:
        if list(first) != list(second):
            assert "could not join the test's group; trying on a new pool" in caplog.text, (first, second)

    return check


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


def leave_torch_patched(rank: int, world: int) -> int:
    import torch._inductor.compile_fx as compile_fx

    passes = compile_fx._recursive_post_grad_passes
    compile_fx._recursive_post_grad_passes = lambda *args, **kwargs: passes(*args, **kwargs)  # a fault, never undone
    return os.getpid()


def fault_under_our_seam(rank: int, world: int, how: str) -> int:
    """A fault in inductor's post-grad passes, then our seams bound as the first compile that
    needs them binds them. ``how``: "patched" (``rankside.patch``, torch's signature: our seam
    wraps the fault, holding it as torch's own); "assigned" (the same, never undone); "put back"
    (assigned, then torch's function assigned back over our seam); "unsigned" (patched, with
    parameters that are not torch's: our seam's check drops its level)."""
    import torch._inductor.compile_fx as compile_fx

    from compiler_collectives.dynamo import audit_seam, bound
    from tests.rankside import patch

    bound.unbind_levels()  # as in a rank that has not compiled with inductor yet
    passes = compile_fx._recursive_post_grad_passes

    def fault(*args: object, **kwargs: object) -> object:
        return passes(*args, **kwargs)

    if how != "unsigned":
        functools.wraps(passes)(fault)
    if how in ("patched", "unsigned"):
        patch(compile_fx, "_recursive_post_grad_passes", fault)
    else:
        compile_fx._recursive_post_grad_passes = fault  # never undone
    audit_seam.ensure_backend_seams()
    if how == "unsigned":
        assert bound.levels["inductor"] is False
    else:
        assert compile_fx._recursive_post_grad_passes is not fault  # our seam, over the fault
    if how == "put back":
        compile_fx._recursive_post_grad_passes = passes  # the fault "undone": ours is gone too
    return os.getpid()


def torchs_own_under_our_seam(rank: int, world: int) -> tuple[int, str]:
    import torch._inductor.compile_fx as compile_fx

    from compiler_collectives.dynamo import audit_seam, bound

    audit_seam.ensure_backend_seams()
    held = bound.originals["recursive_post_grad_passes"]
    assert compile_fx._recursive_post_grad_passes is not held  # our seam is in place, over it
    return os.getpid(), held.__module__


def leave_our_method_patched(rank: int, world: int) -> int:
    from compiler_collectives.transport import table

    table.Table.pack = lambda self: b""  # a fault injected into a class of ours, never undone
    return os.getpid()


def leave_a_constant_of_ours_changed(rank: int, world: int) -> int:
    from compiler_collectives import version

    version.__version__ = "0.0.9"  # as if an older wheel were installed: never undone
    return os.getpid()


def test_a_patched_function_our_seam_wrapped_since_is_put_back_from_under_it_for_the_next_test(same_ranks):
    first = run_ranks(fault_under_our_seam, 2, args=("patched",)).results
    second = run_ranks(torchs_own_under_our_seam, 2).results
    same_ranks(first, [p for p, _ in second])  # the same ranks: nothing was left
    assert [m for _, m in second] == ["torch._inductor.compile_fx"] * 2


@pytest.mark.parametrize(
    ("how", "named"),
    [
        ("assigned", "a test's function held by our seams as torch's own (recursive_post_grad_passes)"),
        ("put back", "our seams bound at a compile and no longer in torch's place (recursive_post_grad_passes)"),
        ("unsigned", "our seams' level(s) ['inductor'] dropped"),
    ],
    ids=["held", "displaced", "dropped"],
)
def test_a_seam_of_ours_a_tests_fault_left_wrong_fails_the_test_naming_it_and_the_next_gets_torchs_own(how, named):
    before = run_ranks(pid, 2).results
    with pytest.raises(RanksFailed, match="was left holding, after the test") as failed:
        run_ranks(fault_under_our_seam, 2, args=(how,))
    assert named in str(failed.value)
    after = run_ranks(torchs_own_under_our_seam, 2).results
    assert not set(before) & {p for p, _ in after}
    assert [m for _, m in after] == ["torch._inductor.compile_fx"] * 2


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


def test_consecutive_tests_run_in_the_same_rank_processes(same_ranks):
    first = run_ranks(compile_and_guard, 2).results
    second = run_ranks(compile_and_guard, 2).results
    same_ranks([p for p, _ in first], [p for p, _ in second])
    # and behave alike: the second starts from the pool's state, not the first's
    assert [y for _, y in first] == [y for _, y in second]


@pytest.mark.parametrize(
    ("leak", "named"),
    [
        (leave_a_thread_of_ours, "threads ['compiler_collectives-planted'] still running"),
        (leave_a_setting_changed, "settings changed and not put back (timeout_s: "),
        (
            leave_torch_patched,
            "values replaced and not put back (torch._inductor.compile_fx._recursive_post_grad_passes)",
        ),
        (
            leave_our_method_patched,
            "values replaced and not put back (compiler_collectives.transport.table.Table.pack)",
        ),
        (
            leave_a_constant_of_ours_changed,
            "values replaced and not put back (compiler_collectives.version.__version__)",
        ),
    ],
    ids=["thread", "setting", "torch-patch", "our-patch", "our-constant"],
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


def test_a_variable_a_test_sets_in_its_ranks_is_gone_for_the_next_test(same_ranks):
    same_ranks(run_ranks(leave_a_variable_set, 2).results, run_ranks(pid, 2).results)
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


def cache_dir_seen(rank: int, world: int) -> tuple[int, str]:
    return os.getpid(), os.environ["TORCHINDUCTOR_CACHE_DIR"]


def test_ranks_with_an_inductor_cache_dir_each_run_in_the_pool_and_each_sees_its_own(tmp_path, same_ranks):
    from tests.fixtures import cache_per_rank

    before = run_ranks(pid, 2).results
    seen = run_ranks(cache_dir_seen, 2, rank_env=cache_per_rank(tmp_path, 2)).results
    same_ranks(before, [p for p, _ in seen])
    assert [d for _, d in seen] == [str(tmp_path / "rank0"), str(tmp_path / "rank1")]


def timeout_seen(rank: int, world: int) -> tuple[int, float]:
    from compiler_collectives import config

    return os.getpid(), config.settings.timeout_s


def test_tests_that_alternate_two_environments_each_run_in_a_pool_of_their_own_ranks_kept_between(same_ranks):
    from tests.rank_env import rank_env

    short = rank_env(timeout_s=37)
    first, other = run_ranks(timeout_seen, 2).results, run_ranks(timeout_seen, 2, env=short).results
    four = run_ranks(pid, 4).results  # a third pool beside them
    again, other_again = run_ranks(timeout_seen, 2).results, run_ranks(timeout_seen, 2, env=short).results
    same_ranks([p for p, _ in first], [p for p, _ in again])
    same_ranks([p for p, _ in other], [p for p, _ in other_again])
    assert [t for _, t in again] == [t for _, t in first] and [t for _, t in other_again] == [t for _, t in other]
    assert not {p for p, _ in first} & {p for p, _ in other} and not {p for p, _ in first} & set(four)
    assert {t for _, t in other} == {37.0} and {t for _, t in first} != {37.0}  # each ran as its pool started
