"""One liveness verdict on a peer (issues 29, 37), as far as no process of its own shows it: what
shows a peer alive, wedged, silent, unknown, gone or failed, and what each wait makes of it.

The verdict (``health.liveness.judge``) reads a peer's heartbeat record, for a
process on this host ``/proc``, and what a look at its connection found; here the
peer is this test process, its record edited, or a peer on another host that falls
silent. The failure diagnosis gives up on a stopped, wedged or silent peer; compile
once's wait waits for all three, warning when one starts and every period while it
lasts, and gives up only on a gone or failed one (evidence of death, not silence).
Side channels run over a real ``FileStore``: two in one process stand for two ranks.
A real child stopped, resumed and killed: ``tests/faults/test_liveness.py``; what the
waits ask of the store: ``tests/unit/test_store_calls.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

from compiler_collectives import config
from compiler_collectives.health import liveness
from compiler_collectives.health.diagnosis import diagnose
from compiler_collectives.health.liveness import COMPILE_WAIT, DIAGNOSIS, Liveness, PeerWatch, judge
from compiler_collectives.health.watch import watch_peer
from compiler_collectives.store.board import SideChannel
from compiler_collectives.transport.segment import process_identity

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


@contextlib.contextmanager
def _channels(tmp_path, peer_pid: int, *, peer_host: int = HERE) -> Iterator[tuple[SideChannel, SideChannel]]:
    """Rank 0 (this process) and rank 1 (process ``peer_pid`` on host ``peer_host``), on one real
    FileStore, started inside and stopped after."""
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
    try:
        yield channels[0], channels[1]
    finally:
        for side in channels:
            side.stop(1.0)


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


# ---------------------------------------------------------------- the compile wait


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
        with _channels(tmp_path, os.getpid(), peer_host=ELSEWHERE) as (waiter, compiler):
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
