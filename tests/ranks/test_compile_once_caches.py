"""Compile once in the caches real jobs have (issue 29): dirs warmed by another kind of run, shared
by two jobs, torn; and a compiling rank that stops, stalls past the compile timeout, or dies.

Real ranks and real inductor compiles on CPU (gloo), test_compile_once's one training step (a
forward and a backward), a cache dir per rank or one shared dir under ``tmp_path``. Every test
checks the step's gradients against eager and, where the job finishes, that no rank refused an
artifact. The step has C++ kernels (``KERNELS``) where the dirs' kernel binaries are the subject:
built by each dir in a run with compile once off, or written by two jobs at once. Elsewhere it has
none (a matmul: inductor calls the library for it, forward and backward). A dir warmed by a 1-rank
run is about the entry's key, which that run and a job with the service share; kernels served from
a warm dir are the subject of the dirs warmed with compile once off, below, and of
test_compile_once's warm-dir test.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.fixtures import cache_per_rank, shared_cache
from tests.harness import run_ranks
from tests.rank_env import rank_env
from tests.ranks.test_compile_once import ENV, _assert_trained_right, _run, _states, job
from tests.rankside import patch

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.torch_seam,
]

# With no warm entry, ``plan.decide`` hands graph #1 to members[(seq 1 + turn 0) % 2] = rank 1.
KERNELS = {"kernels": True}  # test_compile_once's job with its C++ kernel step
COMPILING_RANK = 1
WAITING_RANK = 0


def _warm(cache_dir: os.PathLike, case: dict) -> None:
    """A 1-rank job over ``cache_dir`` that leaves it warm: a plain run, since compile once and
    the collectives only act with two ranks or more."""
    run_ranks(job, 1, args=(case,), env={**ENV, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}, timeout=240)


def _assert_no_refusals(results: list) -> None:
    for r in results:
        assert r["stats"]["once_refused"] == 0 and r["stats"]["once_digest_mismatches"] == 0, r["stats"]
        assert not [x for x in r["records"] if "refused" in (x["why"] or "")], r["records"]
        assert not [line for line in r["logs"] if "refused" in line], r["logs"]


def _binaries(root: os.PathLike) -> dict[str, bytes]:
    found = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".so"):
                with open(os.path.join(d, f), "rb") as fh:
                    found[os.path.relpath(os.path.join(d, f), root)] = fh.read()
    return found


# ---------------------------------------------------------------- warm and shared dirs


@pytest.mark.timeout(360)
@pytest.mark.release_independent  # a warm entry served: test_compile_once's warm-cache test
def test_a_dir_warmed_by_a_1_rank_run_serves_a_rank_whose_dir_is_empty(tmp_path):
    # Without the service's backward lowering in its key, a 1-rank entry is what a 2-rank job looks up.
    _warm(tmp_path / "rank0", {})
    results = _run(tmp_path, separate=True).results
    _assert_trained_right(results)
    _assert_no_refusals(results)
    assert _states(results) == ["served", "loaded"]
    assert results[1]["stats"]["once_loaded"] == 1 and results[1]["stats"]["once_bytes_received"] > 0


def job_with_compile_once_off(rank: int, world: int, case: dict) -> dict:
    """test_compile_once's job with compile once off in this rank, as
    ``COMPILER_COLLECTIVES_COMPILE_ONCE=0`` has it: switched in the rank (``config.override``), so
    that the pool's ranks run it (another environment would start other ranks, then ours again)."""
    from compiler_collectives import config

    with config.override(compile_once=False):
        return job(rank, world, case)


