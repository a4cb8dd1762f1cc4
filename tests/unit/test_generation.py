"""The agreements' state of a generation is one object, replaced whole when a new generation starts.

``agreements/generation.py`` holds what the agreements keep from one exchange to the next (the
compiler collective's sequence number and last frame, the audit's sequence number, compile once's
graph number, known cache dirs and ranks by host). Each moment that ends a generation (the
runtime's ``reset()``, the end of the default group, a forked child) binds a fresh instance: the
old one is not zeroed in place, and what happens after the moment never touches it. The other
moments keep it. The public readers (``compiler.progress``, ``audit_verdict.sequence``) read the
current one.
"""

from __future__ import annotations

import pytest

from compiler_collectives import runtime
from compiler_collectives.agreements import audit_verdict, compiler, generation
from compiler_collectives.agreements.once import keys

ENDS_A_GENERATION = {
    "reset()": runtime.reset,
    "the end of the default group": runtime.default_group_destroyed,
    "a forked child": runtime.after_fork_in_child,
}
KEEPS_THE_GENERATION = {
    "torch.compiler.reset()": runtime.torch_reset,
    "reset_stats()": runtime.reset_stats,
}


@pytest.fixture(autouse=True)
def _a_fresh_generation_after():
    yield
    runtime.reset()  # the tests after these find no numbers of theirs


def _a_generation_that_exchanged() -> generation.Generation:
    """The current generation, as after a few exchanges of each agreement."""
    gen = generation.current()
    gen.compiler_seq, gen.compiler_frame = 3, "f at model.py:10"
    gen.audit_seq = 2
    gen.once_seq = 5
    gen.once_known = keys.Known((0, 1), {0: ("dir-a", 1 << 20), 1: ("dir-b", 1 << 20)}, b"digest")
    return gen


@pytest.mark.parametrize("moment", ENDS_A_GENERATION.values(), ids=ENDS_A_GENERATION.keys())
def test_a_new_generation_gets_a_fresh_object_and_the_old_one_is_left_as_it_was(moment):
    old = _a_generation_that_exchanged()
    before = (old.compiler_seq, old.compiler_frame, old.audit_seq, old.once_seq, old.once_known)

    moment()

    new = generation.current()
    assert new is not old
    assert runtime.current().agreements is new  # the runtime reads the current one, never a kept one
    assert new == generation.Generation()  # every sequence from 0, no frame, no known dirs, no host tree
    assert compiler.progress() == {"compiler_seq": 0, "frame": None}
    assert audit_verdict.sequence() == 0
    # The new generation's exchanges count on the new object; the old one keeps its numbers.
    new.compiler_seq += 1
    new.audit_seq += 1
    new.once_seq += 1
    assert (compiler.progress()["compiler_seq"], audit_verdict.sequence()) == (1, 1)
    assert (old.compiler_seq, old.compiler_frame, old.audit_seq, old.once_seq, old.once_known) == before


@pytest.mark.parametrize("moment", KEEPS_THE_GENERATION.values(), ids=KEEPS_THE_GENERATION.keys())
def test_a_moment_that_ends_no_generation_keeps_its_object(moment):
    gen = _a_generation_that_exchanged()

    moment()

    assert generation.current() is gen
    assert compiler.progress() == {"compiler_seq": 3, "frame": "f at model.py:10"}
    assert audit_verdict.sequence() == 2
