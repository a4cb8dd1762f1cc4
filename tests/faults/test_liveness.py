"""One liveness verdict on a peer (issues 29, 37): what shows a peer alive, stopped, wedged,
silent or gone, and what each wait makes of it.

The verdict (``health.liveness.judge``) reads a peer's heartbeat record, for a
process on this host ``/proc``, and what a look at its connection found; the
tests give it real processes: this test process, or a child that sleeps,
stopped, resumed and killed for real. The failure diagnosis names a stopped,
wedged or silent peer absent; compile once's wait (``health.watch.watch_peer``,
``groups.watch_peers``) waits for all three, warning when it starts and every
period while it lasts, and gives up only on a gone or failed one (evidence of
death, not silence), heartbeats on or off. Side channels run over a real
``FileStore``: two in one process stand for two ranks.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

import compiler_collectives
from compiler_collectives import config
from compiler_collectives.errors import StoreFailureError, StoreUnresponsive
from compiler_collectives.health import liveness
from compiler_collectives.health.diagnosis import diagnose
from compiler_collectives.health.liveness import COMPILE_WAIT, DIAGNOSIS, Liveness, PeerWatch, judge
from compiler_collectives.health.watch import watch_peer
from compiler_collectives.store.board import SideChannel
from compiler_collectives.store.calls import StoreCaller
from compiler_collectives.transport.segment import process_identity

# Multi-process tests here: release independent (tests/tiers.py).
pytestmark = pytest.mark.release_independent

HERE = 0x1234  # this host's key, as records carry it
ELSEWHERE = 0x5678


def _record_of(pid: int, *, host: int = HERE, n: int = 1, hb_s: float = 1.0) -> dict:
    ident = process_identity(pid)
    assert ident is not None, pid
    return {"pid": pid, "start": ident[1], "host": host, "n": n, "hb_s": hb_s}


def _judge(record: dict | None, *, failed: bool = False, silent_s: float = 0.0) -> liveness.Verdict:
    return judge(record, failed=failed, silent_s=silent_s, here=HERE, probe=process_identity, heartbeat_s=1.0)


def _until(predicate: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    """A real process on this host that only sleeps; always reaped."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _until(lambda: process_identity(child.pid) is not None)
        yield child
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGCONT)
            child.kill()
        child.wait(10)


def _channels(tmp_path, peer_pid: int, *, peer_host: int = HERE) -> tuple[SideChannel, SideChannel]:
    """Rank 0 (this process) and rank 1 (process ``peer_pid`` on host ``peer_host``), on one real FileStore."""
    store = dist.FileStore(str(tmp_path / "store"), 1)

    def identity(pid: int, host: int) -> dict[str, object]:
        ident = process_identity(pid)
        assert ident is not None
        return {"pid": pid, "start": ident[1], "host": host, "node": f"node{host:x}"}

    channels = tuple(
        SideChannel(r, 2, 1, dict, identity=identity(pid, host), probe=process_identity, store=store)
        for r, pid, host in ((0, os.getpid(), HERE), (1, peer_pid, peer_host))
    )
    for side in channels:
        side.start(on_peer_failure=lambda peer, report: None)
    return channels[0], channels[1]


@pytest.fixture
def heartbeats_off() -> Iterator[None]:
    # No heartbeat thread: what the compile wait sees is the record written at start and /proc.
    with config.override(heartbeat_s=0.0):
        yield


# ---------------------------------------------------------------- the verdict


def test_a_peer_that_reported_a_failure_failed():
    assert _judge(_record_of(os.getpid()), failed=True).liveness is Liveness.FAILED


def test_a_peer_that_never_wrote_a_record_is_gone():
    verdict = _judge(None)
    assert verdict.liveness is Liveness.GONE
    assert "never sent a heartbeat" in verdict.why


def test_a_same_host_peer_whose_process_runs_is_alive_with_heartbeats_off():
    verdict = _judge(_record_of(os.getpid(), hb_s=0.0), silent_s=3600.0)
    assert verdict.liveness is Liveness.ALIVE
    assert verdict.pid == os.getpid()


