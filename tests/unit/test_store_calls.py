"""What a wait asks of the store (issues 37, 43): the compile wait's look at a peer, a notice wait
and a bounded store call, counted in store requests and threads.

Without a heartbeat a peer's record is read once per generation; with one, the waiter's
own heartbeat reads it. A notice wait blocks on the store in a couple of requests however
many posts it waits for, shares the generation's connection, ends its thread when it is
cancelled, and ends at once when the store's host goes away. A store call that hangs
raises within its bound, and while a store hangs calls raise at once instead of piling up
threads. Side channels run over a real ``FileStore`` (or an in-process ``TCPStore``): two
in one process stand for two ranks. A store whose host process stops answering:
``tests/faults/test_liveness.py``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

import compiler_collectives
from compiler_collectives import config
from compiler_collectives.errors import StoreFailureError, StoreUnresponsive
from compiler_collectives.health.watch import watch_peer
from compiler_collectives.store.board import SideChannel
from compiler_collectives.store.calls import StoreCaller
from compiler_collectives.transport.segment import process_identity
from tests.unit.test_liveness_verdicts import ELSEWHERE, HERE, _channels, _until


@pytest.fixture
def heartbeats_off() -> Iterator[None]:
    # No heartbeat thread: what the compile wait sees is the record written at start and /proc.
    with config.override(heartbeat_s=0.0):
        yield


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
    with _channels(tmp_path, os.getpid()) as (waiter, compiler):  # the peer is this process: alive
        probe = watch_peer(waiter, 1)
        compiler.mailbox.post("once/1/1", b"not yet")
        started = _counting_thread_starts(monkeypatch)
        for _ in range(200):
            assert probe() is None
            assert waiter.mailbox.read_post("once/1/1") == b"not yet"
            assert waiter.mailbox.read_post("once/1/0") is None
        assert len(started) <= 1, started  # at most the one store-call thread, started on first use


def _store_requests() -> int:
    return int(compiler_collectives.stats()["store_requests"])


@pytest.mark.timeout(60)
def test_with_heartbeats_off_the_compile_wait_reads_a_peer_s_record_once_per_generation_then_never_again(
    tmp_path, heartbeats_off
):
    """Issue 43: without a heartbeat a record never changes; /proc is looked at on every call."""
    with _channels(tmp_path, os.getpid()) as (waiter, _compiler):
        probe = watch_peer(waiter, 1)
        before = _store_requests()
        assert [probe() for _ in range(50)] == [None] * 50
        assert _store_requests() - before == 2  # whether its record exists, the record
        time.sleep(1.2)
        assert [probe() for _ in range(50)] == [None] * 50
        assert [watch_peer(waiter, 1)() for _ in range(5)] == [None] * 5  # a later wait of the generation
        assert _store_requests() - before == 2


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
        with _channels(tmp_path, os.getpid(), peer_host=ELSEWHERE) as (waiter, compiler):
            probe = watch_peer(waiter, 1)
            polls, asked = _between_beats((waiter, compiler), lambda: [probe() for _ in range(100)])
            assert polls == [None] * 100 and asked == 0  # not even a first read
            _until(lambda: (waiter.records.get(1) or {}).get("n", 0) >= 5)  # the compiler's beats, as read
            seen = waiter.records[1]["n"]
            _until(lambda: waiter.records[1]["n"] > seen)  # it moves with the compiler's
            assert probe() is None


@pytest.mark.timeout(60)
def test_a_notice_wait_blocks_on_the_store_and_wakes_on_the_post_in_a_few_requests(tmp_path, heartbeats_off):
    with _channels(tmp_path, os.getpid()) as (waiter, compiler):
        before = _store_requests()
        notices = waiter.mailbox.wait_posts(["once/1/1"], 30.0)
        assert not notices.done(1.5)
        assert notices.posted() == [None]
        compiler.mailbox.post("once/1/1", b"ok")
        assert notices.done(5.0)
        assert notices.result() == [b"ok"]
        assert _store_requests() - before <= 4  # its connection, the wait, the get; the post


@pytest.mark.timeout(60)
def test_notice_waits_one_after_another_share_one_store_connection_until_the_channel_stops(tmp_path, heartbeats_off):
    """Issue 37: a connection per generation, not one per wait (each connects: a store request)."""
    with _channels(tmp_path, os.getpid()) as (waiter, compiler):
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


@pytest.mark.timeout(60)
def test_a_cancelled_notice_wait_ends_its_thread_and_another_rank_s_wait_still_gets_the_post(tmp_path, heartbeats_off):
    with _channels(tmp_path, os.getpid()) as (waiter, compiler):
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
    with _channels(tmp_path, os.getpid()) as (waiter, compiler):
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
    with _channels(tmp_path, os.getpid()) as (waiter, compiler):
        assert not compiler.beating
        assert [name for name in started if "heartbeat" in name] == []
        record = json.loads(waiter.store.get("hb/1"))
        assert {k: record[k] for k in ("pid", "host", "hb_s")} == {"pid": os.getpid(), "host": HERE, "hb_s": 0.0}
        assert record["start"] == process_identity(os.getpid())[1]
        assert watch_peer(waiter, 1)() is None  # alive: found in /proc from that record
