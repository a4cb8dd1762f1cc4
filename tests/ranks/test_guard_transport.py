"""The guard collective's shared-memory transport and host leaders (multi-process).

Ranks are split into "hosts" the way torchrun splits them into agents: by
``GROUP_RANK``, set in each rank before our groups exist. Ranks with the same
value share a segment; one leader per value exchanges with the others.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiler_collectives.transport import futex, segment, shm
from tests.fixtures import NAMED_WITHIN_SECONDS, clean_env
from tests.harness import free_port, release, run_ranks, stay_until
from tests.rank_env import rank_env
from tests.rankside import kept_logs, on_host

# Every test here starts rank processes or subprocesses: the multi-process tier.
pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

TIMEOUT_S = 6.0
PG_TIMEOUT_S = 1800
ENV = rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S)
SEGMENT_PREFIX = "compiler_collectives-"


def _segments_of(pids: list[int]) -> list[str]:
    """Names in /dev/shm that one of these processes created."""
    return [name for name in os.listdir("/dev/shm") if any(name.startswith(f"{SEGMENT_PREFIX}{pid}-") for pid in pids)]


def _expected(pattern: list[tuple[list[bool], list[int]]]) -> list[tuple[bool, bool]]:
    out = []
    for hits, sites in pattern:
        in_step = len(set(sites)) == 1
        out.append((in_step and all(hits), in_step))
    return out


def _random_pattern(seed: int, world: int, calls: int) -> list[tuple[list[bool], list[int]]]:
    rng = random.Random(seed)
    pattern = []
    for _ in range(calls):
        hits = [rng.random() > 0.15 for _ in range(world)]
        sites = [7] * world
        if rng.random() < 0.05:
            sites[rng.randrange(world)] = 8  # one rank enters another frame
        pattern.append((hits, sites))
    return pattern


# ---------------------------------------------------------------- rank functions


def agree_pattern(rank: int, world: int, hosts: int, pattern: list, sleep_at_once: bool = False) -> dict:
    on_host(rank, world, hosts)
    from compiler_collectives.transport import groups

    channel = groups.guard_channel()
    if sleep_at_once:  # every wait goes to the futex: its wake-ups carry the whole run
        channel.exchange.tune(spin=0, yield_s=0.0, sleep=True)
    outcomes = [channel.agree(hits[rank], seq, sites[rank]) for seq, (hits, sites) in enumerate(pattern, 1)]
    return {"transport": channel.name, "outcomes": outcomes}


def waits_for_a_late_peer(rank: int, world: int, late_s: float, sleep_s: float) -> dict:
    """Rank 1 arrives ``late_s`` late; rank 0 waits, each of its sleeps bounded by ``sleep_s``."""
    from compiler_collectives.transport import groups

    channel = groups.guard_channel()
    channel.agree(True, 1, 0)  # both ranks past setup
    if rank == 0:
        channel.exchange.tune(yield_s=0.0, sleep=True, sleep_s=sleep_s)
        cpu, start = time.thread_time(), time.time()
        outcome = channel.agree(True, 2, 0)
        return {
            "outcome": outcome,
            "returned_at": time.time(),
            "wall_s": time.time() - start,
            "cpu_s": time.thread_time() - cpu,
        }
    time.sleep(late_s)
    arrived_at = time.time()
    return {"outcome": channel.agree(True, 2, 0), "arrived_at": arrived_at}


def sleeps_while_a_peer_fails(rank: int, world: int) -> dict:
    """Rank 1 never calls; rank 2 times out on it and publishes its failure; rank 0 sleeps
    with a 60 s bound on each sleep, so only a wake-up ends its wait early."""
    import compiler_collectives as cc
    from compiler_collectives.transport import groups

    cc.enable(guards=True)
    f = torch.compile(lambda x: x + 1, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    if rank == 1:
        stay_until(2, 15.0)  # alive, never calling, until ranks 0 and 2 have their errors
        return {}
    if rank == 0:
        groups.guard_channel().exchange.tune(yield_s=0.0, sleep=True, sleep_s=60.0)
    start = time.monotonic()
    try:
        f(torch.ones(2))
    except cc.CollectiveError as e:
        release()
        return {"type": type(e).__name__, "ranks": list(e.ranks), "seconds": time.monotonic() - start}
    release()
    return {"type": None}


def one_sided_miss(rank: int, world: int, hosts: int, misser: int) -> dict:
    on_host(rank, world, hosts)
    import compiler_collectives as cc
    from compiler_collectives.transport import groups

    cc.enable(guards=True)
    torch._dynamo.config.automatic_dynamic_shapes = False
    f = torch.compile(lambda x: x * 2, backend="eager")
    compiles = []
    for step in range(6):
        rows = 5 if (rank == misser and step >= 3) else 4  # one rank changes shape at step 3
        before = cc.stats()["compiler_collectives"]
        f(torch.ones(rows))
        compiles.append(cc.stats()["compiler_collectives"] - before)
    return {"transport": groups.guard_transport(), "compiles": compiles, "forced": cc.stats()["forced_recompiles"]}


def list_segments_after_setup(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from compiler_collectives.transport import groups

    channel = groups.guard_channel()
    channel.agree(True, 1, 0)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    return {"transport": channel.name, "pids": pids, "left": _segments_of(pids)}


def killed_mid_collective(rank: int, world: int, hosts: int, victim: int) -> dict:
    on_host(rank, world, hosts)
    import torch.distributed as dist

    import compiler_collectives as cc
    from compiler_collectives.transport import groups

    cc.enable(guards=True)
    f = torch.compile(lambda x: x + 1, backend="eager")
    f(torch.ones(2))
    f(torch.ones(2))
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(3):
            f(torch.ones(2))
    except cc.CollectiveError as e:
        return {
            "transport": groups.guard_transport(),
            "type": type(e).__name__,
            "ranks": list(e.ranks),
            "message": str(e),
            "seconds": time.monotonic() - start,
            "pids": pids,
        }
    return {"transport": groups.guard_transport(), "type": None, "pids": pids}


def private_dev_shm(rank: int, world: int) -> dict:
    """Rank 1 gets a /dev/shm of its own, as in a container that does not share it."""
    if rank == 1:
        libc = ctypes.CDLL(None, use_errno=True)
        if (
            libc.unshare(0x00020000) != 0  # CLONE_NEWNS
            or libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) != 0  # MS_REC | MS_PRIVATE
            or libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, None) != 0
        ):
            return {"skip": f"cannot make a private /dev/shm here (errno {ctypes.get_errno()})"}
    records = kept_logs("compiler_collectives", "INFO")
    logging.getLogger("compiler_collectives").setLevel(logging.INFO)
    result = one_sided_miss(rank, world, 1, misser=1)
    return {**result, "logs": records}


def store_names_a_file(rank: int, world: int, victim: str) -> dict:
    """Rank 1, as any client of the c10d store could, writes the key that names the
    host's segment before the leader does; it names a file the job must not touch."""
    import torch.distributed as dist

    from compiler_collectives import runtime

    if rank == 1:
        # Our keys' prefix names the generation: 0 in a fresh process, later ones in a pool's.
        number = runtime.current().generation.number
        store = dist.PrefixStore(f"compiler_collectives/{number}/", dist.distributed_c10d._get_default_store())
        store.set("shm/0/path", victim)  # the key our side channel's store gives the segment's name
    records = kept_logs("compiler_collectives", "INFO")
    logging.getLogger("compiler_collectives").setLevel(logging.INFO)
    pattern = _random_pattern(5, world, 20)
    result = agree_pattern(rank, world, 1, pattern)
    return {**result, "expected": _expected(pattern), "logs": records}