def test_a_same_host_peer_silent_while_its_process_runs_is_wedged():
    verdict = _judge(_record_of(os.getpid()), silent_s=liveness.stale_after(1.0))
    assert verdict.liveness is Liveness.WEDGED
    assert f"yet its process (pid {os.getpid()}, this host) runs: it is wedged" in verdict.why
    assert "py-spy dump --native" in verdict.why


def test_a_same_host_peer_whose_pid_now_names_another_process_is_gone():
    record = {**_record_of(os.getpid()), "start": process_identity(os.getpid())[1] + 1}
    verdict = _judge(record)
    assert verdict.liveness is Liveness.GONE
    assert "is gone: crashed, killed or exited" in verdict.why


def test_a_peer_on_another_host_is_alive_while_its_beat_moves_and_silent_not_gone_once_it_stops():
    record = {**_record_of(os.getpid(), host=ELSEWHERE), "node": "node7"}
    assert _judge(record, silent_s=liveness.stale_after(1.0) - 0.1).liveness is Liveness.ALIVE
    silent = _judge(record, silent_s=liveness.stale_after(1.0))
    assert silent.liveness is Liveness.SILENT  # not heard from: no evidence of death
    assert "no heartbeat for 3.0s (crashed, killed, stopped or cut off from the store)" in silent.why
    assert (silent.pid, silent.node) == (os.getpid(), "node7")  # where to look at it


def test_a_peer_on_another_host_whose_connection_to_this_rank_broke_is_gone_heartbeats_on_or_off():
    for record in (_record_of(os.getpid(), host=ELSEWHERE), _record_of(os.getpid(), host=ELSEWHERE, hb_s=0.0)):
        verdict = judge(
            record,
            failed=False,
            silent_s=0.0,
            here=HERE,
            probe=process_identity,
            heartbeat_s=1.0,
            broken="gloo: Connection reset by peer",
        )
        assert verdict.liveness is Liveness.GONE
        assert "its connection to this rank broke (gloo: Connection reset by peer)" in verdict.why


def test_the_compile_wait_warns_of_a_silent_peer_with_where_to_look_at_it():
    silent = liveness.Verdict(Liveness.SILENT, "no heartbeat", pid=4242, silent_s=47.0, node="node7")
    warning = COMPILE_WAIT.warning(3, silent, connected=True)
    assert "rank 3 (pid 4242 on node7, another host) has not been heard from for 47s" in warning
    assert "its connection to this rank is intact" in warning
    assert "on node7, `py-spy dump --native --pid 4242` shows where it is" in warning
    assert "COMPILER_COLLECTIVES_COMPILE_TIMEOUT" in warning


def test_a_peer_on_another_host_without_a_heartbeat_is_unknown_never_gone():
    verdict = _judge(_record_of(os.getpid(), host=ELSEWHERE, hb_s=0.0), silent_s=3600.0)
    assert verdict.liveness is Liveness.UNKNOWN


def test_silence_is_timed_on_this_rank_clock_from_the_last_move_of_the_beat_counter():
    now = [100.0]
    watch = PeerWatch(here=HERE, probe=process_identity, heartbeat_s=1.0, clock=lambda: now[0])
    record = _record_of(os.getpid(), host=ELSEWHERE, n=1)
    assert watch.read(record, failed=False).liveness is Liveness.ALIVE
    now[0] += 2.0
    assert watch.read({**record, "n": 2}, failed=False).liveness is Liveness.ALIVE  # moved at 102
    now[0] += 2.9
    assert watch.read({**record, "n": 2}, failed=False).liveness is Liveness.ALIVE  # silent 2.9 s < 3.0 s
    now[0] += 0.2
    verdict = watch.read({**record, "n": 2}, failed=False)
    assert verdict.liveness is Liveness.SILENT and verdict.silent_s == pytest.approx(3.1)


# ---------------------------------------------------------------- the policies


