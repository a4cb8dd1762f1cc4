"""Compile once's machine (``agreements/once/machine.py``), without processes: every order of
events torch can produce for one graph on every rank, and for graphs nested in another's
compile (an FX fallback inside an AOT graph), ends.

The ranks are simulated in lockstep over the pure machine: each rank's torch (drawn by
hypothesis: whether the lookup runs, computes a key, hits, raises; whether the compile raises;
a noise of callbacks from unrelated compiles) feeds its machine; the actions are answered as
the driver's ports would answer them, from the same world (the plans from the real ``decide``
over the offers the ranks sent; a result, a report, a post exactly when some rank made it; a
port that fails where hypothesis says). A collective is answered when every rank still in the
graph is at the same one; a wait, when its posters posted; a rank whose peer left the graph
without what it waits for fails there, as the real wait or exchange does.

Properties: no rank waits forever and no two ranks are ever at different collectives; each
rank ends in ``DONE`` with exactly one record (``Keep``), made before its error is raised; an
error leaves only as the machine's ``Raise`` or a port's own (``Failed``), after the record,
and nothing runs after it; only the last action of a list is answered; every move is one
``TRANSITIONS`` lists; with no fault drawn, nobody raises and every loader that hit ran its
source's artifact.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Generator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import Phase as HypothesisPhase
from hypothesis import strategies as st

from compiler_collectives.agreements.once import events as ev
from compiler_collectives.agreements.once import machine
from compiler_collectives.agreements.once.machine import Phase, State, advance
from compiler_collectives.agreements.once.plan import COMPILE, LOAD, LOCAL, SERVE, decide
from compiler_collectives.agreements.wire.once import Offer, Result

COLLECTIVES = (ev.SettleKeys, ev.ExchangeResults, ev.Report)


class PortFailed(Exception):
    """A port's own error (an exchange, a wait, a post that failed)."""


@dataclasses.dataclass(frozen=True)
class Torch:
    """What one rank's torch does for the graph."""

    key: str | None  # None: the lookup computes no key
    holds: bool
    key_seam: bool  # the key seam fires (else the lookup ends without a key)
    hit: bool
    lookup_raises: bool
    compile_raises: bool
    refuses: bool  # its install refuses the artifact
    gathering_fails: bool  # as a source, its artifact cannot be gathered
    fail_at: int | None  # the n-th answered action of this rank's fails (a port's error)
    noise: tuple[int, ...]  # positions of unrelated callbacks in its event stream


def torches(ranks: int) -> st.SearchStrategy[tuple[Torch, ...]]:
    one = st.builds(
        Torch,
        key=st.sampled_from(["k1", "k1", "k1", "k2", None]),
        holds=st.booleans(),
        key_seam=st.sampled_from([True, True, False]),
        hit=st.sampled_from([True, True, False]),
        lookup_raises=st.sampled_from([False, False, False, True]),
        compile_raises=st.sampled_from([False, False, False, True]),
        refuses=st.sampled_from([False, False, True]),
        gathering_fails=st.sampled_from([False, False, False, True]),
        fail_at=st.none() | st.none() | st.integers(0, 8),
        noise=st.lists(st.integers(0, 6), max_size=3).map(tuple),
    )
    return st.tuples(*[one] * ranks)


@dataclasses.dataclass
class Rank:
    """One graph's machine on one rank (``gid``: 0 the outer graph, k its k-th nested one)."""

    rank: int
    torch: Torch
    gid: int = 0
    state: State = dataclasses.field(default_factory=State)
    actions: list[Any] = dataclasses.field(default_factory=list)  # every action, in order
    lists: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    moves: list[tuple[Phase, str, Phase]] = dataclasses.field(default_factory=list)
    raised: str | None = None  # "raise" (the machine's) or "failed" (a port's)
    answered: int = 0
    bypass: bool = False
    inner: list[Rank] = dataclasses.field(default_factory=list)  # the graphs nested in its compile