# ---------------------------------------------------------------- one host


@pytest.mark.timeout(90)
def test_ranks_of_one_host_agree_through_shared_memory_by_default():
    pattern = _random_pattern(1, 2, 200)
    outcome = run_ranks(agree_pattern, 2, args=(1, pattern), env=ENV, timeout=60)
    for r in outcome.results:
        assert r["transport"] == "shm"
        assert r["outcomes"] == _expected(pattern)


needs_futex = pytest.mark.skipif(not futex.Futex.available(), reason="futexes need Linux on x86-64 or AArch64")


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "seed,calls,sleep_at_once",
    [
        pytest.param(2, 3000, False, id="yielding"),
        pytest.param(3, 1500, True, id="sleeping-at-every-wait", marks=needs_futex),
    ],
)
def test_four_ranks_on_two_cores_agree_on_every_call_of_a_long_run(seed, calls, sleep_at_once):
    pattern = _random_pattern(seed, 4, calls)
    outcome = run_ranks(agree_pattern, 4, args=(1, pattern, sleep_at_once), env=ENV, timeout=120)
    for r in outcome.results:
        assert r["transport"] == "shm"
        assert r["outcomes"] == _expected(pattern)


@needs_futex
@pytest.mark.timeout(90)
def test_a_rank_that_waits_long_sleeps_instead_of_burning_its_core():
    outcome = run_ranks(waits_for_a_late_peer, 2, args=(1.5, shm.SLEEP_S), env=ENV, timeout=60)
    waiter = outcome.results[0]
    assert waiter["outcome"] == (True, True)
    assert waiter["wall_s"] >= 1.3, waiter
    # Yielding for those 1.5 s would cost about 1.5 s of CPU; sleeping costs the wake-ups
    # of its 2 ms bound and the liveness checks.
    assert waiter["cpu_s"] < 0.3, waiter


