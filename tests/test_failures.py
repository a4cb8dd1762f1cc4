"""Fail loudly, never hang: every failure ends in a named, catchable error (issue: failures).

Any rank the harness has to kill, and any -6 exit, fails these tests: they run
with ``check=True`` unless a test inspects an expected crash itself.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks

TIMEOUT_S = 6.0
ENV = {"COMPILER_COLLECTIVES_TIMEOUT": str(TIMEOUT_S), "HARNESS_PG_TIMEOUT": "1800"}


# Every guard-path failure runs on both mechanisms; each rank reports which one it used.
GUARD_TRANSPORTS = pytest.mark.parametrize("transport", ["shm", "gloo"])


def _env(transport: str) -> dict[str, str]:
    return {**ENV, "COMPILER_COLLECTIVES_GUARD_TRANSPORT": "auto" if transport == "shm" else "gloo"}


def _with_transport(result: dict) -> dict:
    from compiler_collectives.transport import groups

    return {**result, "transport": groups.guard_transport()}


def _step(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def _other(x: torch.Tensor) -> torch.Tensor:
    return x - 3


def _caught(call) -> dict:
    """Run ``call`` and describe what it raised, with how long it took."""
    import compiler_collectives as cc

    start = time.monotonic()
    try:
        call()
    except cc.CollectiveError as e:
        return {"type": type(e).__name__, "ranks": list(e.ranks), "message": str(e),
                "seconds": time.monotonic() - start}
    return {"type": None, "seconds": time.monotonic() - start}


# ---------------------------------------------------------------- dead and absent peers


def peer_killed_inside_guard_collective(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))  # compile; our groups exist from here on
    f(torch.ones(2))  # one guard collective with everyone present
    if rank == 1:
        # Die while blocked inside the next guard collective.
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        f(torch.ones(2))
        return {"type": "survived?"}
    time.sleep(1.5)  # rank 1 is dead by the time we enter
    # On shared memory rank 1 published its word for this call before it died,
    # so this call may still agree; the next one must fail.
    start = time.monotonic()
    for call in range(2):
        result = _caught(lambda: f(torch.ones(2)))
        if result["type"]:
            return _with_transport({**result, "call": call, "seconds": time.monotonic() - start})
    return _with_transport(result)


@GUARD_TRANSPORTS
def test_a_peer_killed_inside_the_guard_collective_is_named_by_every_survivor(transport):
    outcome = run_ranks(peer_killed_inside_guard_collective, 4, env=_env(transport), timeout=60, check=False,
                       expect_signals={1: signal.SIGKILL})
    assert outcome.exitcodes[1] == -signal.SIGKILL
    assert not outcome.timed_out and not outcome.errors, outcome
    for rank in (0, 2, 3):
        r = outcome.results[rank]
        assert r["transport"] == transport, r
        assert r["ranks"] == [1], r
        assert "rank 1: absent" in r["message"]
        assert r["call"] == (0 if transport == "gloo" else 1) or r["call"] == 0, r
        if transport == "shm":
            # Noticed through /proc, not the timeout: seconds, not COMPILER_COLLECTIVES_TIMEOUT.
            assert r["type"] == "PeerFailureError", r
            assert r["seconds"] < 5.0, r
        else:
            assert r["type"] in ("PeerFailureError", "CollectiveTimeoutError"), r
            assert r["seconds"] < TIMEOUT_S + 5


def peer_stopped(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # absent but alive, until rank 0 sends SIGCONT
        time.sleep(0.2)
        return {"after_cont": _caught(lambda: f(torch.ones(2)))}
    result = _with_transport(_caught(lambda: f(torch.ones(2))))
    if rank == 0:
        os.kill(pids[1], signal.SIGCONT)
    return result


@GUARD_TRANSPORTS
def test_a_stopped_peer_is_named_after_the_timeout_and_raises_at_once_when_resumed(transport):
    outcome = run_ranks(peer_stopped, 3, env=_env(transport), timeout=60)
    for rank in (0, 2):
        r = outcome.results[rank]
        assert r["transport"] == transport, r
        if transport == "shm":
            # Rank 0 and rank 2 both time out; whichever reports first, the other may
            # learn of it through the segment's failure word, still naming rank 1 below.
            assert r["type"] in ("CollectiveTimeoutError", "PeerFailureError"), r
            assert r["seconds"] >= TIMEOUT_S - 0.5, r  # a stopped process is not dead: wait it out
        else:
            assert r["type"] == "CollectiveTimeoutError" or r["type"] == "PeerFailureError", r
        assert r["ranks"] == [1], r
        assert "rank 1: absent" in r["message"]
        assert r["seconds"] < TIMEOUT_S + 2 + 1.5  # timeout + 2 s, plus the sleep-free slack of a 2-core box
    resumed = outcome.results[1]["after_cont"]
    assert resumed["type"] is not None, resumed
    assert resumed["seconds"] < 2.0


def absent_before_groups_exist(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    if rank == 1:
        time.sleep(TIMEOUT_S + 6)  # never compiles in time
        return {"type": "absent"}
    f = torch.compile(_step, backend="eager")
    return _caught(lambda: f(torch.ones(2)))


def test_our_timeout_bounds_group_creation_even_with_a_30_minute_default_group():
    # HARNESS_PG_TIMEOUT=1800: init_process_group(timeout=30 min), as in many jobs
    outcome = run_ranks(absent_before_groups_exist, 2, env=ENV, timeout=60)
    r = outcome.results[0]
    assert r["type"] == "CollectiveTimeoutError", r
    assert r["ranks"] == [1]
    assert r["seconds"] < TIMEOUT_S + 3


def absent_after_groups_exist(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    if rank == 1:
        time.sleep(TIMEOUT_S + 6)
        return {"type": "late"}
    return _with_transport(_caught(lambda: f(torch.ones(2))))


@GUARD_TRANSPORTS
def test_our_timeout_bounds_a_collective_after_the_groups_exist(transport):
    outcome = run_ranks(absent_after_groups_exist, 2, env=_env(transport), timeout=60)
    r = outcome.results[0]
    assert r["transport"] == transport, r
    # rank 1 is alive (heartbeat fresh) but elsewhere: that is a desync
    assert r["type"] in ("CollectiveTimeoutError", "CollectiveDesyncError"), r
    assert r["ranks"] == [1]
    assert r["seconds"] < TIMEOUT_S + 5


# ---------------------------------------------------------------- desync


def different_frames(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    f = torch.compile(_step if rank == 0 else _other, backend="eager")
    return _caught(lambda: f(torch.ones(2)))


def test_ranks_compiling_different_frames_all_raise_a_desync_listing_every_rank():
    outcome = run_ranks(different_frames, 2, env=ENV, timeout=60)
    for r in outcome.results:
        assert r["type"] == "CollectiveDesyncError", r
        assert "rank 0: compiler collective #1 for frame _step at" in r["message"]
        assert "rank 1: compiler collective #1 for frame _other at" in r["message"]


def extra_call(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    g = torch.compile(_other, backend="eager")
    f(torch.ones(2))  # both compile on every rank
    g(torch.ones(2))
    for fn in ([f, f, g] if rank == 0 else [f, g]):  # rank 0 calls f one extra time
        result = _caught(lambda: fn(torch.ones(2)))
        if result["type"]:
            return _with_transport(result)
    return {"type": None}


@GUARD_TRANSPORTS
def test_a_rank_that_calls_a_compiled_function_one_extra_time_is_caught_as_a_desync(transport):
    outcome = run_ranks(extra_call, 2, env=_env(transport), timeout=60)
    # Rank 0's extra call of f meets rank 1's call of g (same line, same
    # count): both ranks see the compiled frames differ, neither call runs.
    for r in outcome.results:
        assert r["type"] == "CollectiveDesyncError", r
        assert r["transport"] == transport, r
        assert "different compiled frames at the same guard-collective count" in r["message"]
        assert r["ranks"] == [1 - outcome.results.index(r)]  # the other rank is named


def fewer_calls_then_wait(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    for _ in range(3 if rank == 0 else 2):  # same line: the call site cannot tell
        result = _caught(lambda: f(torch.ones(2)))
        if result["type"]:
            return _with_transport(result)
    if rank == 1:
        time.sleep(TIMEOUT_S + 6)  # alive, heartbeating, elsewhere
    return {"type": None}


@GUARD_TRANSPORTS
def test_an_extra_call_from_the_same_line_is_named_as_a_desync_when_the_peer_is_alive_elsewhere(transport):
    outcome = run_ranks(fewer_calls_then_wait, 2, env=_env(transport), timeout=60)
    r = outcome.results[0]
    assert r["transport"] == transport, r
    assert r["type"] == "CollectiveDesyncError", r
    assert r["ranks"] == [1]
    assert "rank 1: alive but not in this collective (last guard collective #1," in r["message"]


# ---------------------------------------------------------------- bad payloads


def _corrupting(rank: int, how: str) -> None:
    """Make this rank's next compiler-collective payload bad in the given way."""
    from compiler_collectives import config, wire

    original = wire.encode

    def bad(*args, **kwargs):
        data = original(*args, **kwargs)
        if how == "corrupt":
            return bytes(b ^ 0x5A for b in data)
        if how == "truncated":
            return data[: len(data) // 2]
        if how == "oversized":
            return data + b"\x00" * (config.settings.max_payload_bytes + 1)
        if how == "old_version":
            import msgpack

            envelope = msgpack.unpackb(data)
            envelope[0] = 0
            return msgpack.packb(envelope)
        if how == "pickle":
            import pickle

            class Exploit:
                def __reduce__(self):
                    return (os.system, (f"touch {os.environ['EXPLOIT_MARKER']}",))

            return pickle.dumps(Exploit())
        raise AssertionError(how)

    wire.encode = bad


def bad_payload_from_rank_1(rank: int, world: int, how: str) -> dict:
    import compiler_collectives as cc

    cc.enable()
    if rank == 1:
        _corrupting(rank, how)
    f = torch.compile(_step, backend="eager")
    return _caught(lambda: f(torch.ones(2)))


@pytest.mark.parametrize("how", ["corrupt", "truncated", "oversized", "old_version"])
def test_a_bad_payload_from_one_rank_makes_every_rank_raise_the_same_payload_error(how):
    env = dict(ENV, COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES="65536")
    outcome = run_ranks(bad_payload_from_rank_1, 3, args=(how,), env=env, timeout=60)
    messages = set()
    for r in outcome.results:
        assert r["type"] == "WireFormatError", r
        assert r["ranks"] == [1]
        assert "rank 1" in r["message"]
        messages.add(r["message"].split(": ", 1)[1])  # drop the per-rank prefix
    assert len(messages) == 1, messages


def test_a_payload_crafted_to_run_code_when_unpickled_runs_nothing(tmp_path):
    marker = tmp_path / "exploited"
    env = dict(ENV, EXPLOIT_MARKER=str(marker))
    outcome = run_ranks(bad_payload_from_rank_1, 2, args=("pickle",), env=env, timeout=60)
    for r in outcome.results:
        assert r["type"] == "WireFormatError", r
    assert not marker.exists()


# ---------------------------------------------------------------- poisoning and the hook


def poisoned_then_reset(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    if rank == 1:
        _corrupting(rank, "corrupt")
    f = torch.compile(_step, backend="eager")
    first = _caught(lambda: f(torch.ones(2)))
    g = torch.compile(_other, backend="eager")
    second = _caught(lambda: g(torch.ones(2)))
    # explicit recovery on every rank
    from compiler_collectives import wire

    if rank == 1:
        import importlib

        importlib.reload(wire)
    cc.reset()
    h = torch.compile(lambda x: x + 7, backend="eager")
    third = _caught(lambda: h(torch.ones(2)))
    return {"first": first["type"], "second": second["type"], "second_msg": second.get("message", ""),
            "third": third["type"]}


def test_after_a_failure_collectives_refuse_until_reset_on_every_rank():
    outcome = run_ranks(poisoned_then_reset, 2, env=ENV, timeout=60)
    for r in outcome.results:
        assert r["first"] == "WireFormatError"
        assert r["second"] == "CollectivePoisonedError"
        assert "earlier collective failed" in r["second_msg"]
        assert r["third"] is None


def guard_failure_reaches_user(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))  # one guard collective: the guard channel exists on every rank
    if rank == 1:
        os._exit(0)  # leave without a word: rank 0's guard collective fails
    time.sleep(1.0)
    return _with_transport(_caught(lambda: f(torch.ones(2))))


@GUARD_TRANSPORTS
def test_a_guard_collective_failure_is_a_catchable_error_at_the_call_site_never_an_abort(transport):
    outcome = run_ranks(guard_failure_reaches_user, 2, env=_env(transport), timeout=60, check=False)
    assert outcome.exitcodes[0] == 0, outcome  # not -6 (SIGABRT from C++)
    r = outcome.results[0]
    assert r["transport"] == transport, r
    assert r["type"] in ("PeerFailureError", "CollectiveTimeoutError"), r
    assert r["ranks"] == [1]


def random_agreement(rank: int, world: int, iterations: int) -> dict:
    import random

    import compiler_collectives as cc
    from compiler_collectives.stats import counters

    torch._dynamo.config.recompile_limit = 6
    cc.enable(guards=True)
    rng = random.Random(1000 + rank)
    f = torch.compile(lambda x: (x * 2).sum(), backend="eager")
    decisions = []
    for _ in range(iterations):
        dtype = rng.choice([torch.float32, torch.float32, torch.float32, torch.float64])
        shape = [rng.choice([2, 3, 5])] * rng.choice([1, 1, 1, 2])
        before = (counters.compiler_collectives, counters.guard_agreed_misses)
        f(torch.ones(shape, dtype=dtype))
        decisions.append((counters.compiler_collectives - before[0], counters.guard_agreed_misses - before[1]))
    return _with_transport({"decisions": decisions, "compiles": counters.compiler_collectives})


@GUARD_TRANSPORTS
def test_agreement_property_random_hits_and_sizes_give_identical_decisions_on_every_rank(transport):
    outcome = run_ranks(random_agreement, 4, args=(300,), env=_env(transport), timeout=240)
    first = outcome.results[0]
    assert first["transport"] == transport
    for r in outcome.results[1:]:
        assert r["decisions"] == first["decisions"]
        assert r["compiles"] == first["compiles"]
    assert first["compiles"] >= 2  # the random inputs did force recompiles