NOISE = (ev.LookupBegan(), ev.KeyComputed("other"), ev.LookupEnded(True), ev.LookupEnded(False, raised=True))
COMPILE_BODY = object()  # where the compile runs, between the lookup and the compile's end


def torch_events(r: Rank, lookup: bool) -> Generator[Any, None, None]:
    """One rank's torch for the graph: the events its seams send, in the order torch calls them
    (``COMPILE_BODY``: where compiles nested in this one run)."""
    t = r.torch
    if lookup:
        yield ev.LookupBegan()
        if t.key_seam and r.raised is None:
            yield ev.KeyComputed(t.key, None if t.key else "not cacheable")
        if r.raised is None:
            hit = t.hit and not r.bypass and not t.lookup_raises
            yield ev.LookupEnded(None if r.bypass else hit, raised=t.lookup_raises)
    if r.raised is None:
        yield COMPILE_BODY
    # Callbacks of other compiles that reach this graph's seams after its own lookup (a graph
    # without a lookup is never sent lookup callbacks: the seams route by level).
    for i in t.noise if lookup else ():
        if r.raised is None:
            yield NOISE[i % len(NOISE)]
    if r.raised is not None:
        yield ev.Abandoned()  # ours left the seam: torch's compile raises it
    else:
        yield ev.CompileEnded("RuntimeError: boom" if t.compile_raises else None)


def feed(r: Rank, event: ev.Event) -> Generator[tuple[Rank, Any], Any, None]:
    """Feed one event; run the actions as the driver does, yielding each to the world."""
    before = r.state.phase
    r.state, actions = advance(r.state, event)
    _moved(r, before, event)
    queue = list(actions)
    r.lists.append(tuple(actions))
    while queue:
        action = queue.pop(0)
        r.actions.append(action)
        if isinstance(action, ev.Raise):
            assert not queue
            r.raised = "raise"
            return
        if isinstance(action, ev.Bypass):
            r.bypass = True
        if not isinstance(action, ev.ANSWERED):
            if isinstance(action, ev.Post):
                yield r, action
            continue
        assert not queue, f"{action} is answered but {queue} follow it"
        fails = r.torch.fail_at is not None and r.answered == r.torch.fail_at
        r.answered += 1
        answer = yield r, action
        if fails or isinstance(answer, PortFailed):
            before = r.state.phase
            r.state, after = advance(r.state, ev.Failed())
            _moved(r, before, ev.Failed())
            assert after == (ev.Keep(),), after
            r.actions.extend(after)
            r.raised = "failed"
            return
        before = r.state.phase
        r.state, more = advance(r.state, answer)
        _moved(r, before, answer)
        r.lists.append(tuple(more))
        queue = list(more)


def _moved(r: Rank, before: Phase, event: ev.Event) -> None:
    if r.state.phase is not before:
        r.moves.append((before, type(event).__name__, r.state.phase))


def rank_run(r: Rank, lookup: bool, nested: tuple[Torch, ...] = ()) -> Generator[tuple[Rank, Any], Any, None]:
    """One rank's graph, and the graphs ``nested`` in its compile (an FX compile inside its AOT
    one): each runs whole inside the compile; ours raised in one raises out of the outer compile
    (``Abandoned``), a user's error too (its compile raises)."""
    for event in torch_events(r, lookup):
        if event is COMPILE_BODY:
            # FX compiles share at their own level only where no rank could share the AOT graph
            # (every plan local, not cacheable: ``plan.fallback_allowed``), the same on every rank.
            plans = r.state.plans.values()
            alone = bool(plans) and all(p.role == LOCAL and p.why.startswith("not cacheable") for p in plans)
            for k, t in enumerate(nested if alone else (), 1):
                inner = Rank(r.rank, t, gid=k)
                r.inner.append(inner)
                yield from rank_run(inner, lookup=True)
                if inner.raised is not None:
                    r.raised = "inner"
                    break
                if t.compile_raises:
                    r.torch = dataclasses.replace(r.torch, compile_raises=True)
                    break
            continue
        if r.state.phase is Phase.DONE and r.raised is not None and not isinstance(event, ev.Abandoned):
            break
        yield from feed(r, event)