@pytest.mark.parametrize(
    "verdict, diagnosis_absent, compile_wait_absent, compile_wait_warns",
    [
        (Liveness.ALIVE, False, False, False),
        (Liveness.UNKNOWN, False, False, False),
        (Liveness.STOPPED, True, False, True),
        (Liveness.WEDGED, True, False, True),
        (Liveness.SILENT, True, False, True),
        (Liveness.GONE, True, True, False),
        (Liveness.FAILED, True, True, False),
    ],
)
def test_the_diagnosis_gives_up_on_a_stopped_wedged_or_silent_peer_the_compile_wait_waits_with_a_warning(
    verdict, diagnosis_absent, compile_wait_absent, compile_wait_warns
):
    v = liveness.Verdict(verdict, "why")
    assert DIAGNOSIS.gives_up(v) is diagnosis_absent
    assert COMPILE_WAIT.gives_up(v) is compile_wait_absent
    assert (verdict in COMPILE_WAIT.warn) is compile_wait_warns


# ---------------------------------------------------------------- real processes


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_peer_resumed_after_a_long_stop_is_alive_not_wedged_before_its_next_beat(sleeper):
    """Silence counts only while the process runs: right after SIGCONT, before its heartbeat
    thread beats again, a peer stopped for longer than the staleness window is alive (it was
    called wedged, a second warning in compile once's wait)."""
    now = [100.0]
    watch = PeerWatch(here=HERE, probe=process_identity, heartbeat_s=0.5, clock=lambda: now[0])
    record = _record_of(sleeper.pid, n=7)
    assert watch.read(record, failed=False).liveness is Liveness.ALIVE
    sleeper.send_signal(signal.SIGSTOP)
    _until(lambda: process_identity(sleeper.pid)[0] in ("T", "t"))
    for _ in range(10):  # stopped for 10 s of this rank's clock, its beat counter standing still
        now[0] += 1.0
        assert watch.read(record, failed=False).liveness is Liveness.STOPPED
    sleeper.send_signal(signal.SIGCONT)
    _until(lambda: process_identity(sleeper.pid)[0] not in ("T", "t"))
    now[0] += 0.1
    assert watch.read(record, failed=False).liveness is Liveness.ALIVE


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_same_host_process_stopped_is_stopped_resumed_is_alive_and_killed_is_gone(sleeper):
    record = _record_of(sleeper.pid)
    assert _judge(record).liveness is Liveness.ALIVE
    sleeper.send_signal(signal.SIGSTOP)
    _until(lambda: _judge(record).liveness is not Liveness.ALIVE)
    stopped = _judge(record)
    assert stopped.liveness is Liveness.STOPPED, stopped
    assert f"pid {sleeper.pid}, this host) is stopped (SIGSTOP or a debugger)" in stopped.why
    sleeper.send_signal(signal.SIGCONT)
    _until(lambda: _judge(record).liveness is not Liveness.STOPPED)
    assert _judge(record).liveness is Liveness.ALIVE
    sleeper.kill()
    sleeper.wait(10)
    gone = _judge(record)
    assert gone.liveness is Liveness.GONE, gone
    assert f"pid {sleeper.pid}, this host) is gone" in gone.why


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_with_heartbeats_off_the_compile_wait_names_a_dead_same_host_peer_gone_within_a_poll(
    tmp_path, heartbeats_off, sleeper
):
    waiter, compiler = _channels(tmp_path, sleeper.pid)
    try:
        assert not compiler.beating  # no thread: only the record written at start
        probe = watch_peer(waiter, 1)
        assert probe() is None
        sleeper.kill()
        sleeper.wait(10)
        gone = probe()
        assert gone is not None and f"pid {sleeper.pid}, this host) is gone" in gone, gone
    finally:
        waiter.stop(1.0)
        compiler.stop(1.0)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_the_compile_wait_waits_for_a_stopped_peer_warning_once_while_the_diagnosis_names_it_absent(
    tmp_path, heartbeats_off, sleeper, caplog
):
    waiter, compiler = _channels(tmp_path, sleeper.pid)
    try:
        probe = watch_peer(waiter, 1, policy=COMPILE_WAIT)
        sleeper.send_signal(signal.SIGSTOP)
        _until(lambda: process_identity(sleeper.pid)[0] in ("T", "t"))
        with caplog.at_level(logging.WARNING, logger="compiler_collectives.watchdog"):
            assert [probe() for _ in range(20)] == [None] * 20
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert f"rank 1's process (pid {sleeper.pid}, this host) is stopped (SIGSTOP or a debugger)" in warnings[0]
        assert "COMPILER_COLLECTIVES_COMPILE_TIMEOUT" in warnings[0]

        diagnosis = diagnose(waiter, grace_s=5.0)
        assert diagnosis.absent == [1]
        assert "rank 1: absent, its process" in diagnosis.render() and "is stopped" in diagnosis.render()

        sleeper.send_signal(signal.SIGCONT)
        _until(lambda: process_identity(sleeper.pid)[0] not in ("T", "t"))
        assert probe() is None
    finally:
        waiter.stop(1.0)
        compiler.stop(1.0)