@needs_futex
@pytest.mark.timeout(90)
def test_a_sleeping_rank_is_woken_by_the_arrival_not_by_the_bound_on_its_sleep():
    outcome = run_ranks(waits_for_a_late_peer, 2, args=(1.0, 30.0), env=ENV, timeout=60)
    waiter, late = outcome.results
    assert waiter["outcome"] == late["outcome"] == (True, True)
    assert waiter["returned_at"] - late["arrived_at"] < 0.5, (waiter, late)


@needs_futex
@pytest.mark.timeout(90)
@NAMED_WITHIN_SECONDS
def test_a_failure_published_on_the_host_wakes_a_sleeping_rank():
    outcome = run_ranks(
        sleeps_while_a_peer_fails,
        3,
        env=rank_env(timeout_s=40, pg_timeout_s=PG_TIMEOUT_S),
        timeout=80,
        rank_env={2: rank_env(timeout_s=2)},
    )
    sleeper, failing = outcome.results[0], outcome.results[2]
    assert failing["type"] == "CollectiveDesyncError", failing  # rank 1 is alive, elsewhere
    # The sleeper learned of it from rank 2's report: it quotes it (naming the rank rank 2
    # waited for), never re-types it as a desync of its own.
    assert sleeper["type"] == "PeerFailureError" and sleeper["ranks"] == [1], sleeper
    # Woken by rank 2's failure word at about 2 s, long before its own timeout (40 s)
    # or the bound on its sleep (60 s); both then spend the same diagnosis grace.
    assert sleeper["seconds"] < 12.0, sleeper
    assert abs(sleeper["seconds"] - failing["seconds"]) < 2.0, (sleeper, failing)


@pytest.mark.timeout(90)
def test_a_one_sided_miss_on_shared_memory_makes_every_rank_recompile():
    outcome = run_ranks(one_sided_miss, 2, args=(1, 1), env=ENV, timeout=60)
    for r in outcome.results:
        assert r["transport"] == "shm"
        assert r["compiles"] == [1, 0, 0, 1, 0, 0], r
    assert outcome.results[0]["forced"] == 1  # rank 0 hit, yet recompiled with rank 1


# ---------------------------------------------------------------- several hosts


@pytest.mark.timeout(90)
def test_a_one_sided_miss_on_the_second_host_makes_every_rank_of_both_hosts_recompile():
    outcome = run_ranks(one_sided_miss, 4, args=(2, 3), env=ENV, timeout=75)
    for r in outcome.results:
        assert r["transport"] == "shm+leaders"
        assert r["compiles"] == [1, 0, 0, 1, 0, 0], r
    assert [r["forced"] for r in outcome.results] == [1, 1, 1, 0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,hosts", [(3, 3), (5, 5), (6, 3)])
def test_host_counts_that_are_not_powers_of_two_reach_one_outcome_on_every_rank(world, hosts):
    pattern = _random_pattern(world * 10 + hosts, world, 300)
    outcome = run_ranks(agree_pattern, world, args=(hosts, pattern), env=ENV, timeout=100)
    for r in outcome.results:
        assert r["transport"] == "shm+leaders"
        assert r["outcomes"] == _expected(pattern)


@pytest.mark.timeout(300)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from([(2, 1), (4, 2), (3, 3), (4, 4)]),
    calls=st.lists(
        st.tuples(st.lists(st.booleans(), min_size=4, max_size=4), st.integers(-1, 3)), min_size=1, max_size=120
    ),
)
def test_property_random_hit_patterns_give_every_rank_the_outcome_all_hit(layout, calls):
    world, hosts = layout
    # Each call: per-rank hit flags, and which rank (if any) enters another frame.
    pattern = [(hits[:world], [9 if r == odd else 4 for r in range(world)]) for hits, odd in calls]
    outcome = run_ranks(agree_pattern, world, args=(hosts, pattern), env=ENV, timeout=60)
    for r in outcome.results:
        assert r["outcomes"] == _expected(pattern)


