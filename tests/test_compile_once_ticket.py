"""Compile once's current ticket, without processes: it belongs to the Dynamo compile whose scope
is open (``agreements.compile_scope``), not to the thread. A ticket is current in its compile's
scope from ``begin`` to ``finish`` or ``abandon``; a compile nested in it (the FX level) is
current until it ends, then the outer one is again; another compile's scope, and code outside
any compile, see no ticket."""

from __future__ import annotations

from compiler_collectives.agreements import compile_scope, once
from compiler_collectives.observations import FrameId
from tests.fixtures import NoCache

FRAME = FrameId("f", "a.py", 1)


def test_a_ticket_is_current_in_its_compile_s_scope_until_it_is_abandoned() -> None:
    with compile_scope.opened() as scope:
        assert once.current() is None
        ticket = once.begin(FRAME, NoCache())
        assert once.current() is ticket and scope.once_ticket is ticket
        once.abandon(ticket)
        assert once.current() is None
    assert once.current() is None


def test_a_nested_compile_s_ticket_is_current_until_it_ends_then_the_outer_one_is_again() -> None:
    with compile_scope.opened():
        outer = once.begin(FRAME, NoCache(), "aot")
        inner = once.begin(FRAME, NoCache(), "fx")
        assert once.current() is inner and inner.outer is outer
        once.abandon(inner)
        assert once.current() is outer
        once.abandon(outer)
        assert once.current() is None


def test_another_compile_s_scope_and_code_outside_any_compile_see_no_ticket() -> None:
    with compile_scope.opened():
        ticket = once.begin(FRAME, NoCache())
        with compile_scope.opened():  # a Dynamo compile nested in this one: its own scope
            assert once.current() is None
        assert once.current() is ticket
        once.abandon(ticket)


def test_a_ticket_begun_outside_any_compile_is_nobody_s_current_ticket() -> None:
    ticket = once.begin(FRAME, NoCache())
    assert once.current() is None and ticket.outer is None
    once.abandon(ticket)
    assert once.current() is None