@pytest.mark.timeout(60)
def test_the_compile_wait_waits_for_a_silent_peer_elsewhere_warning_every_period_until_its_connection_breaks(
    tmp_path, caplog, monkeypatch
):
    """Issue 37: silence is no evidence of death; a broken connection is."""
    from compiler_collectives.health import watch

    monkeypatch.setattr(watch, "WARN_EVERY_S", 0.5)
    monkeypatch.setattr(watch, "CONNECTION_EVERY_S", 0.0)
    broken: list[str] = []
    looks = []

    def connection() -> str | None:
        looks.append(time.monotonic())
        return broken[0] if broken else None

    with config.override(heartbeat_s=0.1):
        waiter, compiler = _channels(tmp_path, os.getpid(), peer_host=ELSEWHERE)
        try:
            probe = watch_peer(waiter, 1, policy=COMPILE_WAIT, connection=connection)
            assert probe() is None
            compiler.stop(1.0)  # its beat counter stands still from now on
            with caplog.at_level(logging.WARNING, logger="compiler_collectives.watchdog"):
                deadline = time.monotonic() + 2.0 + liveness.stale_after(0.1)
                while time.monotonic() < deadline:
                    assert probe() is None  # silent: waited for
                    time.sleep(0.05)
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert 3 <= len(warnings) <= 6, warnings  # when it fell silent, then every 0.5 s
            assert all(
                f"rank 1 (pid {os.getpid()} on node5678, another host) has not been heard" in w for w in warnings
            )
            assert looks  # its connection was looked at while it was silent
            broken.append("gloo: Connection reset by peer")
            gone = probe()
            assert gone is not None and "its connection to this rank broke (gloo: Connection reset by peer)" in gone
            assert diagnose(waiter, grace_s=3.0).absent == [1]  # the diagnosis: silent for 0.75 s is absent
        finally:
            waiter.stop(1.0)
            compiler.stop(1.0)


# ---------------------------------------------------------------- store calls


