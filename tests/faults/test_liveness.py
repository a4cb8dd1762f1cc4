"""A peer's liveness on real processes (issues 29, 37, 43): a child stopped, resumed and killed
for real, and a store whose host process stops answering.

The verdict (``health.liveness.judge``) reads a peer's heartbeat record and, for a
process on this host, ``/proc``; here the peer is a child that sleeps, stopped,
resumed and killed for real. Silence counts only while the process runs; the
compile wait (``health.watch.watch_peer``) names a dead same-host peer gone within a
poll with heartbeats off, and waits for a stopped one, warning once, while the
failure diagnosis names it absent. A store that stops answering is told by the
wait's own heartbeat, left unanswered, after the timeout. Side channels run over a
real ``FileStore``: two in one process stand for two ranks. The verdict and the
waits without a process of their own: ``tests/unit/test_liveness_verdicts.py`` and
``tests/unit/test_store_calls.py``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from compiler_collectives import config
from compiler_collectives.health.diagnosis import diagnose
from compiler_collectives.health.liveness import COMPILE_WAIT, Liveness, PeerWatch
from compiler_collectives.health.watch import watch_peer
from compiler_collectives.store.board import SideChannel
from compiler_collectives.transport.segment import process_identity
from tests.unit.test_liveness_verdicts import HERE, _channels, _judge, _record_of, _until

# Multi-process tests here: release independent (tests/tiers.py).
pytestmark = pytest.mark.release_independent


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


@pytest.fixture
def heartbeats_off() -> Iterator[None]:
    # No heartbeat thread: what the compile wait sees is the record written at start and /proc.
    with config.override(heartbeat_s=0.0):
        yield


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
    with _channels(tmp_path, sleeper.pid) as (waiter, compiler):
        assert not compiler.beating  # no thread: only the record written at start
        probe = watch_peer(waiter, 1)
        assert probe() is None
        sleeper.kill()
        sleeper.wait(10)
        gone = probe()
        assert gone is not None and f"pid {sleeper.pid}, this host) is gone" in gone, gone


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_the_compile_wait_waits_for_a_stopped_peer_warning_once_while_the_diagnosis_names_it_absent(
    tmp_path, heartbeats_off, sleeper, caplog
):
    with _channels(tmp_path, sleeper.pid) as (waiter, _compiler):
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
