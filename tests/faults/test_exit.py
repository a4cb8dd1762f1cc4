"""Processes that use the package exit cleanly: their own exit code, never an abort (issue 11).

These ranks start with ``spawn``, so each one ends in a real interpreter exit
(atexit handlers, finalization, C++ static destructors), as under torchrun;
forkserver children leave through ``os._exit`` and would hide an abort there.
The harness fails any rank a signal ends.

The abort these tests pin: our heartbeat thread (a daemon thread) inside a
c10d store call while Python finalizes is killed as it takes the GIL back,
inside a C++ destructor, and the process dies of SIGABRT ("terminate called
without an active exception"). A short heartbeat makes that race likely; at
exit the package now stops and joins its thread and destroys its groups first,
which each rank checks from an exit handler of its own (``LEFT_RUNNING``).
"""

from __future__ import annotations

import atexit

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks
from tests.rank_env import rank_env
from tests.rankside import nothing_of_ours_left_when_python_finalizes

# Every test here starts rank processes or subprocesses: the multi-process tier.
pytestmark = [pytest.mark.multiprocess, pytest.mark.torch_seam]

# A heartbeat every 0.5 ms keeps the thread inside store calls much of the time. One compile
# thread: inductor's pool of compile workers (two fresh interpreters per rank) would start at the
# first compile and be shut down at exit, which beside other tests took past the harness's grace
# for an exit; what these tests pin is our own exit path.
ENV = rank_env(heartbeat_s=0.0005, timeout_s=10, pg_timeout_s=120, extra={"TORCHINDUCTOR_COMPILE_THREADS": "1"})


class Small(torch.nn.Module):
    """Two layers, matmuls only forward and backward: inductor builds no C++ kernel for it (no bias,
    whose gradient is a reduction; no activation). What is tested is the exit, not the kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16, bias=False)
        self.b = torch.nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def ddp_inductor_job_where_one_rank_fails_with_our_error(rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import compiler_collectives as cc

    atexit.register(nothing_of_ours_left_when_python_finalizes)
    cc.enable(guards=True)
    torch.manual_seed(0)
    model = torch.compile(DDP(Small()))  # inductor
    for step in range(2):
        model(torch.randn(4 + step, 8)).square().mean().backward()
    if rank == 1:
        try:
            model(torch.randn(5, 8))  # an extra step rank 0 never takes: our guard collective times out
        except cc.CollectiveError as e:
            return {"raised": type(e).__name__}
        return {"raised": None}
    try:
        dist.all_reduce(torch.ones(1))  # the user's own collective: rank 1 never joins, then leaves
    except RuntimeError as e:
        return {"raised": type(e).__name__, "ours": isinstance(e, cc.CollectiveError)}
    return {"raised": None}


@pytest.mark.timeout(480)
def test_a_ddp_inductor_job_where_one_rank_fails_with_our_error_exits_cleanly_on_every_rank():
    outcome = run_ranks(
        ddp_inductor_job_where_one_rank_fails_with_our_error, 2, env=ENV, start_method="spawn", store="tcp", timeout=420
    )
    failed, survivor = outcome.results[1], outcome.results[0]
    assert failed["raised"] == "CollectiveDesyncError", failed  # rank 0 is alive, in its all-reduce
    assert survivor["raised"] in ("RuntimeError", "DistBackendError") and not survivor["ours"], survivor
    # Not -6 (SIGABRT), not LEFT_RUNNING: the harness fails on either.
    assert outcome.exitcodes == [0, 0], outcome


def short_job(rank: int, world: int) -> int:
    import compiler_collectives as cc

    atexit.register(nothing_of_ours_left_when_python_finalizes)
    cc.enable(guards=True)
    f = torch.compile(lambda x: x * 2, backend="eager")
    for _ in range(3):
        f(torch.ones(3))
    return cc.stats()["guard_collectives"]


@pytest.mark.timeout(420)
def test_a_job_that_ends_normally_exits_with_code_zero_on_every_rank():
    # One job, two exits: the race aborts an exit only now and then, but a thread or group of
    # ours left at exit fails every exit through LEFT_RUNNING (and so does the job above).
    outcome = run_ranks(short_job, 2, env=ENV, start_method="spawn", store="tcp", timeout=180)
    assert outcome.results == [2, 2]
    assert outcome.exitcodes == [0, 0], outcome
