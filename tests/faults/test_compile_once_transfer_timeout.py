"""A transfer whose peer never takes its part (compile once's artifact transfer,
``agreements.once.transfer``) ends at gloo's timeout, the compile group's
COMPILER_COLLECTIVES_TIMEOUT: it raises ``CollectiveTimeoutError`` naming that peer as stuck,
never ``PeerFailureError`` calling it crashed (its connection never broke).

Two real gloo ranks: rank 0 sends a graph's artifact to rank 1, which is alive and elsewhere.
"""

from __future__ import annotations

import pytest

from tests.harness import release, run_ranks, stay_until
from tests.rank_env import rank_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

TIMEOUT_S = 4


def source_whose_receiver_is_elsewhere(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from compiler_collectives.agreements.once import transfer
    from compiler_collectives.agreements.wire.once import ManifestFile, Result

    if rank == 1:
        stay_until(1, 60.0)  # alive, never in the transfer, until rank 0 has its error
        return {}
    bundle = bytes(range(256)) * 64
    result = Result("compiled", None, [ManifestFile("a", "0" * 64, len(bundle))], [], 4096)
    result.chunks = transfer.chunk_digests(bundle, 4096)
    link = transfer.Link(dist.group.WORLD, (0, 1), 0, 7, lambda: "rank 0", lambda error: error)
    try:
        transfer.send(link, bundle, result, transfer.Route(transfer.RECEIVE, None, (1,), receivers=(1,)))
        return {"type": None}
    except Exception as e:  # noqa: BLE001 - the test asserts on what rank 0 raised
        return {"type": type(e).__name__, "message": str(e), "ranks": getattr(e, "ranks", None)}
    finally:
        release()


@pytest.mark.timeout(90)
def test_a_transfer_whose_receiver_never_takes_its_part_times_out_naming_it_stuck_not_crashed():
    env = rank_env(timeout_s=TIMEOUT_S, pg_timeout_s=TIMEOUT_S)
    source = run_ranks(source_whose_receiver_is_elsewhere, 2, env=env, timeout=60).results[0]
    assert source["type"] == "CollectiveTimeoutError" and source["ranks"] == (1,), source
    assert f"rank 1 (its child in the artifact's tree) did not take its part within {TIMEOUT_S}s" in source["message"]
