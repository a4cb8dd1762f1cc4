"""Fail loudly, never hang: every failure ends in a named, catchable error (issue: failures).

Any rank the harness has to kill, and any -6 exit, fails these tests: they run
with ``check=True`` unless a test inspects an expected crash itself.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist

from tests.fixtures import GUARD_TRANSPORTS, NAMED_WITHIN_SECONDS, guard_env
from tests.harness import release, run_ranks, stay_until
from tests.rank_env import rank_env
from tests.rankside import caught

# Every test here starts rank processes or subprocesses: the multi-process tier.
pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

TIMEOUT_S = 6.0
PG_TIMEOUT_S = 1800
ENV = rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S)
# Where a test measures how fast a failure is noticed: far from any timeout.
LONG_TIMEOUT_S = 60.0
LONG_ENV = rank_env(timeout_s=LONG_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S)


def _stay_until_every_survivor_has_its_error(survivors: int) -> None:
    """Survivors stay alive until each of them holds its error, so that no rank learns of a
    failure from a peer's closed connection: only from our own propagation."""
    release("has-its-error")
    stay_until(survivors, 60, "has-its-error")


def _until_gone(pid: int) -> None:
    """Return once process ``pid`` (a rank killed by a timer) is dead: a zombie or reaped."""
    from compiler_collectives.transport.segment import process_identity

    give_up = time.monotonic() + 30.0
    while time.monotonic() < give_up:
        ident = process_identity(pid)
        if ident is None or ident[0] in ("Z", "X"):
            return
        time.sleep(0.01)
    raise AssertionError(f"rank process {pid} still runs 30 s after its kill")


# Every guard-path failure runs on both mechanisms (GUARD_TRANSPORTS); each rank reports which one it used.


def _env(transport: str, base: dict[str, str] = ENV) -> dict[str, str]:
    return guard_env(transport, base)


def _with_transport(result: dict) -> dict:
    from compiler_collectives.transport import groups

    return {**result, "transport": groups.guard_transport()}


def _step(x: torch.Tensor) -> torch.Tensor:
    return x * 3


def _other(x: torch.Tensor) -> torch.Tensor:
    return x - 3


# ---------------------------------------------------------------- dead and absent peers


def peer_killed_inside_guard_collective(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))  # compile; our groups exist from here on
    f(torch.ones(2))  # one guard collective with everyone present
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        # Die while blocked inside the next guard collective: its word for that call is
        # stored (its first act in the call) 0.5 s before the kill.
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        f(torch.ones(2))
        return {"type": "survived?"}
    _until_gone(pids[1])  # rank 1 is dead by the time we enter
    start = time.monotonic()
    for call in range(2):  # noqa: B007 - read after the loop: which call failed
        result = caught(lambda: f(torch.ones(2)))
        if result["type"]:
            break
    result = _with_transport({**result, "call": call, "seconds": time.monotonic() - start})
    _stay_until_every_survivor_has_its_error(world - 1)
    return result


@GUARD_TRANSPORTS
@NAMED_WITHIN_SECONDS
def test_a_peer_killed_inside_the_guard_collective_is_named_by_every_survivor_within_5_seconds(transport):
    """No timeout is waited for (ours is 60 s): the survivors enter once rank 1 is dead."""
    outcome = run_ranks(
        peer_killed_inside_guard_collective,
        4,
        env=_env(transport, LONG_ENV),
        timeout=90,
        check=False,
        expect_signals={1: signal.SIGKILL},
    )
    assert not outcome.timed_out and not outcome.errors, outcome
    for rank in (0, 2, 3):
        r = outcome.results[rank]
        assert r["transport"] == transport, r
        assert r["type"] == "PeerFailureError", r
        assert r["ranks"] == [1], r
        assert "rank 1: absent, its process" in r["message"], r["message"]
        # Shared memory: every word of the call rank 1 died in is in (its own came before
        # its kill), so that call agrees and the next one fails. Gloo: rank 1 never completed
        # its part of that all-reduce, so that call fails.
        assert r["call"] == (1 if transport == "shm" else 0), r
        # Noticed by our own means (a closed connection, /proc, a peer's report), not the timeout.
        assert r["seconds"] < 5.0, r


