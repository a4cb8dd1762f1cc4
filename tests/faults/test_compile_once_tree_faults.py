"""Compile once across cache dirs (issue 30): one rank per dir receives the artifact, the others
of the dir read its install, and the receivers form a tree rooted at the source (fan-out
``COMPILER_COLLECTIVES_ONCE_FANOUT``, 2), forwarding each piece once its digest matched.

Eight real ranks, four cache dirs of two ranks each (as four hosts would have), one inductor
training step. Rank 1 compiles (the first graph's turn among cold ranks), so rank 0 reads in
place; ranks 2, 4 and 6 receive for their dirs and ranks 3, 5 and 7 read their installs. The
tree: rank 1 sends to 2 and 4; rank 2 forwards to 6. Pieces of 4 KiB make an artifact of many
pieces, so a forwarder passes some on before the last arrives. (The copies and bytes of the
fault-free case are asserted by the four-host test in ``tests/ranks/test_compile_once.py``.)

The step is a matmul (no C++ kernel to build, forward or backward): the tree's faults are the
subject, not what the artifact holds. Its cache entries alone come to several pieces of 4 KiB
(asserted where the job finishes).

Who is blamed for bad bytes, and the source's second copy, take four ranks in four dirs: rank 1
compiles and sends to ranks 0 and 2; rank 0 forwards to rank 3.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.fixtures import cache_per_rank
from tests.harness import release, run_ranks, stay_until
from tests.rank_env import rank_env
from tests.ranks.test_compile_once import _step  # a matmul: no C++ kernel, forward or backward

# Release-independent: the tree's transfer and its liveness are ours; an artifact over gloo and
# gloo's broken connection are pinned by test_compile_once.py and the host faults' seam test.
pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

WORLD, PER_DIR = 8, 2
SOURCE, FORWARDER, GRANDCHILD = 1, 2, 6
CHUNK_BYTES = 4096
ENV = rank_env(timeout_s=60, once_chunk_bytes=CHUNK_BYTES, heartbeat_s=0.5, inductor_single_thread=True)


def _break(rank: int, fault: str | tuple[str, int, int, bool] | None, killed_at: str) -> None:
    """The forwarder dies once it holds its first piece; or rank ``who`` flips a byte of the second
    piece it sends rank ``to`` in the tree (``("alter", who, to, copy_too)``), and with ``copy_too``
    of the copy it sends it directly."""
    if fault is None:
        return
    from compiler_collectives.agreements.once import transfer

    if fault == "kill" and rank == FORWARDER:
        view = transfer.tensor_view

        def view_then_die(t: torch.Tensor) -> memoryview:
            with open(killed_at, "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
            return view(t)

        transfer.tensor_view = view_then_die
    elif isinstance(fault, tuple) and rank == fault[1]:
        _, _, to, copy_too = fault
        send = transfer.start_send

        def send_altered(pg: object, piece: torch.Tensor, dst: int, tag: int) -> object:
            tree_piece = tag & transfer.TAG_BASE and tag & 0xFFFFF == 1
            second_copy = not tag & transfer.TAG_BASE and piece.numel() > 8  # not a verdict or a word
            if dst == to and (tree_piece or (copy_too and second_copy)):
                piece = piece.clone()
                piece[len(piece) // 2] ^= 0xFF
            return send(pg, piece, dst, tag)

        transfer.start_send = send_altered


def job(rank: int, world: int, fault: str | None, killed_at: str) -> dict:
    import compiler_collectives as cc

    cc.enable()
    _break(rank, fault, killed_at)
    x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / 10 - 1 + rank
    w0 = torch.linspace(-1, 1, 16).reshape(4, 4)
    w_ref = w0.clone().requires_grad_(True)
    _step(x, w_ref).sum().backward()
    w = w0.clone().requires_grad_(True)
    out: dict = {"error": None}
    try:
        torch.compile(_step, backend="inductor")(x, w).sum().backward()
        out["right"] = torch.allclose(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
    except Exception as e:  # noqa: BLE001 - the test asserts on what each rank raised
        out["error"] = {"type": type(e).__name__, "message": str(e), "at": time.time()}
    stats = cc.stats()
    out["stats"] = {k: v for k, v in stats.items() if k.startswith("once_")}
    out["records"] = stats["compile_once"]
    # No rank ends before every living rank has its outcome: a rank that had its error and
    # exited would be named, as gone, by a rank still waiting on it (a loaded machine).
    release("outcome")
    stay_until(world - (fault == "kill"), 60, "outcome")
    return out


def _run(tmp_path, fault=None, world: int = WORLD, per_dir: int = PER_DIR, **kw):
    dirs = cache_per_rank(tmp_path, world, per_dir=per_dir, name="dir")
    killed_at = str(tmp_path / "killed_at")
    return run_ranks(job, world, args=(fault, killed_at), env=ENV, rank_env=dirs, timeout=300, **kw)


@pytest.mark.timeout(300)
def test_a_forwarder_killed_mid_transfer_is_named_by_every_rank_of_its_subtree_within_seconds(tmp_path):
    outcome = _run(tmp_path, "kill", check=False, expect_signals={FORWARDER: signal.SIGKILL})
    killed_at = float((tmp_path / "killed_at").read_text())
    # Its child (rank 6), its dir's reader (rank 3) and rank 6's reader (rank 7): each stops, naming
    # it, within seconds (a hang would end at the 60 s collective timeout, or the compile timeout's hour).
    for rank in (3, GRANDCHILD, 7):
        result = outcome.results[rank]
        assert result is not None and result["error"] is not None, (rank, outcome)
        assert result["error"]["type"] == "PeerFailureError", (rank, result)
        assert f"rank {FORWARDER}" in result["error"]["message"], (rank, result)
        assert result["error"]["at"] - killed_at < 20, (rank, result["error"]["at"] - killed_at)
    assert all(r is None or r["error"] is not None for r in outcome.results)  # nobody trains on alone


@pytest.mark.timeout(400)
def test_a_receiver_refusing_what_its_forwarder_altered_names_it_and_loads_the_sources_own_copy(tmp_path):
    results = _run(tmp_path, ("alter", FORWARDER, GRANDCHILD, False)).results
    assert all(r["error"] is None and r["right"] for r in results), results
    # Rank 6 names the forwarder, then loads rank 1's copy; compiling nothing itself, so neither
    # does its dir's reader, rank 7, which reads its install.
    assert [results[r]["records"][-1]["state"] for r in range(WORLD)] == ["loaded", "compiled"] + ["loaded"] * 6
    why = results[GRANDCHILD]["records"][-1]["why"]
    assert f"rank {FORWARDER} sent them altered" in why and "SHA-256" in why, why
    assert f"loaded rank {SOURCE}'s own copy, sent to this rank directly" in why, why
    assert results[GRANDCHILD]["stats"]["once_refetched"] == 1, results[GRANDCHILD]["stats"]
    assert results[SOURCE]["stats"]["once_copies_sent"] == 3, results[SOURCE]["stats"]  # to 2, 4, then 6
    # An artifact of several pieces: the forwarder passed some on before the last arrived.
    assert results[4]["stats"]["once_bytes_received"] > 2 * CHUNK_BYTES, results[4]["stats"]


@pytest.mark.timeout(300)
def test_bytes_the_source_altered_are_blamed_on_it_below_the_honest_forwarder_that_refused_them(tmp_path):
    # Rank 1 alters what it sends rank 0, in the tree and in its second copy: rank 0 refuses both
    # and compiles the graph itself; rank 3, below it, names rank 1 (not rank 0, which forwarded
    # zeros) and loads rank 1's copy.
    results = _run(tmp_path, ("alter", 1, 0, True), world=4, per_dir=1).results
    assert all(r["error"] is None and r["right"] for r in results), results
    assert [results[r]["records"][-1]["state"] for r in range(4)] == [
        "compiled locally",
        "compiled",
        "loaded",
        "loaded",
    ]
    refused = results[0]["records"][-1]["why"]
    assert "rank 1 sent them altered" in refused and "failed its check too" in refused, refused
    below = results[3]["records"][-1]["why"]
    assert "rank 1 sent them altered" in below and "rank 0 sent them altered" not in below, below
    assert "rank 0, which checked them, forwarded zeros" in below, below
    assert "loaded rank 1's own copy" in below, below