@pytest.mark.timeout(90)
@NAMED_WITHIN_SECONDS
def test_a_rank_killed_on_one_host_is_named_on_the_other_host_within_seconds():
    outcome = run_ranks(
        killed_mid_collective, 4, args=(2, 3), env=ENV, timeout=60, check=False, expect_signals={3: signal.SIGKILL}
    )
    assert outcome.exitcodes[3] == -signal.SIGKILL
    assert not outcome.timed_out and not outcome.errors, outcome
    for rank in (0, 1, 2):
        r = outcome.results[rank]
        assert r["transport"] == "shm+leaders", r
        assert r["type"] == "PeerFailureError", r
        assert r["ranks"] == [3], r
        assert r["seconds"] < 5.0, r


def leaders_wait_for_a_late_host(rank: int, world: int, late_s: float) -> dict:
    """Each rank its own host (a leader); rank 1 arrives ``late_s`` late at call 2, then all go on."""
    on_host(rank, world, world)
    from compiler_collectives.transport import groups

    channel = groups.guard_channel()
    outcomes = [channel.agree(True, 1, 0)]
    if rank == 1:
        time.sleep(late_s)
    outcomes += [channel.agree(True, seq, 0) for seq in range(2, 6)]
    return {"transport": channel.name, "outcomes": outcomes}


@pytest.mark.timeout(90)
@pytest.mark.torch_seam  # gloo: a timed wait on a send or receive that expires closes the group
def test_a_leader_waiting_past_a_wait_slice_for_a_late_host_keeps_its_connections():
    """The leaders' waits are untimed: a slice of ``gloo.wait`` (200 ms) that expired on a receive
    closed every connection of the leaders' group, so a host 0.2 s late broke the job."""
    outcome = run_ranks(leaders_wait_for_a_late_host, 3, args=(1.0,), env=ENV, timeout=60)
    for r in outcome.results:
        assert r["transport"] == "shm+leaders", r
        assert r["outcomes"] == [(True, True)] * 5, r