def peer_killed_before_a_compile(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    torch.compile(_step, backend="eager")(torch.ones(2))  # our compile group exists
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.0)
    result = caught(lambda: torch.compile(_other, backend="eager")(torch.ones(2)))
    _stay_until_every_survivor_has_its_error(world - 1)
    return result


@NAMED_WITHIN_SECONDS
def test_a_peer_killed_before_a_compile_is_named_by_every_survivor_within_5_seconds():
    """No timeout is waited for (ours is 60 s): rank 1 dies 1 s before the others compile."""
    # The compiler collective runs on gloo: the survivors that do not exchange
    # with rank 1 directly hear of it from the others' reports, in seconds.
    outcome = run_ranks(
        peer_killed_before_a_compile, 4, env=LONG_ENV, timeout=90, check=False, expect_signals={1: signal.SIGKILL}
    )
    assert not outcome.timed_out and not outcome.errors, outcome
    for rank in (0, 2, 3):
        r = outcome.results[rank]
        assert r["type"] == "PeerFailureError", r
        assert r["ranks"] == [1], r
        assert r["seconds"] < 5.0, r


def hears_of_a_failure_before_its_compile(rank: int, world: int) -> dict:
    import compiler_collectives as cc
    from compiler_collectives import health

    cc.enable()
    torch.compile(_step, backend="eager")(torch.ones(2))  # our compile group exists
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 2:
        # Learn of the failure from the side channel first (rank 0's report), then compile:
        # the order a survivor on a busy machine can meet things in.
        give_up = time.monotonic() + 30.0
        while health.latch.first_failure is None and time.monotonic() < give_up:
            time.sleep(0.02)
    else:
        time.sleep(0.5)
    result = caught(lambda: torch.compile(_other, backend="eager")(torch.ones(2)))
    _stay_until_every_survivor_has_its_error(world - 1)
    return result


@NAMED_WITHIN_SECONDS
def test_a_survivor_that_hears_of_a_failure_before_its_collective_still_names_the_failed_rank_and_cause():
    """No timeout is waited for (ours is 60 s): rank 2 waits for a heartbeat to bring rank 0's report."""
    outcome = run_ranks(
        hears_of_a_failure_before_its_compile,
        3,
        env=LONG_ENV,
        timeout=90,
        check=False,
        expect_signals={1: signal.SIGKILL},
    )
    assert not outcome.timed_out and not outcome.errors, outcome
    r = outcome.results[2]
    assert r["type"] == "PeerFailureError", r
    assert r["ranks"] == [1], r
    assert "rank 1: absent, its process" in r["message"], r["message"]
    assert "an earlier collective failed on this rank" not in r["message"], r["message"]
    assert r["seconds"] < 5.0, r


