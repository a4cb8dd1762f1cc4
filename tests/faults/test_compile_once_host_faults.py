"""Compile once across hosts, a compiler that stops, holds the GIL or dies (issue 37, item 1): it
is declared gone on evidence of its death (its connection to this rank reset, its process gone
where a rank of its host can see it, a failure it reported), never on heartbeat silence alone.

Two hosts, a cache dir and one rank each, with real inductor compiles on CPU (gloo) of
test_compile_once's one training step. Rank 1 compiles graph #1 (the plan's first turn), rank 0
waits for it; a fault is injected on rank 1 at the start of that compile. Where the compiler
dies with heartbeats on, the hosts are two torchrun agents (``tests.fixtures.run_agents``, c10d
rendezvous), configured by environment variables alone as a user would, because how each agent
reacts to its rank's death is part of the outcome. Elsewhere no agent would act (no rank ends,
or none acts on another host's rank, as under static rendezvous): the hosts are told apart by
``GROUP_RANK`` under ``run_ranks``, which spares four fresh interpreters a test. Torchrun's
static rendezvous is test_guard_transport.py's two agents.

The c10d store can fail under that wait too (issue 37, item 4): hosted there by a process of its
own, which rank 1 kills or stops as its compile starts; rank 1's post that its compile ended then
meets the failed store too. Those tests, and the broken collective's, tell hosts apart by
``GROUP_RANK`` under ``run_ranks``.
"""

from __future__ import annotations

import functools
import json
import signal
import time
from typing import Any

import pytest

from tests.fixtures import cache_per_rank, run_agents
from tests.harness import run_ranks
from tests.rank_env import rank_env
from tests.ranks.test_compile_once import ENV, _assert_trained_right, _states, job
from tests.ranks.test_compile_once_caches import (
    COMPILING_RANK,
    WAITING_RANK,
    _assert_no_refusals,
    job_with_compile_fault,
)

# Release-independent: what torch does here (torchrun's hosts, compile once's artifacts across them,
# a store's failure) is pinned per release by the seam tests of test_guard_transport.py and
# test_compile_once.py; these tests' subject is our liveness protocol's waits and verdicts.
# The broken collective's test below reads gloo's error: a seam test.
pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

STOP_S = 15  # past the 3 s after which a 1 s heartbeat counts as silent
HOLD_GIL_S = 12

# Each agent's rank: test_compile_once's step with the fault on rank 1, its result to a JSON file.
_TRAIN = """
import json, os, sys
import torch.distributed as dist
from tests.ranks.test_compile_once_caches import job_with_compile_fault

dist.init_process_group("gloo")
rank = dist.get_rank()
out = job_with_compile_fault(rank, dist.get_world_size(), json.loads(sys.argv[1]))
with open(os.path.join(sys.argv[2], f"rank{rank}.json"), "w") as f:
    json.dump({**out, "host": os.environ["GROUP_RANK"]}, f)
if out["type"] is not None:
    raise SystemExit(3)  # the job stopped: its agent ends, reporting this rank failed
dist.destroy_process_group()
"""


def _on_two_agents(tmp_path, rdzv: str, at_compile: str, seconds: int, env: dict | None = None, **kw):
    """Per rank, what it wrote (None: it wrote nothing), and the agents' outcome."""
    case = json.dumps({"at_compile": at_compile, "seconds": seconds, "killed_at": str(tmp_path / "killed_at")})
    env = {**ENV, "TORCH_COMPILER_COLLECTIVES": "1", **(env or {})}
    outcome = run_agents(tmp_path, _TRAIN, rdzv=rdzv, env=env, args=(case, str(tmp_path)), **kw)
    paths = [tmp_path / f"rank{r}.json" for r in range(2)]
    results = [json.loads(p.read_text()) if p.exists() else None for p in paths]
    return results, outcome