def _counting_thread_starts(monkeypatch) -> list[str]:
    started: list[str] = []
    original = threading.Thread.start

    def start(self: threading.Thread) -> None:
        started.append(self.name)
        original(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return started


@pytest.mark.timeout(60)
def test_polling_a_peer_and_its_notice_starts_no_thread_per_call(tmp_path, heartbeats_off, monkeypatch):
    waiter, compiler = _channels(tmp_path, os.getpid())  # the peer is this process: alive
    try:
        probe = watch_peer(waiter, 1)
        compiler.mailbox.post("once/1/1", b"not yet")
        started = _counting_thread_starts(monkeypatch)
        for _ in range(200):
            assert probe() is None
            assert waiter.mailbox.read_post("once/1/1") == b"not yet"
            assert waiter.mailbox.read_post("once/1/0") is None
        assert len(started) <= 1, started  # at most the one store-call thread, started on first use
    finally:
        waiter.stop(1.0)
        compiler.stop(1.0)


def _store_requests() -> int:
    return int(compiler_collectives.stats()["store_requests"])


@pytest.mark.timeout(60)
def test_with_heartbeats_off_the_compile_wait_reads_a_peer_s_record_once_per_generation_then_never_again(
    tmp_path, heartbeats_off
):
    """Issue 43: without a heartbeat a record never changes; /proc is looked at on every call."""
    waiter, compiler = _channels(tmp_path, os.getpid())
    try:
        probe = watch_peer(waiter, 1)
        before = _store_requests()
        assert [probe() for _ in range(50)] == [None] * 50
        assert _store_requests() - before == 2  # whether its record exists, the record
        time.sleep(1.2)
        assert [probe() for _ in range(50)] == [None] * 50
        assert [watch_peer(waiter, 1)() for _ in range(5)] == [None] * 5  # a later wait of the generation
        assert _store_requests() - before == 2
    finally:
        waiter.stop(1.0)
        compiler.stop(1.0)


def _between_beats(sides: tuple[SideChannel, ...], call: Callable[[], object]) -> tuple[object, int]:
    """``call()``'s result and the store requests counted while it ran, where no side beat meanwhile."""
    for _ in range(50):
        beats = [side.beats for side in sides]
        before = _store_requests()
        result = call()
        if [side.beats for side in sides] == beats:
            return result, _store_requests() - before
        time.sleep(0.02)
    raise AssertionError("a beat fell into every try")


@pytest.mark.timeout(60)
def test_with_heartbeats_on_the_compile_wait_asks_the_store_nothing_its_heartbeat_reads_the_peer_s_record(tmp_path):
    """Issue 43: the waiter's own heartbeat reads the records it watches, in the request that
    reads the failure count: the watch learns the peer's beats at no request of its own."""
    with config.override(heartbeat_s=0.2):
        waiter, compiler = _channels(tmp_path, os.getpid(), peer_host=ELSEWHERE)
        try:
            probe = watch_peer(waiter, 1)
            polls, asked = _between_beats((waiter, compiler), lambda: [probe() for _ in range(100)])
            assert polls == [None] * 100 and asked == 0  # not even a first read
            _until(lambda: (waiter.records.get(1) or {}).get("n", 0) >= 5)  # the compiler's beats, as read
            seen = waiter.records[1]["n"]
            _until(lambda: waiter.records[1]["n"] > seen)  # it moves with the compiler's
            assert probe() is None
        finally:
            waiter.stop(1.0)
            compiler.stop(1.0)


@pytest.mark.timeout(60)
def test_a_notice_wait_blocks_on_the_store_and_wakes_on_the_post_in_a_few_requests(tmp_path, heartbeats_off):
    waiter, compiler = _channels(tmp_path, os.getpid())
    try:
        before = _store_requests()
        notices = waiter.mailbox.wait_posts(["once/1/1"], 30.0)
        assert not notices.done(1.5)
        assert notices.posted() == [None]
        compiler.mailbox.post("once/1/1", b"ok")
        assert notices.done(5.0)
        assert notices.result() == [b"ok"]
        assert _store_requests() - before <= 4  # its connection, the wait, the get; the post
    finally:
        waiter.stop(1.0)
        compiler.stop(1.0)


@pytest.mark.timeout(60)
def test_notice_waits_one_after_another_share_one_store_connection_until_the_channel_stops(tmp_path, heartbeats_off):
    """Issue 37: a connection per generation, not one per wait (each connects: a store request)."""
    waiter, compiler = _channels(tmp_path, os.getpid())
    try:
        cost = []
        for n in range(3):
            if n == 2:
                waiter.stopping()  # GROUP_ENDING: the spare connection goes with the channel
            before = _store_requests()
            notices = waiter.mailbox.wait_posts([f"once/{n}/1"], 30.0)
            compiler.mailbox.post(f"once/{n}/1", b"ok")
            assert notices.done(5.0) and notices.result() == [b"ok"]
            cost.append(_store_requests() - before)
        assert cost == [4, 3, 4], cost  # [its connection,] the wait, the get; the post
    finally:
        waiter.stop(1.0)
        compiler.stop(1.0)


@pytest.mark.timeout(60)
def test_a_cancelled_notice_wait_ends_its_thread_and_another_rank_s_wait_still_gets_the_post(tmp_path, heartbeats_off):
    waiter, compiler = _channels(tmp_path, os.getpid())
    try:
        given_up = waiter.mailbox.wait_posts(["once/1/1"], 30.0)
        other = compiler.mailbox.wait_posts(["once/1/1"], 30.0)  # another rank waiting for the same notice
        assert not given_up.done(0.5)
        assert _waiting_threads() == 2
        given_up.cancel("rank 0 stopped waiting for it")
        assert given_up.done(0.0) and _waiting_threads() == 1  # its thread ended with it
        assert waiter.mailbox.read_post("once/1/1") is None  # what it left there is no post
        assert not other.done(0.5)
        waiter.mailbox.post("once/1/1", b"ok")
        assert other.done(5.0) and other.result() == [b"ok"]
    finally:
        waiter.stop(1.0)
        compiler.stop(1.0)


@pytest.mark.timeout(60)
def test_a_notice_wait_whose_store_host_goes_away_ends_at_once_with_a_store_failure_naming_it(heartbeats_off):
    host = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)  # the store's server, in this process
    port = host.port
    client = dist.TCPStore("127.0.0.1", port, 1, False)
    waiter = SideChannel(0, 2, 1, dict, identity={"pid": os.getpid()}, probe=process_identity, store=client)
    try:
        notices = waiter.mailbox.wait_posts(["once/1/1"], 30.0)
        assert not notices.done(0.5)
        del host  # its server stops: every connection to it closes
        began = time.monotonic()
        assert notices.done(5.0)
        assert time.monotonic() - began < 5.0
        with pytest.raises(StoreFailureError, match=f"rank 0: the c10d store at 127.0.0.1:{port} failed") as caught:
            notices.result()
        assert "once/1/1" in str(caught.value)
        assert isinstance(caught.value.__cause__, dist.DistError)  # c10d's own error, chained
    finally:
        waiter.stop(1.0)


