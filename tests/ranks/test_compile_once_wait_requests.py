"""A wait blocks; it does not poll (issue 37 item 2, issue 43): a rank waiting for a graph that
another rank compiles asks the c10d store at most 2 requests for that graph beyond its
heartbeat, however long the compile.

Two ranks, each its own "host" (``GROUP_RANK``) with a cache dir each, on a TCPStore hosted by
rank 0 (as under torchrun), test_compile_once's one training step (one graph under compile
once). Rank 1's first inductor compile takes ``seconds`` longer (a sleep: its heartbeat beats,
and it costs no CPU); rank 1 compiles the graph for rank 0, which waits for it inside compile
once. Rank 0's store requests (``stats()["store_requests"]``) are counted from after its
generation's groups were made (a cost of the generation: the setup check, the rendezvous, the
wait's store connection) to the end of the step, each count taken just after a heartbeat, and
its heartbeat's taken out: two a beat (its record's set, and one read of the failure count and
of the records of the peers it waits for).
"""

from __future__ import annotations

import functools
import time

import pytest

from tests.fixtures import cache_per_rank
from tests.harness import run_ranks
from tests.ranks.test_compile_once import ENV, _assert_trained_right, _states, job
from tests.ranks.test_compile_once_caches import COMPILING_RANK, WAITING_RANK
from tests.rankside import patch

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.torch_seam,
]

MAX_PER_GRAPH = 2  # the target: the wait's own requests, whatever the compile's length
BEAT_REQUESTS = 2  # a heartbeat: the record's set, the read of the failure count (and watched records)


def _stall_first_compile(seconds: float) -> None:
    """This rank's first inductor compile (whatever compile once planned) sleeps ``seconds``."""
    import torch._inductor.compile_fx as cfx

    passes = cfx._recursive_post_grad_passes
    fired: list[bool] = []

    @functools.wraps(passes)
    def stalled(*args: object, **kwargs: object) -> object:
        if not fired:
            fired.append(True)
            time.sleep(seconds)
        return passes(*args, **kwargs)

    patch(cfx, "_recursive_post_grad_passes", stalled)


def _just_after_a_heartbeat() -> tuple[int, int]:
    """(this rank's store requests, its heartbeats) once a beat began and had time to end."""
    import compiler_collectives as cc
    from compiler_collectives.transport import groups

    beats = groups.side.beats
    give_up = time.monotonic() + 10.0
    while groups.side.beats == beats and time.monotonic() < give_up:
        time.sleep(0.01)
    time.sleep(0.2)
    return cc.stats()["store_requests"], groups.side.beats


def job_counting_store_requests(rank: int, world: int, case: dict) -> dict:
    import compiler_collectives as cc
    from compiler_collectives.transport import groups

    cc.enable()
    groups.compile_pg()  # the generation's groups, on both ranks (so in the job's own compile)
    if rank == COMPILING_RANK:
        _stall_first_compile(case["seconds"])
    requests, beats = _just_after_a_heartbeat()
    started = time.monotonic()
    out = job(rank, world, case)
    out["job_s"] = time.monotonic() - started
    requests_after, beats_after = _just_after_a_heartbeat()
    out["heartbeat_requests"] = BEAT_REQUESTS * (beats_after - beats)
    out["store_requests"] = requests_after - requests
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "seconds",
    [
        20,
        # The same store waits for three times as long: our side of the seam the 20 s case
        # pins on every release (tests/tiers.py), and a minute of a worker's wall time.
        pytest.param(60, marks=pytest.mark.release_independent),
    ],
)
def test_a_rank_waiting_for_a_compile_asks_the_store_at_most_2_requests_per_graph_beyond_its_heartbeat(
    tmp_path, seconds
):
    hosts = {r: {**dirs, "GROUP_RANK": str(r)} for r, dirs in cache_per_rank(tmp_path, 2, name="host").items()}
    results = run_ranks(
        job_counting_store_requests,
        2,
        args=({"seconds": seconds},),
        env=ENV,
        rank_env=hosts,
        store="tcp",
        timeout=seconds + 150,
    ).results
    _assert_trained_right(results)
    assert _states(results) == ["loaded", "compiled"]
    waiting = results[WAITING_RANK]
    assert waiting["job_s"] >= seconds, waiting["job_s"]  # it did wait for rank 1's compile
    graphs = len(waiting["records"])
    beyond = waiting["store_requests"] - waiting["heartbeat_requests"]
    assert beyond <= MAX_PER_GRAPH * graphs, (
        f"a {seconds} s compile: {beyond} store requests beyond the heartbeat for {graphs} graph(s) "
        f"({waiting['store_requests']} in {waiting['job_s']:.0f} s, {waiting['heartbeat_requests']} of them heartbeats)"
    )
