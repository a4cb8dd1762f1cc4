"""Compile once's current graph, without processes: it belongs to the Dynamo compile whose scope
is open (``agreements.compile_scope``), not to the thread. A graph's driver is current in its
compile's scope from ``begin`` until its compile ends (or ours failed in it: ``abandon``); a
compile nested in it (the FX level) is current until it ends, then the outer one is again;
another compile's scope, and code outside any compile, see no graph."""

from __future__ import annotations

from compiler_collectives.agreements import compile_scope, once
from compiler_collectives.observations import FrameId
from tests.fixtures import NoCache

FRAME = FrameId("f", "a.py", 1)


def test_a_graph_is_current_in_its_compile_s_scope_until_it_is_abandoned() -> None:
    with compile_scope.opened() as scope:
        assert once.current() is None
        graph = once.begin(FRAME, NoCache())
        assert once.current() is graph and scope.once_graph is graph
        graph.abandon()
        assert once.current() is None
    assert once.current() is None


def test_a_graph_is_current_until_its_compile_ends() -> None:
    with compile_scope.opened():
        graph = once.begin(FRAME, NoCache())
        graph.compile_ended(None)
        assert once.current() is None and graph.record is not None


def test_a_nested_compile_s_graph_is_current_until_it_ends_then_the_outer_one_is_again() -> None:
    with compile_scope.opened():
        outer = once.begin(FRAME, NoCache(), "aot")
        inner = once.begin(FRAME, NoCache(), "fx")
        assert once.current() is inner and inner.outer is outer
        inner.abandon()
        assert once.current() is outer
        outer.abandon()
        assert once.current() is None


def test_another_compile_s_scope_and_code_outside_any_compile_see_no_graph() -> None:
    with compile_scope.opened():
        graph = once.begin(FRAME, NoCache())
        with compile_scope.opened():
            assert once.current() is None
        assert once.current() is graph
        graph.abandon()


def test_a_graph_begun_outside_any_compile_is_nobody_s_current_graph() -> None:
    graph = once.begin(FRAME, NoCache())
    assert once.current() is None and graph.outer is None
    graph.abandon()
    assert once.current() is None