def leader_waits_while_another_host_leaves(rank: int, world: int) -> dict:
    """Rank 0 waits in the leaders' exchange for rank 1 (another host), which never comes: it
    reports that it left instead (its own code raised), and stays alive."""
    on_host(rank, world, world)
    import compiler_collectives  # noqa: F401 - wires the failure procedure: a report heard poisons
    from compiler_collectives.transport import groups

    channel = groups.guard_channel()
    channel.agree(True, 1, 0)
    if rank == 1:
        time.sleep(0.5)  # rank 0 is in its wait
        groups.leave("rank 1's own code raised (the test)", 2)
        stay_until(1, 30.0)
        return {}
    started = time.monotonic()
    try:
        channel.agree(True, 2, 0)
    except Exception as e:  # noqa: BLE001 - what the guard hook would get
        release()
        return {"type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - started}
    release()
    return {"type": None}


@pytest.mark.timeout(90)
@pytest.mark.torch_seam  # gloo: closing a group's connections is a timed wait that expires
def test_a_leader_waiting_for_a_host_that_left_stops_within_about_a_heartbeat_of_hearing_it():
    """Its wait is untimed (COMPILER_COLLECTIVES_TIMEOUT is 30 s here): the heartbeat thread
    that hears the report ends it."""
    outcome = run_ranks(
        leader_waits_while_another_host_leaves,
        2,
        env=rank_env(timeout_s=30, pg_timeout_s=PG_TIMEOUT_S, heartbeat_s=0.5),
        timeout=60,
    )
    waiter = outcome.results[0]
    assert waiter["type"] == "PeerFailureError", waiter
    assert "the exchange between hosts' leaders stopped waiting" in waiter["message"], waiter
    assert "rank 1's own code raised (the test)" in waiter["message"], waiter
    assert waiter["seconds"] < 3.0, waiter


# ---------------------------------------------------------------- segment lifecycle


@pytest.mark.timeout(90)
def test_the_segment_name_is_gone_from_dev_shm_once_every_local_rank_mapped_it():
    outcome = run_ranks(list_segments_after_setup, 3, env=ENV, timeout=60)
    for r in outcome.results:
        assert r["transport"] == "shm"
        assert r["left"] == [], r
    assert _segments_of(outcome.results[0]["pids"]) == []  # nor after a normal exit


@pytest.mark.timeout(90)
def test_no_segment_is_left_in_dev_shm_after_the_leader_is_sigkilled_mid_collective():
    outcome = run_ranks(
        killed_mid_collective, 3, args=(1, 0), env=ENV, timeout=60, check=False, expect_signals={0: signal.SIGKILL}
    )
    assert outcome.exitcodes[0] == -signal.SIGKILL
    survivor = outcome.results[1]
    assert survivor["type"] == "PeerFailureError" and survivor["ranks"] == [0], survivor
    assert _segments_of(survivor["pids"]) == []


@pytest.mark.timeout(90)
def test_a_file_named_on_the_store_is_never_opened_or_deleted_and_the_job_falls_back_to_gloo(tmp_path):
    victim = tmp_path / "precious"
    victim.write_text("keep me")
    victim.chmod(0o400)
    outcome = run_ranks(store_names_a_file, 2, args=(str(victim),), env=ENV, timeout=60)
    assert victim.read_text() == "keep me"
    for r in outcome.results:
        assert r["transport"] == "gloo", r
        assert r["outcomes"] == r["expected"]
    fallback = [line for line in outcome.results[0]["logs"] if "falls back to gloo" in line]
    assert len(fallback) == 1, outcome.results[0]["logs"]
    assert "c10d store key 'shm/0/path' already held" in fallback[0] and str(victim) in fallback[0]
    assert any("nothing was opened or deleted" in line for line in outcome.results[1]["logs"])


def _segment_file(
    tmp_path, token: int, *, mode: int = 0o600, header: bool = True, owner: int | None = None, local_ranks: int = 2
) -> str:
    """A file under our name pattern as someone else might leave it."""
    path = segment.segment_path(os.getpid(), token)
    words = [0] * segment.segment_words(local_ranks)
    if header:
        words[:6] = [segment.MAGIC, segment.LAYOUT_VERSION, local_ranks, 0, token, segment.pid_namespace()]
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.write(fd, b"".join(w.to_bytes(8, "little") for w in words))
    os.fchmod(fd, mode)
    if owner is not None:
        os.fchown(fd, owner, owner)
    os.close(fd)
    return path


@pytest.mark.parametrize(
    "case, why",
    [
        ("outside-pattern", "is not a compiler_collectives segment name"),
        ("symlink", "Too many levels of symbolic links"),  # O_NOFOLLOW
        ("mode", "its mode is 0644, not 0600"),
        ("owner", "it belongs to uid 65534"),
        ("no-header", "does not carry the header its creator wrote"),
        ("other-token", "does not carry the header its creator wrote"),
        ("other-rank-count", "it holds 320 bytes, not the 384 its ranks need"),
    ],
)
def test_a_segment_is_opened_only_under_our_name_as_our_file_with_our_header_and_never_deleted(tmp_path, case, why):
    token = int.from_bytes(os.urandom(8), "little") >> 1
    victim = tmp_path / "precious"
    victim.write_text("keep me")
    if case == "outside-pattern":
        path = str(victim)
    elif case == "symlink":
        path = segment.segment_path(os.getpid(), token)
        os.symlink(victim, path)
    elif case == "owner":
        if os.geteuid() != 0:
            pytest.skip("only root can make a file of another owner")
        path = _segment_file(tmp_path, token, owner=65534)
    else:
        path = _segment_file(tmp_path, token, mode=0o644 if case == "mode" else 0o600, header=case != "no-header")
    try:
        with pytest.raises(OSError) as info:
            segment.Segment.open(
                path, 3 if case == "other-rank-count" else 2, token + 1 if case == "other-token" else token
            )
        assert why in str(info.value)
        assert os.path.lexists(path) and victim.read_text() == "keep me"
    finally:
        if path != str(victim):
            os.unlink(path)


# ---------------------------------------------------------------- leaked segments


def leak_a_segment(rank: int, world: int, token: int, note: str) -> None:
    """Create a segment, write its path to ``note``, and die: as if killed between creating the
    segment and unlinking its name."""
    path = segment.segment_path(os.getpid(), token)
    segment.Segment.create(path, 2, token, 0)
    with open(note, "w") as fh:
        fh.write(path)
    os._exit(0)


@pytest.mark.fresh_ranks("a segment's owners must be processes that ended")
@pytest.mark.timeout(120)
@pytest.mark.whole_machine(
    "/dev/shm is the machine's: any job setting up beside it collects the leaked segment first "
    "(CI run of cf989c8, 2.14.1), and the test would then see nothing to collect"
)
def test_a_segment_whose_ranks_all_died_is_removed_when_a_later_job_sets_up_and_a_live_one_is_kept(tmp_path):
    token = int.from_bytes(os.urandom(8), "little") >> 1
    note = tmp_path / "leaked"
    child = run_ranks(leak_a_segment, 1, args=(token, str(note)), init=False, timeout=60, check=False)
    assert child.exitcodes == [0], child
    leaked = note.read_text()
    live_path = segment.segment_path(os.getpid(), token + 1)  # this test process is its live owner
    live = segment.Segment.create(live_path, 2, token + 1, 0)
    try:
        assert os.path.exists(leaked) and os.path.exists(live_path)
        outcome = run_ranks(list_segments_after_setup, 2, env=ENV, timeout=60)
        assert outcome.results[0]["transport"] == "shm"
        assert not os.path.exists(leaked)
        assert os.path.exists(live_path)
    finally:
        live.unlink_name()
        segment.unlink(leaked)


# ---------------------------------------------------------------- fallback


@pytest.mark.timeout(90)
def test_a_rank_with_a_private_dev_shm_makes_every_rank_fall_back_to_gloo_with_one_log_line():
    outcome = run_ranks(private_dev_shm, 2, env=ENV, timeout=60)
    if outcome.results[1].get("skip"):
        pytest.skip(outcome.results[1]["skip"])
    for r in outcome.results:
        assert r["transport"] == "gloo"
        assert r["compiles"] == [1, 0, 0, 1, 0, 0], r  # still agreeing, on gloo
    fallback = [line for line in outcome.results[0]["logs"] if "falls back to gloo" in line]
    assert len(fallback) == 1, outcome.results[0]["logs"]
    # Neither side can share with the other; rank 0's probe names the rank it cannot see.
    assert "rank(s) [0, 1]" in fallback[0]
    assert "rank 1's slot" in fallback[0] and "/dev/shm is not shared" in fallback[0]
    assert not any("falls back to gloo" in line for line in outcome.results[1]["logs"])


def test_the_gloo_setting_keeps_the_all_reduce_path():
    pattern = _random_pattern(3, 2, 50)
    outcome = run_ranks(
        agree_pattern,
        2,
        args=(1, pattern),
        env=rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S, guard_transport="gloo"),
        timeout=60,
    )
    for r in outcome.results:
        assert r["transport"] == "gloo"
        assert r["outcomes"] == _expected(pattern)


