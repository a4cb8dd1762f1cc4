"""The process models users run: forked children, re-init, threads, signal handlers, one rank (issue 18).

Each test runs real gloo ranks and real torch.compile under a hard deadline.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.fixtures import GUARD_TRANSPORTS, NAMED_WITHIN_SECONDS, guard_env
from tests.harness import free_port, release, run_ranks, stay_until
from tests.rank_env import rank_env
from tests.rankside import caught, init_gloo

# Every test here starts rank processes: the multi-process tier.
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_seam]

TIMEOUT_S = 6.0
PG_TIMEOUT_S = 1800
ENV = rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S)


def _env(transport: str, base: dict[str, str] = ENV) -> dict[str, str]:
    return guard_env(transport, base)


def _step(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def _other(x: torch.Tensor) -> torch.Tensor:
    return x - 3


# ---------------------------------------------------------------- reinit


def reinit_on_the_same_port(rank: int, world: int, port: int, generations: int, coordination: str) -> list:

    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    # The job's own coordination (torchrun's, say): no rank starts a generation before every
    # rank ended the last one, else a rank could meet the last generation's store on the port.
    coordinate = dist.FileStore(coordination, world)
    out = []
    for generation in range(generations):
        coordinate.add(f"ended/{generation - 1}", 1)
        coordinate.wait([f"ended/{generation - 1}"])
        while coordinate.add(f"ended/{generation - 1}", 0) < world:
            time.sleep(0.01)
        init_gloo(rank, world, f"tcp://127.0.0.1:{port}")
        g = torch.compile(lambda x, k=generation: x + k, backend="eager")  # a new frame: a compiler collective
        values = [float(f(torch.ones(2)).sum()) for _ in range(3)] + [float(g(torch.ones(2)).sum())]
        out.append(
            {
                "values": values,
                "transport": cc.stats()["guard_transport"],
                "poisoned": cc.health.latch.first_failure is not None,
            }
        )
        dist.destroy_process_group()
    return out


@pytest.mark.timeout(180)
@GUARD_TRANSPORTS
def test_destroy_then_init_on_the_same_port_works_again_and_again(transport, tmp_path):
    generations = 4
    outcome = run_ranks(
        reinit_on_the_same_port,
        2,
        args=(free_port(), generations, str(tmp_path / "coordination")),
        env=_env(transport),
        init=False,
        timeout=120,
    )
    for r in outcome.results:
        assert len(r) == generations, r
        for generation, g in enumerate(r):
            assert g["values"] == [6.0, 6.0, 6.0, 2.0 + 2 * generation], r
            assert g["transport"] == transport and not g["poisoned"], r


def reinit_after_a_destroy_we_did_not_see(rank: int, world: int, ports: list[int]) -> dict:

    import compiler_collectives as cc
    from compiler_collectives import health, runtime

    cc.enable(guards=True)
    # Torch's own destroy, as code that held it from before our import calls it: our seam never runs.
    torch_destroy = dist.destroy_process_group.__wrapped__
    ones = torch.ones(2)

    init_gloo(rank, world, f"tcp://127.0.0.1:{ports[0]}")
    f = torch.compile(_step, backend="eager")
    g = torch.compile(_other, backend="eager")
    f(ones)
    g(ones)
    failed = None
    for fn in [f, f, g] if rank == 0 else [f, g]:  # rank 0 calls f one extra time: a desync
        failed = caught(lambda fn=fn: fn(ones))["type"]
        if failed:
            break
    before = runtime.current().generation.number
    torch_destroy()
    unseen = runtime.current().generation.number == before and health.latch.first_failure is not None
    init_gloo(rank, world, f"tcp://127.0.0.1:{ports[1]}")
    values = [float(f(ones).sum()) for _ in range(3)] + [float(g(ones).sum())]
    out = {
        "failed": failed,
        "unseen": unseen,
        "values": values,
        "poisoned": health.latch.first_failure is not None,
        "generations": runtime.current().generation.number - before,
    }
    dist.destroy_process_group()
    return out


def test_a_new_default_group_after_a_destroy_we_did_not_see_starts_a_clean_generation():
    """The first call under the new group notices it (``transport.groups.notice``) and ends the old
    generation as its destroy would have: its failure and its groups go with it."""
    outcome = run_ranks(
        reinit_after_a_destroy_we_did_not_see, 2, args=([free_port(), free_port()],), env=ENV, init=False, timeout=90
    )
    for r in outcome.results:
        assert r["failed"] == "CollectiveDesyncError" and r["unseen"], r
        assert r["values"] == [6.0, 6.0, 6.0, -4.0] and not r["poisoned"], r
        assert r["generations"] == 1, r  # noticed once, by the first call


# ---------------------------------------------------------------- fork


def _in_forked_child(fn, deadline_s: float = 30.0) -> dict:
    """Run ``fn`` in an os.fork() child (as a DataLoader worker with the fork start method
    runs user code); its result, or "hung" after ``deadline_s`` (then it is killed)."""
    import json
    import select

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's exit handlers
        os.close(read_end)
        try:
            out = ["ok", fn()]
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = ["err", f"{type(e).__name__}: {e}"]
        os.write(write_end, json.dumps(out).encode())
        os._exit(0)
    os.close(write_end)
    ready, _, _ = select.select([read_end], [], [], deadline_s)
    data = os.read(read_end, 1 << 20) if ready else b""
    os.close(read_end)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    status_, value = json.loads(data) if data else ["hung", None]
    return {"status": status_, "value": value, "exit": os.waitstatus_to_exitcode(status)}


def forked_child_runs_compiled_code(rank: int, world: int) -> dict:
    import compiler_collectives as cc
    from compiler_collectives import health

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    for _ in range(3):
        f(torch.ones(2))
    dist.barrier()
    child = None
    at_fork = cc.stats()["guard_collectives"]
    if rank == 0:

        def in_child() -> dict:
            start = time.monotonic()
            values = [float(f(torch.ones(2)).sum()) for _ in range(5)]  # guard hook, parent's frame
            values.append(float(torch.compile(_other, backend="eager")(torch.ones(2)).sum()))  # a compile
            return {
                "values": values,
                "seconds": time.monotonic() - start,
                "guard_collectives": cc.stats()["guard_collectives"],
            }

        child = _in_forked_child(in_child)
    dist.barrier()
    # The ranks go on together: nothing of the child's reached either of them.
    after = [caught(lambda: f(torch.ones(2)))["type"] for _ in range(5)]
    first = health.latch.first_failure
    return {
        "child": child,
        "at_fork": at_fork,
        "after": after,
        "poisoned": None if first is None else str(first),
        "guard_collectives": cc.stats()["guard_collectives"],
        "transport": cc.stats()["guard_transport"],
    }


@GUARD_TRANSPORTS
def test_a_forked_child_running_compiled_code_decides_alone_and_never_touches_its_parents_state(transport):
    outcome = run_ranks(forked_child_runs_compiled_code, 2, env=_env(transport), timeout=90)
    child = outcome.results[0]["child"]
    assert child["status"] == "ok" and child["exit"] == 0, child
    assert child["value"]["values"] == [6.0] * 5 + [-4.0], child
    assert child["value"]["guard_collectives"] == outcome.results[0]["at_fork"], child  # the child is not a rank
    assert child["value"]["seconds"] < 20.0, child
    for r in outcome.results:
        assert r["transport"] == transport, r
        assert r["after"] == [None] * 5 and r["poisoned"] is None, r
    assert outcome.results[0]["guard_collectives"] == outcome.results[1]["guard_collectives"], outcome.results


def gloo_wait_in_a_forked_child(rank: int, world: int) -> dict:
    import compiler_collectives  # noqa: F401 - the settings
    from compiler_collectives.transport import gloo

    pg = dist.new_group(backend="gloo")
    dist.barrier()
    child = None
    if rank == 0:

        def in_child() -> dict:
            start = time.monotonic()
            try:
                gloo.wait(pg.allreduce([torch.ones(1)]))  # no gloo thread runs this in a child
                raised = None
            except Exception as e:  # noqa: BLE001 - reported to the parent
                raised = type(e).__name__
            return {"raised": raised, "seconds": time.monotonic() - start}

        child = _in_forked_child(in_child, deadline_s=40.0)
    dist.barrier()
    return {"child": child}


def test_a_wait_on_gloo_ends_at_our_timeout_even_in_a_forked_child_that_has_no_gloo_threads():
    env = rank_env(timeout_s=3, pg_timeout_s=PG_TIMEOUT_S)
    outcome = run_ranks(gloo_wait_in_a_forked_child, 2, env=env, timeout=90)
    child = outcome.results[0]["child"]
    assert child["status"] == "ok", child
    assert child["value"]["raised"] == "CollectiveTimeoutError", child
    assert child["value"]["seconds"] < 3 + 10, child


# ---------------------------------------------------------------- threads


def two_threads_run_compiled_code(rank: int, world: int, calls: int) -> dict:
    import compiler_collectives as cc
    from compiler_collectives import health

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))  # compiles
    f(torch.ones(2))  # the first guard collective: the main thread runs compiled code from here on
    other: dict = {}

    def second_thread() -> None:
        for _ in range(calls):
            result = caught(lambda: f(torch.ones(2)))
            if result["type"]:
                other.update(result)
                return
        other["type"] = None

    thread = threading.Thread(target=second_thread, name="loader-thread")
    thread.start()
    main = [caught(lambda: f(torch.ones(2))) for _ in range(calls)]
    thread.join(60)
    first = health.latch.first_failure
    return {
        "other": other,
        "main": [m["type"] for m in main],
        "poisoned": None if first is None else str(first),
        "guard_collectives": cc.stats()["guard_collectives"],
        "transport": cc.stats()["guard_transport"],
    }


@GUARD_TRANSPORTS
@pytest.mark.release_independent
def test_a_second_thread_running_compiled_code_with_guards_gets_a_clear_error_naming_both_threads(transport):
    calls = 40
    outcome = run_ranks(two_threads_run_compiled_code, 2, args=(calls,), env=_env(transport), timeout=90)
    for r in outcome.results:
        assert r["transport"] == transport, r
        other = r["other"]
        assert other["type"] == "ConcurrentThreadsError", other
        assert "'loader-thread'" in other["message"] and "'MainThread'" in other["message"], other["message"]
        assert "Only one thread may run compiled code with guard collectives on" in other["message"]
        # The main thread's collectives go on, in step with the other rank's.
        assert r["main"] == [None] * calls and r["poisoned"] is None, r
        assert r["guard_collectives"] == calls + 1, r


# ---------------------------------------------------------------- signal handlers


class Preempted(Exception):
    pass


def _on_sigterm(signum, frame):
    raise Preempted("SIGTERM: this node is being preempted")


def preempted_inside_the_guard_collective(rank: int, world: int) -> dict:
    import compiler_collectives as cc
    from compiler_collectives import health

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    if rank == 1:
        signal.signal(signal.SIGTERM, _on_sigterm)
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        try:
            f(torch.ones(2))  # rank 0 enters only after we left: the handler raises inside the guard hook
            out = {"raised": None}
        except Preempted:
            out = {"raised": "Preempted"}
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out = {"raised": type(e).__name__, "message": str(e)}
        out["seconds"] = time.monotonic() - start
        out["afterwards"] = caught(lambda: f(torch.ones(2)))["type"]  # this rank left a collective half-done
        release("left")
        stay_until(1, 30)  # alive while rank 0 hears of it
        return out
    stay_until(1, 30, "left")
    # Rank 1's part of this call was in before it left: the call may still agree, the next cannot.
    first = caught(lambda: f(torch.ones(2)))
    give_up = time.monotonic() + 10.0
    while health.latch.first_failure is None and time.monotonic() < give_up:
        time.sleep(0.05)
    second = caught(lambda: f(torch.ones(2))) if first["type"] is None else first
    release()
    return {"second": second, "transport": cc.stats()["guard_transport"]}


@GUARD_TRANSPORTS
@NAMED_WITHIN_SECONDS
@pytest.mark.release_independent
def test_an_exception_from_a_users_signal_handler_stays_itself_and_peers_hear_that_the_rank_left(transport):
    """No timeout is waited for (ours is TIMEOUT_S): rank 0 enters once rank 1 left, and hears
    of it through the failure word (shm) or a heartbeat (gloo)."""
    outcome = run_ranks(preempted_inside_the_guard_collective, 2, env=_env(transport), timeout=90)
    left, peer = outcome.results[1], outcome.results[0]
    assert left["raised"] == "Preempted", left
    assert left["seconds"] < 2.0, left  # no failure procedure, no diagnosis
    assert left["afterwards"] == "CollectivePoisonedError", left
    assert peer["transport"] == transport, peer
    second = peer["second"]
    assert second["type"] == "PeerFailureError", second
    assert second["ranks"] == [1], second
    assert "rank 1 left the job" in second["message"], second["message"]
    assert "Preempted" in second["message"] and "signal handler" in second["message"], second["message"]
    assert "reported a collective failure" not in second["message"], second["message"]


# ---------------------------------------------------------------- one rank


def one_rank_job(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    values = [float(f(torch.ones(2)).sum()) for _ in range(10)]
    values.append(float(f(torch.ones(3)).sum()))  # a local miss still recompiles
    s = cc.stats()
    return {"values": values, "guard_collectives": s["guard_collectives"], "transport": s["guard_transport"]}


def test_with_one_rank_the_guard_collective_does_not_run():
    outcome = run_ranks(one_rank_job, 1, env=ENV, timeout=60)
    r = outcome.results[0]
    assert r["values"] == [6.0] * 10 + [9.0], r
    assert r["guard_collectives"] == 0 and r["transport"] is None, r