def every_graph(r: Rank) -> list[Rank]:
    return [r, *(g for i in r.inner for g in every_graph(i))]


def simulate(ts: tuple[Torch, ...], lookup: bool, nested: tuple[tuple[Torch, ...], ...] = ()) -> list[Rank]:
    """All ranks in lockstep; returns them once every one finished (fails on a deadlock or desync).
    ``nested``: per rank, the graphs nested in its graph's compile (the same count on every rank,
    as torch runs the same inner compiles everywhere)."""
    ranks = [Rank(i, t) for i, t in enumerate(ts)]
    runs = {r.rank: rank_run(r, lookup, nested[r.rank] if nested else ()) for r in ranks}
    posts: dict[tuple[int, str, int], bytes] = {}
    pending: dict[int, tuple[Rank, Any]] = {}

    def step(rank: int, answer: Any) -> None:
        try:
            pending[rank] = runs[rank].send(answer)
        except StopIteration:
            pending.pop(rank, None)

    for r in ranks:
        step(r.rank, None)
    for _ in range(20_000):
        if not pending:
            return ranks
        progressed = False
        for rank, (g, action) in sorted(pending.items(), key=lambda item: item[0]):
            answer = local_answer(g, action, posts)
            if answer is not None:
                step(rank, None if answer is NOTHING else answer)
                progressed = True
        if progressed:
            continue
        # Every rank still running blocks: a collective every one of them is at, or a wait.
        at_collective = {rank: ga for rank, ga in pending.items() if isinstance(ga[1], COLLECTIVES)}
        gone = [r for r in ranks if r.rank not in pending]
        # A rank gone with an error (ours, or its compile's: the user's program raises there) left
        # its collectives for good: the others' exchange fails, as gloo's does when it leaves.
        left = [r for r in gone if any(g.raised or g.state.failure for g in every_graph(r))]
        if at_collective and left:
            for rank in at_collective:
                step(rank, PortFailed(f"rank {left[0].rank} left"))
            continue
        if at_collective and len(at_collective) == len(pending) == len(ranks):
            kinds = {(type(a), g.gid) for g, a in at_collective.values()}
            assert len(kinds) == 1, f"desync: ranks at different collectives {at_collective}"
            for rank, answer in collective_answers(at_collective).items():
                step(rank, answer)
            continue
        failed_any = False
        for rank, (g, a) in list(pending.items()):
            if isinstance(a, (ev.AwaitSources, ev.AwaitLocals)):
                if any(o not in pending and (g.gid, kind_of(a), o) not in posts for o in awaited_ranks(g, a)):
                    step(rank, PortFailed("the rank waited for left without posting"))
                    failed_any = True
        if failed_any:
            continue
        pytest.fail(f"deadlock: {[(rank, g.gid, a, g.state.phase) for rank, (g, a) in pending.items()]}")
    pytest.fail("no end after 20,000 steps")


NOTHING = object()


def kind_of(a: Any) -> str:
    return "source" if isinstance(a, ev.AwaitSources) else "itself"


def awaited_ranks(r: Rank, a: Any) -> list[int]:
    if isinstance(a, ev.AwaitSources):
        return sorted(x for x, p in r.state.plans.items() if p.role in (COMPILE, SERVE) and x != r.rank)
    return list(a.local)