# ---------------------------------------------------------------- torchrun: two agents, two hosts

TWO_AGENTS_SCRIPT = """
import json, os, torch, torch.distributed as dist
import compiler_collectives as cc
from compiler_collectives.transport import groups

dist.init_process_group("gloo")
rank = dist.get_rank()
torch._dynamo.config.automatic_dynamic_shapes = False
f = torch.compile(lambda x: x * 2, backend="eager")
compiles = []
for step in range(5):
    rows = 5 if (rank == 3 and step >= 2) else 4
    before = cc.stats()["compiler_collectives"]
    f(torch.ones(rows))
    compiles.append(cc.stats()["compiler_collectives"] - before)
with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"), "w") as fh:
    json.dump({"transport": groups.guard_transport(), "compiles": compiles,
               "group_rank": os.environ["GROUP_RANK"]}, fh)
dist.destroy_process_group()
"""


@pytest.mark.timeout(200)
@pytest.mark.torch_seam
def test_two_torchrun_agents_on_one_machine_are_two_hosts_and_a_miss_on_the_second_recompiles_all(tmp_path):
    import json

    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TWO_AGENTS_SCRIPT))
    port = free_port()
    env = clean_env(
        **rank_env(
            guards=True,
            timeout_s=60,
            extra={"TORCH_COMPILER_COLLECTIVES": "1", "OMP_NUM_THREADS": "1", "RESULT_DIR": str(tmp_path)},
        )
    )
    from cc_launch import Agents

    with Agents() as started:  # an agent still running at the end is killed with its ranks
        agents = [
            started.start(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(node),
                    "--nproc-per-node",
                    "2",
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    str(port),
                    str(script),
                ],
                env=env,
                log=subprocess.PIPE,
            )
            for node in (0, 1)
        ]
        logs = [a.communicate(timeout=170)[0].decode(errors="replace") for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(logs)[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["group_rank"] for r in results] == ["0", "0", "1", "1"]
    for r in results:
        assert r["transport"] == "shm+leaders", r
        assert r["compiles"] == [1, 0, 1, 0, 0], r