@pytest.mark.timeout(60)
def test_a_notice_wait_for_several_posts_asks_one_wait_and_one_read_and_a_cancel_ends_it(tmp_path, heartbeats_off):
    """Issue 43: a wait costs the same two requests whatever number of ranks it waits for."""
    waiter, compiler = _channels(tmp_path, os.getpid())
    try:
        waiter.mailbox.connect()  # the generation's connection, made with its compile group
        before = _store_requests()
        notices = waiter.mailbox.wait_posts(["once/1/1", "once/1/2", "once/1/3"], 30.0)
        for n in (3, 1):
            compiler.mailbox.post(f"once/1/{n}", f"ok {n}".encode())
        assert not notices.done(0.5)
        compiler.mailbox.post("once/1/2", b"ok 2")
        assert notices.done(5.0) and notices.result() == [b"ok 1", b"ok 2", b"ok 3"]
        assert _store_requests() - before == 2 + 3  # the wait, the read; the three posts
        given_up = waiter.mailbox.wait_posts(["once/2/1", "once/2/2"], 30.0)
        compiler.mailbox.post("once/2/2", b"ok")
        assert not given_up.done(0.5)
        given_up.cancel("rank 0 stopped waiting for it")
        assert given_up.done(0.0) and _waiting_threads() == 0
        assert waiter.mailbox.read_post("once/2/1") is None  # what it left there is no post
        assert waiter.mailbox.read_post("once/2/2") == b"ok"  # never over a post
    finally:
        waiter.stop(1.0)
        compiler.stop(1.0)