def peer_fails_while_others_wait(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    if rank == 1:
        stay_until(2, 12)  # alive and heartbeating, elsewhere, until the others have raised
        return {"type": "elsewhere"}
    if rank == 2:
        time.sleep(0.5)  # rank 0 is waiting by now; rank 2 times out after 3 s
    result = caught(lambda: f(torch.ones(2)))
    result["at"] = time.time()
    release()
    return _with_transport(result)


@GUARD_TRANSPORTS
def test_a_rank_waiting_in_our_collective_stops_within_seconds_when_a_peer_reports_a_failure(transport):
    outcome = run_ranks(
        peer_fails_while_others_wait,
        3,
        env=_env(transport, LONG_ENV),
        timeout=90,
        rank_env={2: rank_env(timeout_s=3)},
    )
    waiting, failing = outcome.results[0], outcome.results[2]
    assert failing["type"] == "CollectiveDesyncError" and failing["ranks"] == [1], failing  # rank 1 is elsewhere
    assert waiting["transport"] == transport, waiting
    # Rank 0 would wait 60 s; it stops once rank 2 has published its failure, and says so in
    # rank 2's words: it learned of the failure from a report, so it never re-types it itself.
    assert waiting["type"] == "PeerFailureError", waiting
    assert "rank 2 reported a collective failure" in waiting["message"], waiting["message"]
    assert "timed out" in waiting["message"], waiting["message"]  # rank 2's cause
    # Rank 2's report names the rank it waited for on shared memory; gloo's timeout names
    # nobody until rank 2's diagnosis updates the report.
    assert waiting["ranks"] == [1] or (transport == "gloo" and waiting["ranks"] in ([1], [2])), waiting
    assert waiting["at"] - failing["at"] < 3.0, (waiting, failing)
    assert waiting["seconds"] < 15.0, waiting


def _compiled_with_every_pid(world: int) -> tuple:
    """A compiled function past its first guard collective, and every rank's pid."""
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    return f, pids


def _just_after_a_heartbeat() -> None:
    """Return right after this rank's heartbeat thread beat: a rank stopped or wedged inside a
    store call would hold the FileStore's lock, and every other rank's store calls would wait."""
    from compiler_collectives.transport import groups

    beats = groups.side.beats
    give_up = time.monotonic() + 10.0
    while groups.side.beats == beats and time.monotonic() < give_up:
        time.sleep(0.01)
    time.sleep(0.1)


def peer_stopped(rank: int, world: int) -> dict:
    f, pids = _compiled_with_every_pid(world)
    if rank == 1:
        _just_after_a_heartbeat()
        os.kill(os.getpid(), signal.SIGSTOP)  # absent but alive, until rank 0 sends SIGCONT
        from compiler_collectives import health

        give_up = time.monotonic() + 15.0  # resumed: its heartbeat thread reads the failure reports
        while health.latch.first_failure is None and time.monotonic() < give_up:
            time.sleep(0.05)
        return {"after_cont": caught(lambda: f(torch.ones(2)))}
    if rank == 2:
        # Enters 3 s later: rank 0's timeout comes first, and rank 2 hears of it (on gloo
        # through its heartbeat thread, up to a heartbeat and a wait slice later).
        time.sleep(3.0)
    result = _with_transport(caught(lambda: f(torch.ones(2))))
    result["at"] = time.time()
    # Rank 1 stays stopped until rank 2 has its error too: resumed early, it would
    # no longer be "stopped" when rank 2's diagnosis looks at it.
    done = os.path.join(tempfile.gettempdir(), f"cc-peer-stopped-{pids[0]}")
    if rank == 2:
        open(done, "w").close()
    if rank == 0:
        give_up = time.monotonic() + 30.0
        while not os.path.exists(done) and time.monotonic() < give_up:
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGCONT)
        if os.path.exists(done):
            os.unlink(done)
    return result


@GUARD_TRANSPORTS
def test_a_stopped_peer_is_named_after_the_timeout_and_the_others_hear_of_it_at_once(transport):
    outcome = run_ranks(peer_stopped, 3, env=_env(transport), timeout=60)
    first, second = outcome.results[0], outcome.results[2]
    for r in (first, second):
        assert r["transport"] == transport, r
        assert r["ranks"] == [1], r
        assert "rank 1: absent, its process" in r["message"] and "is stopped" in r["message"], r["message"]
    # Rank 0 waits out its timeout: a stopped process is not dead.
    assert first["type"] == "CollectiveTimeoutError", first
    assert TIMEOUT_S - 0.5 <= first["seconds"] < TIMEOUT_S + 4.0, first
    # Rank 2 entered 3 s later and hears of rank 0's failure long before its own timeout.
    assert second["type"] == "PeerFailureError", second
    assert second["at"] - first["at"] < 3.0, (first, second)
    assert second["seconds"] < TIMEOUT_S - 0.5, second
    # Once resumed, rank 1 refuses at once instead of waiting for a partner.
    resumed = outcome.results[1]["after_cont"]
    assert resumed["type"] == "CollectivePoisonedError", resumed
    assert resumed["seconds"] < 1.0


def peer_wedged_holding_the_gil(rank: int, world: int) -> dict:
    import ctypes

    unwedge = os.path.join(os.environ["HARNESS_JOB_DIR"], "unwedge")
    if rank == 1:
        os.mkfifo(unwedge)  # before the groups exist: there when rank 0 writes to it
    f, pids = _compiled_with_every_pid(world)
    if rank == 1:
        _just_after_a_heartbeat()
        # A native call that keeps the GIL (PyDLL does not release it): alive and running, but
        # no Python thread of this process, its heartbeat thread included, runs until it returns,
        # once rank 0 holds its error and writes a byte.
        fd = os.open(unwedge, os.O_RDWR)
        ctypes.PyDLL(None).read(fd, ctypes.create_string_buffer(1), 1)
        os.close(fd)
        return {"type": "wedged"}
    result = _with_transport({**caught(lambda: f(torch.ones(2))), "wedged_pid": pids[1]})
    with open(unwedge, "wb") as w:
        w.write(b"x")
    return result