@pytest.mark.timeout(420)
@pytest.mark.release_independent  # keys alike with the service off: test_compile_once_keys' test
def test_dirs_warmed_with_compile_once_off_serve_the_job_with_it_on(tmp_path):
    dirs = cache_per_rank(tmp_path, 2)
    off = run_ranks(job_with_compile_once_off, 2, args=(KERNELS,), env=ENV, rank_env=dirs, timeout=240)
    assert all(r["records"] == [] and r["stats"]["once_exchanges"] == 0 for r in off.results)  # it was off
    # Each dir built its own kernels: the same names, other bytes (a binary embeds its build dir).
    own = [_binaries(tmp_path / f"rank{r}") for r in range(2)]
    assert any(own[1].get(name, blob) != blob for name, blob in own[0].items()), "no kernel binary differs"
    results = _run(tmp_path, KERNELS, separate=True).results
    _assert_trained_right(results)
    _assert_no_refusals(results)
    # Rank 0 serves its entry; rank 1 loads it into its own dir, whose kernel binaries differ.
    assert _states(results) == ["served", "loaded"]
    assert all(r["stats"]["audit_cache_recompiles"] == 0 for r in results)


@pytest.mark.timeout(420)
@pytest.mark.release_independent  # one dir shared: test_compile_once's shared-dir test
def test_two_jobs_started_together_on_one_dir_both_train_right(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(_run, tmp_path, KERNELS) for _ in range(2)]
        outcomes = [j.result() for j in jobs]
    for outcome in outcomes:
        _assert_trained_right(outcome.results)
        _assert_no_refusals(outcome.results)
        # A job compiles its graph, or serves what the other job saved first.
        assert sorted(_states(outcome.results)) in (["compiled", "loaded"], ["loaded", "served"])
    assert outcomes[0].results[0]["grad"] == outcomes[1].results[0]["grad"]


@pytest.mark.timeout(360)
def test_a_dir_whose_entries_are_all_truncated_is_compiled_again_and_served(tmp_path):
    shared = tmp_path / "shared"
    _warm(shared, {})
    torn = 0
    for level in ("aotautograd", "fxgraph"):
        for d, _, files in os.walk(shared / level):
            for f in files:
                path = os.path.join(d, f)
                os.truncate(path, os.path.getsize(path) // 2)
                torn += 1
    assert torn >= 2
    results = _run(tmp_path).results
    _assert_trained_right(results)
    _assert_no_refusals(results)
    # Rank 0 holds the entry, torn: its lookup misses, it compiles and serves; rank 1 loads that.
    assert _states(results) == ["served", "loaded"]


# ---------------------------------------------------------------- the compiling rank stops, stalls, dies


def _at_compile(action: str, seconds: float, killed_at: str | None = None) -> None:
    """Once, at the start of a compile this rank runs for others (its plan: compile), stop this
    process for ``seconds`` (SIGSTOP; a helper sends SIGCONT), sleep ``seconds``, hold the GIL
    for ``seconds`` in one native call, or SIGKILL it."""
    import torch._inductor.compile_fx as cfx

    from compiler_collectives.agreements import once

    passes = cfx._recursive_post_grad_passes
    fired: list[bool] = []

    @functools.wraps(passes)
    def at_compile(*args: object, **kwargs: object) -> object:
        graph = once.current()
        if not fired and graph is not None and graph.state.role == once.COMPILE:
            fired.append(True)
            if action == "stop":
                resume = subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGSTOP)
                resume.wait()
            elif action == "stall":
                time.sleep(seconds)
            elif action == "die":
                if killed_at is not None:  # when, for a test that times how soon the others know
                    with open(killed_at, "w") as f:
                        f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            elif action == "hold_gil":
                # One native call that keeps the GIL (PyDLL does not release it), as a triton or
                # pybind call may: the heartbeat thread cannot beat meanwhile.
                ctypes.PyDLL(None).sleep(int(seconds))
        return passes(*args, **kwargs)

    patch(cfx, "_recursive_post_grad_passes", at_compile)


def job_with_compile_fault(rank: int, world: int, case: dict) -> dict:
    """test_compile_once's job; on the compiling rank, ``_at_compile(case["at_compile"], case["seconds"])``."""
    import compiler_collectives as cc

    cc.enable()
    if rank == COMPILING_RANK:
        _at_compile(case["at_compile"], case["seconds"], case.get("killed_at"))
    started = time.monotonic()
    out = job(rank, world, case)
    out["job_s"] = time.monotonic() - started
    out["ended_at"] = time.time()
    return out


