"""The shared-memory failure word (issue 22): it says which rank published and whether that rank
left the job or failed, and a rank waiting in a local exchange reads a left word as "left" and a
failure word as a failure, at once. Two local ranks of one segment, both in this process. How a
peer's report reaches live ranks: ``tests/ranks/test_reports.py``.
"""

from __future__ import annotations

import os
import time

import pytest


def test_the_failure_word_says_which_rank_published_and_whether_it_left_or_failed():
    from compiler_collectives.transport import shm

    assert shm.read_failure_word(0) is None  # nobody published
    for rank in (0, 1, 7, 65535, (1 << 20) - 1):
        for left in (False, True):
            word = shm.failure_word(rank, left)
            assert word != 0 and word < 1 << 63, word
            assert shm.read_failure_word(word) == (rank, left)


def test_a_waiting_rank_reads_a_left_word_as_left_and_a_failure_word_as_a_failure():
    """Two local ranks of one segment, both in this process: rank 1 publishes, rank 0 waits."""
    from compiler_collectives.errors import PeerFailureError
    from compiler_collectives.transport import segment as segments
    from compiler_collectives.transport import shm

    if segments.unavailable_reason() is not None:
        pytest.skip(segments.unavailable_reason())
    for left in (True, False):
        token = int.from_bytes(os.urandom(8), "little") >> 1
        path = segments.segment_path(os.getpid(), token)
        segment = segments.Segment.create(path, 2, token, 0)
        try:
            segment.register(1, 1)
            arrival = shm.Arrival(rank=0, local_ranks=(0, 1))
            waiter, leaver = (shm.LocalExchange(segment, i, arrival, 5.0, lambda n: f"guard call #{n}") for i in (0, 1))
            leaver.publish_failure(1, left=left)
            start = time.monotonic()
            with pytest.raises(PeerFailureError) as info:
                waiter.wait(shm.LocalExchange.slot_word(1) + 1, shm.tag(1), 1)
            assert time.monotonic() - start < 1.0
            error = info.value
            assert error.ranks == (1,) and error.reported_by == (1,) and error.left is left, vars(error)
            if left:
                assert "rank 1 left the job" in str(error) and "reported a failure" not in str(error)
            else:
                assert "rank 1 reported a failure" in str(error) and "left" not in str(error)
        finally:
            segment.unlink_name()