STORE_HOST = (
    "import time, torch.distributed as dist\n"
    "store = dist.TCPStore('127.0.0.1', 0, 1, True, wait_for_workers=False)\n"
    "print(store.port, flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_store_that_stops_answering_the_heartbeat_is_told_after_the_timeout_this_process_s_own_stops_not_counted():
    """Issue 43: what tells a wait that the store stopped is its own heartbeat, left unanswered;
    a gap between two looks (this process stopped) counts ``STEP_CAP_S`` at most."""
    from compiler_collectives.health.watch import STEP_CAP_S, StoreWatch

    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        client = dist.TCPStore("127.0.0.1", int(host.stdout.readline()), 1, False)
        with config.override(heartbeat_s=0.1):
            side = SideChannel(0, 1, 1, dict, identity={"pid": os.getpid()}, probe=process_identity, store=client)
            side.start(on_peer_failure=lambda peer, report: None)
        try:
            store = StoreWatch(side, timeout_s=2.0)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:  # it answers: nothing to tell
                assert store() is None
                time.sleep(0.05)
            host.send_signal(signal.SIGSTOP)
            _until(lambda: side.unanswered() is not None)
            assert store() is None
            time.sleep(2.5)  # one gap longer than the timeout: counted as STEP_CAP_S
            assert store() is None
            stopped = time.monotonic() - STEP_CAP_S
            told = None
            while told is None:
                assert time.monotonic() - stopped < 5.0, "never told"
                time.sleep(0.05)
                told = store()
            assert told >= 2.0 and time.monotonic() - stopped >= 1.9
        finally:
            host.kill()  # a stopped store: the heartbeat thread still inside it ends too
            side.stop(2.0)
    finally:
        if host.poll() is None:
            host.kill()
        host.wait(10)


def _waiting_threads() -> int:
    return sum(t.name == "compiler_collectives-notices" for t in threading.enumerate())


@pytest.mark.timeout(60)
def test_a_store_call_that_hangs_raises_store_unresponsive_within_its_bound_and_later_calls_still_run():
    caller = StoreCaller()
    release = threading.Event()
    try:
        began = time.monotonic()
        with pytest.raises(StoreUnresponsive):
            caller.call(release.wait, 0.3, "a hung call")
        assert time.monotonic() - began < 2.0
        # The worker is still inside the hung call: the next call does not queue behind it.
        assert caller.call(lambda: 42, 2.0, "a quick call") == 42
    finally:
        release.set()
        caller.close(2.0)


@pytest.mark.timeout(60)
def test_while_a_store_hangs_calls_raise_at_once_instead_of_piling_up_threads():
    caller = StoreCaller()
    release = threading.Event()
    try:
        for _ in range(StoreCaller.MAX_STUCK):
            with pytest.raises(StoreUnresponsive):
                caller.call(release.wait, 0.2, "a hung call")
        began = time.monotonic()
        with pytest.raises(StoreUnresponsive, match="has not returned from"):
            caller.call(lambda: 42, 30.0, "a call to a hung store")
        assert time.monotonic() - began < 1.0
        release.set()  # the store answers again: the stuck workers end, and calls run again
        _until(lambda: _answers(caller))
        assert caller.call(lambda: 42, 2.0, "a call") == 42
    finally:
        release.set()
        caller.close(2.0)


def _answers(caller: StoreCaller) -> bool:
    try:
        caller.call(lambda: None, 2.0, "a call")
    except StoreUnresponsive:
        return False
    return True


@pytest.mark.timeout(60)
def test_a_store_call_raises_the_store_s_own_error_to_its_caller():
    caller = StoreCaller()
    try:
        with pytest.raises(KeyError):
            caller.call(lambda: {}["missing"], 2.0, "a failing call")
    finally:
        caller.close(2.0)


@pytest.mark.timeout(60)
def test_with_heartbeats_off_a_rank_still_writes_its_identity_once_and_starts_no_thread(
    tmp_path, heartbeats_off, monkeypatch
):
    started = _counting_thread_starts(monkeypatch)
    waiter, compiler = _channels(tmp_path, os.getpid())
    try:
        assert not compiler.beating
        assert [name for name in started if "heartbeat" in name] == []
        record = json.loads(waiter.store.get("hb/1"))
        assert {k: record[k] for k in ("pid", "host", "hb_s")} == {"pid": os.getpid(), "host": HERE, "hb_s": 0.0}
        assert record["start"] == process_identity(os.getpid())[1]
        assert watch_peer(waiter, 1)() is None  # alive: found in /proc from that record
    finally:
        waiter.stop(1.0)
        compiler.stop(1.0)
