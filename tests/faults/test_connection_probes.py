"""A look at a peer's gloo connection (issue 37, item 1: a broken connection is evidence of its
death): one pending receive per peer however often it is looked at, and none past a destroy.

Compile once's wait looks at a silent peer's connection about once a second
(``transport.probes.broken_connection``): a zero-byte receive on a tag nobody sends on. Each
receive posted leaves an entry on both ends that nothing matches; one is kept pending per peer
and waited for by a thread of its own, which sees the connection break at once. Two real gloo
ranks; the looks run on the default group.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.harness import release, run_ranks, stay_until

# Gloo's behaviour (a receive pending on a connection that breaks fails at once; a timed wait
# that expires closes the group's connections) is what these tests stand on.
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_seam]

LOOKS = 50


def _probe_threads() -> int:
    return sum(t.name == "compiler_collectives-probe" and t.is_alive() for t in threading.enumerate())


def looks_at_a_live_peer_then_destroys(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import compiler_collectives as cc
    from compiler_collectives.transport import probes

    cc.enable()  # the c10d seam: destroy_process_group runs our GROUP_ENDING moment
    pg = dist.group.WORLD
    out: dict = {}
    if rank == 1:
        # Alive, its end of the connection open, until rank 0 looked and destroyed its group.
        stay_until(1, 30.0, name="destroyed")
        dist.destroy_process_group()
        return out
    looks = [probes.broken_connection(pg, 1) for _ in range(LOOKS)]
    out["looks"] = sorted({str(v) for v in looks})
    out["pending"] = probes.pending_probes()
    out["threads"] = _probe_threads()
    started = time.monotonic()
    dist.destroy_process_group()
    out["destroy_s"] = time.monotonic() - started
    deadline = time.monotonic() + 1.0
    while _probe_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    out["pending_after"] = probes.pending_probes()
    out["threads_after"] = _probe_threads()  # a receive still pending would hold the group's connections
    release("destroyed")
    return out


@pytest.mark.timeout(60)
def test_looking_at_a_live_peer_s_connection_keeps_one_receive_pending_and_a_destroy_ends_it():
    looker = run_ranks(looks_at_a_live_peer_then_destroys, 2, timeout=45).results[0]
    assert looker["looks"] == ["None"], looker  # intact every time
    assert looker["pending"] == 1 and looker["threads"] == 1, looker  # one for the 50 looks
    assert looker["pending_after"] == 0 and looker["threads_after"] == 0, looker
    assert looker["destroy_s"] < 2.0, looker


def looks_until_the_peer_is_gone(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from compiler_collectives.transport import probes

    pg = dist.group.WORLD
    if rank == 1:
        stay_until(1, 30.0)
        os._exit(0)  # its host's kernel closes its connections
    assert probes.broken_connection(pg, 1) is None  # the receive is pending from here on
    release()
    started = time.monotonic()
    why = None
    while why is None and time.monotonic() - started < 10.0:
        time.sleep(0.05)
        why = probes.broken_connection(pg, 1)
    return {"why": why, "seconds": time.monotonic() - started, "pending": probes.pending_probes()}


@pytest.mark.timeout(60)
def test_the_pending_receive_sees_the_peer_s_connection_break_within_a_moment():
    looker = run_ranks(looks_until_the_peer_is_gone, 2, timeout=45, check=False).results[0]
    assert looker["why"] is not None and looker["why"].startswith("gloo: Connection closed by peer"), looker
    assert looker["seconds"] < 3.0, looker
    assert looker["pending"] == 0, looker


def a_pending_receive_outlives_its_connection_until_a_wait(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from compiler_collectives.transport import probes
    from compiler_collectives.transport.gloo import is_connection_failure, started

    pg = dist.group.WORLD
    if rank == 1:
        stay_until(1, 30.0)
        os._exit(0)  # its host's kernel closes its connections
    work = started(pg.recv, [torch.empty(0, dtype=torch.uint8)], 1, probes.PROBE_TAG)
    out: dict = {}
    try:
        work.get_future()
        out["future"] = "a future"
    except RuntimeError as e:
        out["future"] = str(e)
    release()
    started_at = time.monotonic()
    while not probes.broken_peers(pg) and time.monotonic() - started_at < 10.0:
        time.sleep(0.05)  # a receive started on the broken connection raises: it broke
    time.sleep(0.5)
    exception = getattr(work, "exception", lambda: None)  # deprecated in torch 2.13, maybe gone later
    out["completed"], out["exception"] = work.is_completed(), exception()
    waited = time.monotonic()
    try:
        work.wait()
        out["wait"] = "returned"
    except RuntimeError as e:
        out["wait"] = f"broken: {probes.gloo_words(e)}" if is_connection_failure(e) else probes.gloo_words(e)
    out["wait_s"] = time.monotonic() - waited
    return out


@pytest.mark.timeout(60)
def test_gloo_tells_the_end_of_a_pending_receive_only_to_a_wait_on_it():
    # Why each pending probe has a thread of its own waiting on it: a gloo receive has no future,
    # and says nothing of its connection's end (is_completed, exception) until a wait, which then
    # raises at once. A timed wait that expires would close every connection of the group, and
    # a receive from any peer (recv_anysource) is not ended by one peer's connection breaking.
    looker = run_ranks(a_pending_receive_outlives_its_connection_until_a_wait, 2, timeout=45, check=False).results[0]
    assert "not implemented" in looker["future"], looker
    assert looker["completed"] is False and looker["exception"] is None, looker
    assert looker["wait"].startswith("broken: ") and looker["wait_s"] < 0.5, looker