def _on_two_hosts(tmp_path, at_compile: str, seconds: int, env: dict | None = None, **kw) -> tuple[list, Any]:
    """Per rank, what it saw (None: nothing, it died), and the outcome: two hosts told apart by
    ``GROUP_RANK``, a cache dir each."""
    hosts = {r: {**dirs, "GROUP_RANK": str(r)} for r, dirs in cache_per_rank(tmp_path, 2, name="host").items()}
    case = {"at_compile": at_compile, "seconds": seconds, "killed_at": str(tmp_path / "killed_at")}
    outcome = run_ranks(
        job_with_compile_fault,
        2,
        args=(case,),
        env={**ENV, "TORCH_COMPILER_COLLECTIVES": "1", **(env or {})},
        rank_env=hosts,
        timeout=240,
        **kw,
    )
    results = [
        None if r is None else {**r, "host": hosts[rank]["GROUP_RANK"]} for rank, r in enumerate(outcome.results)
    ]
    return results, outcome


def _finished_on_two_hosts(results: list) -> None:
    assert sorted(r["host"] for r in results) == ["0", "1"]
    _assert_trained_right(results)
    _assert_no_refusals(results)
    assert _states(results) == ["loaded", "compiled"]


def _warnings_of_silence(result: dict) -> list[str]:
    return [line for line in result["logs"] if f"rank {COMPILING_RANK} (pid" in line and "not been heard from" in line]


@pytest.mark.timeout(300)
def test_a_compiler_on_another_host_stopped_for_15_s_is_waited_for_and_the_job_finishes(tmp_path):
    """SIGSTOP then SIGCONT (a debugger, a preempted VM): silent for 15 s, its connection intact."""
    results, _ = _on_two_hosts(tmp_path, "stop", STOP_S)
    _finished_on_two_hosts(results)
    assert results[WAITING_RANK]["records"][-1]["waited_s"] >= STOP_S
    silence = _warnings_of_silence(results[WAITING_RANK])
    assert silence, results[WAITING_RANK]["logs"]
    assert "another host" in silence[0] and "py-spy dump --native --pid" in silence[0], silence[0]


@pytest.mark.timeout(300)
def test_a_compiler_on_another_host_holding_the_gil_for_12_s_in_a_native_call_is_waited_for(tmp_path):
    results, _ = _on_two_hosts(tmp_path, "hold_gil", HOLD_GIL_S)
    _finished_on_two_hosts(results)
    assert _warnings_of_silence(results[WAITING_RANK]), results[WAITING_RANK]["logs"]


def _named_within_seconds(results: list, outcome, tmp_path) -> None:
    """Rank 1 died by the SIGKILL and wrote nothing; rank 0 raised our error naming it, within
    seconds of the kill, and ended by itself (exit 3: its agent did not stop it first), and the
    job stopped on both agents."""
    assert results[COMPILING_RANK] is None and outcome.exitcodes == {0: 3, 1: -signal.SIGKILL}, outcome.outputs
    assert all(code != 0 for code in outcome.returncodes), outcome.outputs
    assert results[WAITING_RANK] is not None, outcome.outputs
    _named_after_the_kill(results[WAITING_RANK], tmp_path)


def _named_after_the_kill(waiting: dict, tmp_path) -> None:
    """The waiting rank raised our error naming the compiler as gone, its connection broken,
    within seconds of the kill (not the 60 s collective timeout, nor the compile timeout's hour)."""
    assert "PeerFailureError" in waiting["chain"], waiting
    message = waiting["message"]
    assert f"rank {COMPILING_RANK} was to compile this graph" in message and "is gone" in message, message
    assert "its connection to this rank broke" in message, message
    # From the kill, not from the job's start: the compile before it takes a minute on a loaded machine.
    assert waiting["ended_at"] - float((tmp_path / "killed_at").read_text()) < 20


@pytest.mark.timeout(300)
def test_a_compiler_killed_on_another_host_is_named_within_seconds_not_waited_for_as_silent(tmp_path):
    """Its host's kernel resets its connections: evidence of death. Its silence alone would be
    waited for up to the compile timeout (an hour). Under c10d rendezvous agent 1 sees its rank
    die and ends; agent 0, which hosts the endpoint and restarts nothing, leaves rank 0 running."""
    kill = {COMPILING_RANK: signal.SIGKILL}
    _named_within_seconds(*_on_two_agents(tmp_path, "c10d", "die", 0, expect_signals=kill), tmp_path)