def _faulty(tmp_path, at_compile: str, seconds: float, env: dict, **kw):
    return run_ranks(
        job_with_compile_fault,
        2,
        args=({"at_compile": at_compile, "seconds": seconds},),
        env={**ENV, **shared_cache(tmp_path), **env},
        timeout=240,
        **kw,
    )


@pytest.mark.timeout(300)
@pytest.mark.release_independent
def test_a_compiling_rank_stopped_longer_than_its_heartbeat_staleness_is_waited_for(tmp_path):
    """The loader's compile wait (``liveness.COMPILE_WAIT``), not the failure diagnosis: the
    compiler's process is stopped (SIGSTOP) for 4 s, past the 1.75 s after which a 0.5 s
    heartbeat counts as silent; on this host /proc says it is stopped, so the loader waits,
    warns once, and takes the artifact once it resumes (SIGCONT)."""
    results = _faulty(tmp_path, "stop", 4, rank_env(heartbeat_s=0.5)).results
    _assert_trained_right(results)
    _assert_no_refusals(results)
    assert _states(results) == ["loaded", "compiled"]
    assert results[WAITING_RANK]["records"][-1]["waited_s"] >= 4
    about_it = [
        line
        for line in results[WAITING_RANK]["logs"]
        if f"rank {COMPILING_RANK}'s" in line and ("stopped" in line or "silent" in line)
    ]
    # One warning names the stop. On a loaded machine the compiler's heartbeat thread may also
    # have been starved for a moment before it; that verdict (running, waited for) has its own.
    stopped = [line for line in about_it if "is stopped (SIGSTOP" in line]
    starved = [line for line in about_it if "heartbeat is silent" in line and "runs: still waiting" in line]
    assert len(stopped) == 1 and len(starved) <= 1, about_it
    assert len(about_it) == len(stopped) + len(starved), about_it


@pytest.mark.timeout(300)
@pytest.mark.release_independent
def test_a_compile_past_the_compile_timeout_ends_the_job_on_every_rank_naming_it(tmp_path):
    outcome = _faulty(tmp_path, "stall", 6, rank_env(compile_timeout_s=2), check=False)
    waiting, compiling = outcome.results[WAITING_RANK], outcome.results[COMPILING_RANK]
    assert "CompileOnceError" in waiting["chain"], waiting
    assert "COMPILER_COLLECTIVES_COMPILE_TIMEOUT" in waiting["message"]
    assert f"for rank {COMPILING_RANK} to compile" in waiting["message"]
    # The compiling rank hears the loader's report at its next exchange, once its compile ends.
    assert compiling["type"] == "PeerFailureError", compiling
    assert f"rank {WAITING_RANK}" in compiling["message"] and "COMPILE_TIMEOUT" in compiling["message"]
    assert not [r for r in outcome.results if "CollectiveDesyncError" in r["chain"]]
    # The loader gives up at the 2 s compile timeout. The compiling rank's job is its compile
    # (seconds alone, a minute or more beside other tests); that it ends on the loader's report,
    # not on our 60 s collective timeout, is its error's type above.
    assert waiting["job_s"] < 60


@pytest.mark.timeout(300)
@pytest.mark.release_independent
def test_a_compiling_rank_that_dies_with_heartbeats_off_is_named_within_seconds(tmp_path):
    # On this host /proc shows the death; no heartbeat is needed, nor the compile timeout.
    env = rank_env(heartbeat_s=0, compile_timeout_s=120)
    outcome = _faulty(tmp_path, "die", 0, env, check=False, expect_signals={COMPILING_RANK: signal.SIGKILL})
    waiting = outcome.results[WAITING_RANK]
    assert waiting is not None and "PeerFailureError" in waiting["chain"], outcome
    assert f"rank {COMPILING_RANK} was to compile this graph" in waiting["message"] and "is gone" in waiting["message"]
    assert waiting["job_s"] < 30
