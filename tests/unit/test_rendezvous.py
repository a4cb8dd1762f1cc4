"""Our rendezvous before a group: it names who never came, and stops when this rank hears of a failure.

In-process, on a ``HashStore``: the subject is the wait itself, not the ranks.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from compiler_collectives.store import rendezvous


def test_every_peer_arriving_ends_the_wait_with_no_one_absent():
    store = dist.HashStore()
    other = threading.Thread(target=rendezvous.meet, args=(store, 1, [0, 1], "g", 10.0))
    other.start()
    assert rendezvous.meet(store, 0, [0, 1], "g", 10.0) == []
    other.join(10)


def test_a_peer_that_never_comes_is_named_at_the_timeout():
    store = dist.HashStore()
    start = time.monotonic()
    assert rendezvous.meet(store, 0, [0, 1, 2], "g", 0.6) == [1, 2]
    assert time.monotonic() - start < 5


def test_a_failure_heard_while_waiting_ends_the_wait_at_once_not_at_the_timeout():
    """A peer that failed before it came reports it; the heartbeat thread hears it and the
    waiting rank stops then (the scope-overlap test met the 60 s timeout before this)."""
    store = dist.HashStore()
    heard: list[BaseException] = []
    threading.Timer(0.5, lambda: heard.append(RuntimeError("rank 2 reported a failure"))).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 2 reported"):
        rendezvous.meet(store, 0, [0, 1], "g", 60.0, heard=lambda: heard[0] if heard else None)
    assert time.monotonic() - start < 5