@pytest.mark.timeout(300)
def test_a_compiler_killed_on_another_host_is_named_within_seconds_with_heartbeats_off(tmp_path):
    """No agent tears the job down (the hosts told apart by ``GROUP_RANK``, no agent at all, as
    none acts on another host's rank under static rendezvous); with heartbeats off, only the reset
    connection tells rank 0 that rank 1, on the other host, died."""
    off = rank_env(heartbeat_s=0)
    kill = {COMPILING_RANK: signal.SIGKILL}
    results, outcome = _on_two_hosts(tmp_path, "die", 0, off, expect_signals=kill, check=False)
    assert results[COMPILING_RANK] is None and outcome.exitcodes[COMPILING_RANK] == -signal.SIGKILL, outcome
    assert results[WAITING_RANK] is not None, outcome
    _named_after_the_kill(results[WAITING_RANK], tmp_path)


# ---------------------------------------------------------------- the store fails under the wait

STORE_HOST = (
    "import time, torch.distributed as dist\n"
    "store = dist.TCPStore('127.0.0.1', 0, 2, True, wait_for_workers=False)\n"
    "print(store.port, flush=True)\n"
    "time.sleep(300)\n"
)
STORE_FAULTS = {"killed": signal.SIGKILL, "stopped": signal.SIGSTOP}
STORE_TIMEOUT_S = 5  # COMPILER_COLLECTIVES_TIMEOUT where the store stops: how long a store call may go unanswered
COMPILE_ON_S = 12  # how long the compiling rank compiles on after the store failed


def _fail_store_at_compile(pid: int, fault: str) -> None:
    """Once, at the start of a compile this rank runs for others: 2 s on (the other rank is in
    its wait by then), send the store's host ``STORE_FAULTS[fault]``, note when, and compile on
    ``COMPILE_ON_S`` longer."""
    import os

    import torch._inductor.compile_fx as cfx

    from compiler_collectives.agreements import once

    passes = cfx._recursive_post_grad_passes

    @functools.wraps(passes)
    def at_compile(*args: object, **kwargs: object) -> object:
        graph = once.current()
        if "failed_at" not in _store and graph is not None and graph.state.role == once.COMPILE:
            time.sleep(2.0)
            os.kill(pid, STORE_FAULTS[fault])
            _store["failed_at"] = time.time()
            time.sleep(COMPILE_ON_S)
        return passes(*args, **kwargs)

    cfx._recursive_post_grad_passes = at_compile


_store: dict[str, float] = {}


def job_whose_store_fails(rank: int, world: int, case: dict) -> dict:
    """test_compile_once's job on a TCPStore hosted by another process, which the compiling rank
    kills or stops while the other rank waits for its compile."""
    import datetime
    import os

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", case["port"], world, False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    import compiler_collectives as cc

    cc.enable()
    if rank == COMPILING_RANK:
        _fail_store_at_compile(case["pid"], case["fault"])
    out = job(rank, world, case)
    out["ended_at"] = time.time()
    out.update(_store)
    if rank == WAITING_RANK:
        os.kill(case["pid"], signal.SIGKILL)  # a stopped store: this rank's threads still inside it end too
    return out


@pytest.fixture(scope="module", params=["killed", "stopped"])
def failing_store(request, tmp_path_factory):
    """The job, its store killed or stopped as the compile starts: (fault, the store's port, the
    outcome). One run for both tests of a fault: the waiting rank's error and the compiling rank's."""
    import subprocess
    import sys

    fault = request.param
    tmp_path = tmp_path_factory.mktemp(f"store_{fault}")
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        hosts = {r: {**dirs, "GROUP_RANK": str(r)} for r, dirs in cache_per_rank(tmp_path, 2, name="host").items()}
        outcome = run_ranks(
            job_whose_store_fails,
            2,
            args=({"port": port, "pid": host.pid, "fault": fault},),
            env=rank_env(timeout_s=STORE_TIMEOUT_S, inductor_single_thread=True),
            rank_env=hosts,
            init=False,
            timeout=150,
            check=False,
        )
    finally:
        host.kill()
        host.wait(10)
    return fault, port, outcome