def local_answer(r: Rank, a: Any, posts: dict[tuple[int, str, int], bytes]) -> Any:
    """The answer of an action that needs no other rank now (None: it must wait)."""
    if isinstance(a, ev.Post):
        posts[(r.gid, a.what, r.rank)] = a.value
        return NOTHING
    if isinstance(a, ev.Install):
        return ev.Installed("a digest differs" if r.torch.refuses else None)
    if isinstance(a, ev.Adopt):
        return ev.Adopted()
    if isinstance(a, ev.LookForPeers):
        return ev.PeersHeard(None)
    if isinstance(a, ev.Collect):
        if a.failure is not None:
            return ev.Collected(Result("failed", a.failure, [], []))
        if r.torch.gathering_fails:
            return ev.Collected(Result("failed", "gathering the artifact failed: OSError", [], []))
        return ev.Collected(Result("ok", None, [], []), b"bytes")
    if isinstance(a, ev.Serve):
        return ev.Served()
    if isinstance(a, (ev.AwaitSources, ev.AwaitLocals)):
        awaited = awaited_ranks(r, a)
        if all((r.gid, kind_of(a), o) in posts for o in awaited):
            if isinstance(a, ev.AwaitLocals):
                said = {o: posts[(r.gid, "itself", o)] for o in awaited}
                return ev.Posted({o: text.decode() for o, text in said.items() if text != b"ok"})
            return ev.Posted()
    return None


def collective_answers(at: dict[int, tuple[Rank, Any]]) -> dict[int, Any]:
    first = next(iter(at.values()))[1]
    if isinstance(first, ev.SettleKeys):
        offers = {
            rank: Offer(a.key, a.why, g.torch.holds and a.key is not None, f"d{rank}", [], 1 << 30)
            for rank, (g, a) in at.items()
        }
        plans = decide(offers, 1)
        return {rank: ev.Planned(rank, plans) for rank in at}
    if isinstance(first, ev.ExchangeResults):
        got = {rank: a.mine for rank, (_, a) in at.items() if a.mine is not None}
        return {rank: ev.ResultsIn(got) for rank in at}
    local = tuple(sorted(rank for rank, (_, a) in at.items() if not a.loaded))
    return {rank: ev.ReportIn(local) for rank in at}


def check(ranks: list[Rank]) -> None:
    for r in (g for top in ranks for g in every_graph(top)):
        assert r.state.phase is Phase.DONE, (r.rank, r.state.phase, r.actions)
        assert r.actions.count(ev.Keep()) == 1, (r.rank, r.actions)
        keep = r.actions.index(ev.Keep())
        if r.raised is not None:
            assert keep == len(r.actions) - 1 - (r.raised == "raise"), r.actions  # the record, then the error
        raises = [i for i, a in enumerate(r.actions) if isinstance(a, ev.Raise)]
        assert raises in ([], [len(r.actions) - 1]), r.actions
        source_raised = r.state.role == LOAD and r.state.outcome == "none" and r.state.result is not None
        if source_raised and not r.state.failed:  # its source's compile raised: it raises, quoting it
            last = r.actions[-1]
            assert isinstance(last, ev.Raise) and last.why in ("source raised", "itself raised"), r.actions
        for actions in r.lists:
            assert not any(isinstance(a, ev.ANSWERED) for a in actions[:-1]), actions
        for before, event, after in r.moves:
            if event in ("Failed", "Abandoned"):
                assert after is Phase.DONE
                continue
            assert after in machine.TRANSITIONS[(before, event)], (before, event, after)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ts=st.integers(1, 4).flatmap(torches), lookup=st.sampled_from([True, True, False]))
def test_every_order_of_events_on_every_rank_ends_with_one_record_and_no_rank_waits_forever(
    ts: tuple[Torch, ...], lookup: bool
) -> None:
    # A lookup that raises on one rank and not another is another program: torch raises alike.
    check(simulate(ts, lookup))