@GUARD_TRANSPORTS
def test_a_peer_wedged_in_a_native_call_holding_the_gil_is_named_as_wedged_with_its_pid(transport):
    """Rank 0 waits out our timeout (TIMEOUT_S); rank 1 stays wedged until rank 0 holds its error."""
    outcome = run_ranks(peer_wedged_holding_the_gil, 2, env=_env(transport), timeout=60)
    first = outcome.results[0]
    assert first["transport"] == transport, first
    assert first["type"] == "CollectiveTimeoutError", first
    assert first["ranks"] == [1], first
    wedged = f"yet its process (pid {first['wedged_pid']}, this host) runs: it is wedged"
    assert wedged in first["message"], first["message"]
    assert "py-spy dump" in first["message"], first["message"]


def absent_before_groups_exist(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    if rank == 1:
        stay_until(1, TIMEOUT_S + 10)  # never compiles: alive until rank 0 holds its error
        return {"type": "absent"}
    f = torch.compile(_step, backend="eager")
    result = caught(lambda: f(torch.ones(2)))
    release()
    return result


@pytest.mark.torch_seam
def test_our_timeout_bounds_group_creation_even_with_a_30_minute_default_group():
    """Rank 0 waits out our timeout (TIMEOUT_S) for rank 1, which stays away until rank 0 has its error."""
    # HARNESS_PG_TIMEOUT=1800: init_process_group(timeout=30 min), as in many jobs
    outcome = run_ranks(absent_before_groups_exist, 2, env=ENV, timeout=60)
    r = outcome.results[0]
    assert r["type"] == "CollectiveTimeoutError", r
    assert r["ranks"] == [1]
    assert r["seconds"] < TIMEOUT_S + 6  # the first compile, the timeout, a short diagnosis


def absent_after_groups_exist(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    if rank == 1:
        stay_until(1, TIMEOUT_S + 10)  # alive, and still there when rank 0's diagnosis ends
        return {"type": "late"}
    result = caught(lambda: f(torch.ones(2)))
    release()
    return _with_transport(result)


@GUARD_TRANSPORTS
def test_our_timeout_bounds_a_collective_after_the_groups_exist(transport):
    outcome = run_ranks(absent_after_groups_exist, 2, env=_env(transport), timeout=60)
    r = outcome.results[0]
    assert r["transport"] == transport, r
    # rank 1 is alive (its heartbeat moves) but elsewhere: that is a desync
    assert r["type"] == "CollectiveDesyncError", r
    assert r["ranks"] == [1]
    assert "rank 1: alive but not in this collective" in r["message"]
    assert TIMEOUT_S - 0.5 <= r["seconds"] < TIMEOUT_S + 6  # the timeout, then the diagnosis grace


# ---------------------------------------------------------------- desync


def different_frames(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable()
    f = torch.compile(_step if rank == 0 else _other, backend="eager")
    return caught(lambda: f(torch.ones(2)))


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
    for fn in [f, f, g] if rank == 0 else [f, g]:  # rank 0 calls f one extra time
        result = caught(lambda fn=fn: fn(torch.ones(2)))
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
        result = caught(lambda: f(torch.ones(2)))
        if result["type"]:
            release()
            return _with_transport(result)
    if rank == 1:
        stay_until(1, TIMEOUT_S + 10)  # alive, heartbeating, elsewhere, past rank 0's diagnosis
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
    from compiler_collectives import config
    from compiler_collectives.agreements import wire

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
    return caught(lambda: f(torch.ones(2)))


@pytest.mark.parametrize("how", ["corrupt", "truncated", "oversized", "old_version"])
def test_a_bad_payload_from_one_rank_makes_every_rank_raise_the_same_payload_error(how):
    env = rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S, max_payload_bytes=65536)
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
    env = rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S, extra={"EXPLOIT_MARKER": str(marker)})
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
    first = caught(lambda: f(torch.ones(2)))
    g = torch.compile(_other, backend="eager")
    second = caught(lambda: g(torch.ones(2)))
    # explicit recovery on every rank
    from compiler_collectives.agreements import wire

    if rank == 1:
        import importlib

        importlib.reload(wire)
    cc.reset()
    h = torch.compile(lambda x: x + 7, backend="eager")
    third = caught(lambda: h(torch.ones(2)))
    return {
        "first": first["type"],
        "second": second["type"],
        "second_msg": second.get("message", ""),
        "third": third["type"],
    }


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
    return _with_transport(caught(lambda: f(torch.ones(2))))


@GUARD_TRANSPORTS
@NAMED_WITHIN_SECONDS
@pytest.mark.torch_seam
def test_a_guard_collective_failure_is_a_catchable_error_at_the_call_site_never_an_abort(transport):
    outcome = run_ranks(guard_failure_reaches_user, 2, env=_env(transport, LONG_ENV), timeout=60, check=False)
    assert outcome.exitcodes[0] == 0, outcome  # not -6 (SIGABRT from C++)
    r = outcome.results[0]
    assert r["transport"] == transport, r
    assert r["type"] == "PeerFailureError", r
    assert r["ranks"] == [1]
    assert r["seconds"] < 5.0, r


def random_agreement(rank: int, world: int, iterations: int) -> dict:
    import random

    import compiler_collectives as cc

    torch._dynamo.config.recompile_limit = 6
    cc.enable(guards=True)
    rng = random.Random(1000 + rank)
    f = torch.compile(lambda x: (x * 2).sum(), backend="eager")
    decisions = []
    for _ in range(iterations):
        dtype = rng.choice([torch.float32, torch.float32, torch.float32, torch.float64])
        shape = [rng.choice([2, 3, 5])] * rng.choice([1, 1, 1, 2])
        before = cc.stats()
        f(torch.ones(shape, dtype=dtype))
        after = cc.stats()
        decisions.append(
            (
                after["compiler_collectives"] - before["compiler_collectives"],
                after["guard_agreed_misses"] - before["guard_agreed_misses"],
            )
        )
    return _with_transport({"decisions": decisions, "compiles": cc.stats()["compiler_collectives"]})


@pytest.mark.timeout(300)
@GUARD_TRANSPORTS
def test_agreement_property_random_hits_and_sizes_give_identical_decisions_on_every_rank(transport):
    outcome = run_ranks(random_agreement, 4, args=(300,), env=_env(transport), timeout=240)
    first = outcome.results[0]
    assert first["transport"] == transport
    for r in outcome.results[1:]:
        assert r["decisions"] == first["decisions"]
        assert r["compiles"] == first["compiles"]
    assert first["compiles"] >= 2  # the random inputs did force recompiles


# ---------------------------------------------------------------- the side channel itself


def store_host_stopped(rank: int, world: int) -> dict:
    import compiler_collectives as cc

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # rank 0 hosts the TCPStore: every store call now hangs
        return {"type": "resumed"}
    time.sleep(0.5)
    result = caught(lambda: f(torch.ones(2)))
    os.kill(pids[0], signal.SIGCONT)
    return result


def test_a_stopped_store_host_cannot_hold_a_failing_rank_past_our_timeout():
    # The store's own timeout is the default group's (HARNESS_PG_TIMEOUT=1800 s);
    # ours bounds every store call the failure procedure makes.
    outcome = run_ranks(store_host_stopped, 2, env=ENV, timeout=60, store="tcp")
    r = outcome.results[1]
    assert r["type"] == "CollectiveTimeoutError", r
    assert r["ranks"] == [0], r
    assert r["seconds"] < TIMEOUT_S + 12.0, r


def heartbeat_hits_an_error(rank: int, world: int) -> dict:
    import compiler_collectives as cc
    from compiler_collectives import health
    from compiler_collectives.transport import groups

    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    if rank == 1:
        calls = []

        def fails_once() -> dict:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("the store is briefly unreachable")
            return {}

        groups.progress_sources.append(fails_once)  # read by the heartbeat thread at its next beat
        stay_until(1, TIMEOUT_S + 10)  # alive, elsewhere, while rank 0 fails and diagnoses
        first = health.latch.first_failure
        return {"poisoned": None if first is None else str(first), "beats_after_error": len(calls) - 1}
    result = caught(lambda: f(torch.ones(2)))
    release()
    return result


def test_the_heartbeat_survives_a_store_error_so_its_rank_still_hears_of_failures_and_looks_alive():
    outcome = run_ranks(heartbeat_hits_an_error, 2, env=ENV, timeout=60)
    failing, survivor = outcome.results
    assert survivor["beats_after_error"] >= 3, survivor
    assert survivor["poisoned"] is not None and "rank 0 reported a collective failure" in survivor["poisoned"]
    # Rank 0 sees rank 1 alive elsewhere, not absent.
    assert failing["type"] == "CollectiveDesyncError", failing
    assert "rank 1: alive but not in this collective" in failing["message"], failing["message"]


def clock_an_hour_behind_on_rank_1(rank: int, world: int) -> dict:
    if rank == 1:
        real_time = time.time
        time.time = lambda: real_time() - 3600.0  # another host, with its clock an hour off
    return absent_after_groups_exist(rank, world)


def test_heartbeats_are_judged_by_the_observer_clock_never_by_comparing_two_hosts_clocks():
    outcome = run_ranks(clock_an_hour_behind_on_rank_1, 2, env=ENV, timeout=60)
    r = outcome.results[0]
    assert r["type"] == "CollectiveDesyncError", r  # alive elsewhere, not "no heartbeat for 3600 s"
    assert "rank 1: alive but not in this collective" in r["message"], r["message"]


# ---------------------------------------------------------------- Ctrl-C


def interrupted_inside_the_guard_collective(rank: int, world: int) -> dict:
    import compiler_collectives as cc
    from compiler_collectives import health
    from compiler_collectives.transport import groups

    signal.signal(signal.SIGINT, signal.default_int_handler)
    cc.enable(guards=True)
    f = torch.compile(_step, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    if rank == 1:
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            f(torch.ones(2))  # rank 0 enters only after: Ctrl-C lands inside the guard hook
            out = {"raised": None}
        except KeyboardInterrupt:
            out = {"raised": "KeyboardInterrupt"}
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out = {"raised": type(e).__name__, "message": str(e)}
        out["refuses_afterwards"] = health.latch.first_failure is not None
        release("interrupted")
        stay_until(1, 30)  # stay while rank 0 runs its call and listens for reports
        return out
    stay_until(1, 30, "interrupted")
    result = _with_transport(caught(lambda: f(torch.ones(2))))
    beats = groups.side.beats
    while groups.side.beats < beats + 3:  # three heartbeats: any failure report would have poisoned us
        time.sleep(0.01)
    first = health.latch.first_failure
    result["poisoned"] = None if first is None else str(first)
    result["failure_reports"] = int(groups.side.store.add("failures", 0))
    release()
    return result


@GUARD_TRANSPORTS
@pytest.mark.torch_seam
def test_ctrl_c_inside_the_guard_hook_stays_a_keyboard_interrupt_and_does_not_poison_other_ranks(transport):
    """Rank 0 listens for failure reports for three heartbeats, 0.25 s apart here."""
    env = _env(transport, rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S, heartbeat_s=0.25))
    outcome = run_ranks(interrupted_inside_the_guard_collective, 2, env=env, timeout=60)
    interrupted, other = outcome.results[1], outcome.results[0]
    assert interrupted["raised"] == "KeyboardInterrupt", interrupted
    assert interrupted["refuses_afterwards"], interrupted  # this rank left a collective half-done
    assert other["transport"] == transport, other
    assert other["type"] is None, other
    assert other["poisoned"] is None and other["failure_reports"] == 0, other


# ---------------------------------------------------------------- exchanges of a compile


def phases_differ(rank: int, world: int) -> dict:
    import compiler_collectives as cc
    from compiler_collectives import config

    cc.enable()
    torch.compile(_step, backend="eager")(torch.ones(2))  # groups exist: the setup check has passed
    if rank == 1:
        config.set_value("exchange_inputs_first", False)  # changed behind the setup check's back
    return caught(lambda: torch.compile(_other, backend="eager")(torch.ones(2)))


@NAMED_WITHIN_SECONDS
def test_ranks_in_different_exchanges_of_a_compile_raise_a_desync_naming_each_ranks_exchange():
    outcome = run_ranks(phases_differ, 2, env=LONG_ENV, timeout=60)
    for r in outcome.results:
        assert r["type"] == "CollectiveDesyncError", r
        assert "rank 0: the input exchange (before the first trace)" in r["message"], r["message"]
        assert "rank 1: the end-of-trace exchange" in r["message"], r["message"]
        assert r["seconds"] < 5.0, r