@pytest.mark.timeout(200)
def test_a_rank_waiting_for_a_compile_whose_store_fails_raises_a_store_failure_naming_the_store_within_seconds(
    failing_store,
):
    """Killed: the store's connections close, and the wait ends at once. Stopped: its calls go
    unanswered; the waiting rank's own heartbeat waits for the store's answer, and once it waited
    COMPILER_COLLECTIVES_TIMEOUT the wait ends (the compile timeout is an hour)."""
    fault, port, outcome = failing_store
    waiting, compiling = outcome.results[WAITING_RANK], outcome.results[COMPILING_RANK]
    assert waiting is not None and compiling is not None, outcome
    assert waiting["type"] == "StoreFailureError", waiting
    message = waiting["message"]
    assert message.startswith("compile once #1 of ") and f"on rank {WAITING_RANK}" in message, message
    assert f"the c10d store at 127.0.0.1:{port} " in message and "MASTER_ADDR" in message, message
    if fault == "stopped":
        assert f"did not answer this rank's heartbeat within {STORE_TIMEOUT_S}s" in message, message
    # Stopped: + up to a heartbeat (1 s) before one meets it, + the failure report's bound (3 s),
    # + slack for a loaded machine (8.5 s measured on 2 shared cores).
    within_s = 5.0 if fault == "killed" else STORE_TIMEOUT_S + 1.0 + 3.0 + 4.0
    assert waiting["ended_at"] - compiling["failed_at"] < within_s, (waiting["ended_at"], compiling["failed_at"])


@pytest.mark.timeout(200)
def test_a_compiling_rank_whose_post_meets_a_failed_store_raises_a_store_failure_naming_the_store_and_the_graph(
    failing_store,
):
    """Rank 1 compiles on after the store failed, then posts that its compile ended: our
    ``StoreFailureError``, published through the failure procedure, never c10d's own error. (The
    waiting rank cannot hear it through the failed store: it raises its own store failure, above.)
    Stopped: the waiting rank kills the store as it ends, so the post meets a stopped or a dead one."""
    _, port, outcome = failing_store
    compiling = outcome.results[COMPILING_RANK]
    assert compiling is not None, outcome  # our error, caught by the job: not torch's, which escapes it
    assert compiling["type"] == "StoreFailureError", compiling
    message = compiling["message"]
    assert message.startswith("compile once #1 of ") and f"on rank {COMPILING_RANK}:" in message, message
    assert "could not tell the ranks waiting for it that its compile of this graph ended" in message, message
    assert f"the c10d store at 127.0.0.1:{port} " in message and "MASTER_ADDR" in message, message
    # Published through the failure procedure: its store report meets the same failed store.
    assert any("could not report its failure on the c10d store" in line for line in compiling["logs"]), compiling


# ---------------------------------------------------------------- a broken collective names the peer


def _times_two(x):
    return x * 2


def _plus_one(x):
    return x + 1


def peer_killed_before_a_compiler_collective(rank: int, world: int) -> dict:
    import os

    import torch

    import compiler_collectives as cc
    from tests.rankside import caught

    cc.enable()
    torch.compile(_times_two, backend="eager")(torch.ones(2))  # our compile group exists
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)
    started = time.monotonic()
    result = caught(lambda: torch.compile(_plus_one, backend="eager")(torch.ones(2)))
    return {**result, "seconds": time.monotonic() - started}


@pytest.mark.timeout(120)
@pytest.mark.torch_seam  # gloo's error text on a broken connection
def test_a_collective_broken_by_a_peer_killed_on_another_host_names_it_with_heartbeats_off():
    """Gloo's error names an address only; the survivor looks at its connections to say which
    rank's broke, at once: no heartbeat, no diagnosis, no /proc across hosts."""
    outcome = run_ranks(
        peer_killed_before_a_compiler_collective,
        2,
        env=rank_env(timeout_s=60, heartbeat_s=0),
        rank_env={r: {"GROUP_RANK": str(r)} for r in range(2)},
        timeout=90,
        check=False,
        expect_signals={1: signal.SIGKILL},
    )
    survivor = outcome.results[0]
    assert survivor is not None and survivor["type"] == "PeerFailureError", outcome
    assert survivor["ranks"] == [1], survivor
    assert "the connection to rank 1 broke (gloo: " in survivor["message"], survivor["message"]
    assert survivor["seconds"] < 2.0, survivor