@settings(max_examples=300, deadline=None)
@given(ts=st.integers(2, 4).flatmap(torches))
def test_with_no_fault_nobody_raises_and_every_loader_that_hit_ran_its_source_s_artifact(ts: tuple[Torch, ...]) -> None:
    calm = tuple(
        dataclasses.replace(t, compile_raises=False, fail_at=None, gathering_fails=False, lookup_raises=False)
        for t in ts
    )
    ranks = simulate(calm, lookup=True)
    check(ranks)
    for r in ranks:
        assert r.raised is None, (r.rank, r.actions)
        if r.state.outcome == "hit":
            assert r.state.plan is not None and r.state.plan.role == LOAD
            assert r.state.result is not None and r.state.result.status == "ok"
        if r.state.role == LOAD and not r.torch.refuses and r.torch.hit and r.torch.key_seam:
            assert r.state.outcome == "hit", (r.rank, r.state)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ts=st.integers(2, 3).flatmap(torches),
    inner=st.integers(1, 2).flatmap(lambda k: st.tuples(*[torches(3)] * k)),
)
def test_graphs_nested_in_another_s_compile_end_on_every_rank_each_with_its_own_record(
    ts: tuple[Torch, ...], inner: tuple[tuple[Torch, ...], ...]
) -> None:
    # An FX fallback inside an AOT graph (the backward's inside the forward's compile too): on
    # every rank the same inner compiles run in the outer one's body, each a graph of its own.
    nested = tuple(tuple(graph[rank] for graph in inner) for rank in range(len(ts)))
    uncacheable = tuple(dataclasses.replace(t, key=None) for t in ts)  # the outer graph: no rank can share it
    ranks = simulate(uncacheable, lookup=True, nested=nested)
    check(ranks)
    for r in ranks:
        assert all(g.state.phase is Phase.DONE for g in every_graph(r))


def _without(kind: type, handler: Any) -> Any:
    """``handler`` with its actions of ``kind`` dropped."""

    def mutated(state: State, event: Any) -> Any:
        after, actions = handler(state, event)
        return after, tuple(a for a in actions if not isinstance(a, kind))

    return mutated


MUTATIONS = {
    "a loader's end after a hit keeps no record": ((Phase.LOADED, ev.CompileEnded), ev.Keep),
    "a serving rank forgets to post that its compile ended": ((Phase.COLLECTING, ev.Collected), ev.Post),
    "a loader whose source raised does not raise": ((Phase.LOCALS, ev.Posted), ev.Raise),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_properties_catch_a_mutated_machine(monkeypatch: pytest.MonkeyPatch, mutation: str) -> None:
    where, kind = MUTATIONS[mutation]
    broken = dict(machine._HANDLERS)
    broken[where] = _without(kind, broken[where])
    monkeypatch.setattr(machine, "_HANDLERS", broken)
    # The first property, without shrinking (the failure is what counts here, not its smallest case).
    search = settings(max_examples=400, deadline=None, database=None, phases=[HypothesisPhase.generate])
    run = given(ts=st.integers(1, 4).flatmap(torches), lookup=st.just(True))(
        lambda ts, lookup: check(simulate(ts, lookup))
    )
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        search(run)()


def test_the_diagram_in_the_design_doc_is_the_machine_s_own() -> None:
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    start = text.index("<!-- machine diagram:")
    start = text.index("\n", start) + 1
    end = text.index("<!-- end machine diagram -->")
    assert text[start:end].strip() == machine.diagram().strip()


def test_every_move_the_diagram_draws_is_one_advance_makes_and_no_other() -> None:
    drawn = {(phase, event) for phase, event in machine.TRANSITIONS}
    made = {(phase, kind.__name__) for phase, kind in machine._HANDLERS}
    assert drawn == made


def test_every_event_and_action_is_named_in_the_design_doc_s_tables() -> None:
    classes = {c for c in vars(ev).values() if isinstance(c, type) and c.__module__ == ev.__name__}
    assert classes == set(ev.EVENTS) | set(ev.ACTIONS)
    assert set(ev.ANSWERED) <= set(ev.ACTIONS)
