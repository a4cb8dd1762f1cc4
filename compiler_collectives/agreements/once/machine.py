"""Compile once's machine: one graph on this rank, as states, the events that move it and the
actions each move asks for. Pure: ``advance(state, event) -> (state, actions)`` reads nothing
but its arguments and does no I/O, so every order of events is tested without a process
(``tests/unit/test_compile_once_machine.py``, with hypothesis).

Events are what torch's callbacks report (through the seam, ``dynamo/once_seam.py``): the cache
lookup began, its key, its end (hit, miss, or it raised), the compile's end (or its raise), ours
failing inside the compile; and what this rank's own actions report back (through the driver,
``driver.py``): the plan, the posts awaited, the results, the install, the load report, a peer's
failure heard. Actions are what to exchange, post, wait for, fetch, install, serve, keep or
raise. The driver runs them, in order; only the last action of a list may answer with an event,
which the driver feeds back at once (the property tests check it).

Each ``Phase`` says what it waits for; a ``Span`` action says which of Dynamo's timed events
(``dynamo_timed``) the actions after it run inside. Every path ends in ``DONE`` with exactly one ``Keep`` (the graph's
record, made after every wait of the graph); an error a port raised (``Failed``) ends the graph
there, its record kept, and the driver raises it on; one the machine decides (``Raise``) comes
after the record. The states, drawn as ``docs/design.md``'s diagram, are ``TRANSITIONS``
(``tests/unit/test_compile_once_machine.py`` checks that the two agree and that ``advance`` takes
no other).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from .events import (
    ACTIONS,
    EVENTS,
    FINISH,
    WAIT,
    Abandoned,
    Action,
    Adopt,
    Adopted,
    AwaitLocals,
    AwaitSources,
    Bypass,
    Collect,
    Collected,
    CompileEnded,
    Event,
    ExchangeResults,
    Failed,
    Install,
    Installed,
    Keep,
    KeyComputed,
    LookForPeers,
    LookupBegan,
    LookupEnded,
    PeersHeard,
    Planned,
    Post,
    Posted,
    Raise,
    Report,
    ReportIn,
    ResultsIn,
    Serve,
    Served,
    SettleKeys,
    Span,
)
from .plan import COMPILE, LOAD, LOCAL, SERVE, Plan


class Phase(enum.Enum):
    """Where one graph stands on this rank, and what it waits for."""

    OPEN = "the cache lookup, or the compile's end (a compile that never looks its graph up)"
    LOOKING = "the lookup's key (or its end without one)"
    KEYING = "the key exchange: every rank's plan"
    COMPILING = "the compile's end (this rank compiles, serves, or compiles alone)"
    CHECKING = "whether a peer reported a failure while this rank compiled"
    COLLECTING = "this rank's artifact gathered: its files, fingerprints and digests"
    SOURCES = "the serving ranks' posts that their compile ended"
    RESULTS = "the result exchange: each serving rank's outcome and manifest"
    INSTALLING = "the artifact's bytes received, checked and installed"
    SERVING = "this rank's artifact sent down its receivers' tree"
    LOOKUP = "the cache lookup's end: it hit the installed entry, missed, or was refused"
    ADOPTING = "the loaded artifact's fingerprints taken as this rank's own"
    REPORTING = "the load report: who did not load"
    LOCALS = "the posts of the ranks that compile the graph themselves"
    LOADED = "the compile's end (its lookup loaded the artifact)"
    ITSELF = "the compile's end (this rank did not load: it compiles the graph itself)"
    DONE = "nothing: the graph's record is kept"

    @property
    def waits_for(self) -> str:
        return str(self.value)


# -------------------------------------------------------------------------------------- state

NO_LOOKUP = (
    "AOTAutograd did not look this graph up in its cache (a backend without AOTAutograd's cache, "
    "such as aot_eager, or caches off)"
)


@dataclasses.dataclass(frozen=True)
class State:
    """One graph on this rank. ``outcome`` is a loader's load: "none", "hit", "miss" or "refused";
    ``ended``: the compile ended (``failure``: it raised); ``local``: the ranks that did not load;
    ``failed``: an action of ours failed (or ours raised inside the compile) and ended the graph."""

    phase: Phase = Phase.OPEN
    rank: int = -1
    plan: Plan | None = None
    plans: Mapping[int, Plan] = dataclasses.field(default_factory=dict)
    outcome: str = "none"
    outcome_why: str | None = None
    ended: bool = False
    failure: str | None = None
    local: tuple[int, ...] = ()
    result: Any = None  # a loader's: its source's result; a serving rank's: its own
    bundle: bytes = b""
    failed: bool = False

    @property
    def role(self) -> str | None:
        return None if self.plan is None else self.plan.role

    @property
    def serving(self) -> bool:
        return self.role in (COMPILE, SERVE)

    @property
    def any_source(self) -> bool:
        return any(p.role in (COMPILE, SERVE) for p in self.plans.values())


def _go(state: State, phase: Phase, *actions: Action, **changes: Any) -> tuple[State, tuple[Action, ...]]:
    return dataclasses.replace(state, phase=phase, **changes), actions


def _done(state: State, *then: Action, **changes: Any) -> tuple[State, tuple[Action, ...]]:
    """The graph ends: its record kept, then ``then`` (a ``Raise``)."""
    return _go(state, Phase.DONE, Keep(), *then, **changes)


def _stay(state: State) -> tuple[State, tuple[Action, ...]]:
    return state, ()


def advance(state: State, event: Event) -> tuple[State, tuple[Action, ...]]:
    """The next state of one graph and the actions to run, after ``event``. Events a state does
    not wait for change nothing (torch calls the seams of nested and unrelated compiles too)."""
    phase = state.phase
    if phase is Phase.DONE:
        return _stay(state)
    if isinstance(event, (Failed, Abandoned)):
        plan = state.plan or Plan(LOCAL, None, "ours failed before the key exchange", False)
        return _done(state, plan=plan, ended=state.ended or isinstance(event, Abandoned), failed=True, bundle=b"")
    handler = _HANDLERS.get((phase, type(event)))
    if handler is None:
        return _stay(state)
    return handler(state, event)


# ------------------------------------------------------------------------- the lookup and keys


def _open_lookup(state: State, event: LookupBegan) -> tuple[State, tuple[Action, ...]]:
    return _go(state, Phase.LOOKING)


def _key(state: State, event: KeyComputed) -> tuple[State, tuple[Action, ...]]:
    return _go(state, Phase.KEYING, SettleKeys(event.key, event.why))


def _lookup_without_key(state: State, event: LookupEnded) -> tuple[State, tuple[Action, ...]]:
    # The lookup ended (or raised) before computing a key: the exchange all the same, as not
    # cacheable: every other rank is in it.
    return _go(state, Phase.KEYING, SettleKeys(None, "AOTAutograd's lookup computed no key"))


def _no_lookup(state: State, event: CompileEnded) -> tuple[State, tuple[Action, ...]]:
    """The compile ended without a key exchange: nothing to exchange, a record of its own."""
    why = event.no_lookup or NO_LOOKUP
    plan = Plan(LOCAL, None, why if event.failure is None else f"its compile raised before its lookup: {why}", False)
    return _done(state, plan=plan, ended=True, failure=event.failure)


def _planned(state: State, event: Planned) -> tuple[State, tuple[Action, ...]]:
    plan = event.plans[event.rank]
    state = dataclasses.replace(state, rank=event.rank, plan=plan, plans=MappingProxyType(dict(event.plans)))
    if plan.role == LOAD:
        return _go(state, Phase.SOURCES, Span(WAIT), AwaitSources())
    return _go(state, Phase.COMPILING)


# ------------------------------------------------------------------------------ a loader's fetch


def _sources_posted(state: State, event: Posted) -> tuple[State, tuple[Action, ...]]:
    return _go(state, Phase.RESULTS, ExchangeResults(state.result if state.serving else None))


def _results_in(state: State, event: ResultsIn) -> tuple[State, tuple[Action, ...]]:
    if state.role != LOAD:
        if state.serving:
            return _go(state, Phase.SERVING, Serve(state.bundle, event.results[state.rank]))
        return _report(state)
    assert state.plan is not None and state.plan.source is not None
    result = event.results[state.plan.source]
    if result.status == "failed" and (result.failure or "").startswith("gathering the artifact failed"):
        why = f"rank {state.plan.source} has no artifact: {result.failure}"
        return _go(state, Phase.LOOKUP, Bypass(), outcome="refused", outcome_why=why, result=result)
    if result.status == "failed":
        # The serving rank's compile raised: the load report first (the serving rank takes it
        # too), then this rank raises, quoting it.
        state = dataclasses.replace(state, outcome_why="the compiling rank's compile raised", result=result)
        return _report(state)
    return _go(state, Phase.INSTALLING, Install(result), result=result)


def _installed(state: State, event: Installed) -> tuple[State, tuple[Action, ...]]:
    if event.refusal is not None:
        return _go(state, Phase.LOOKUP, Bypass(), outcome="refused", outcome_why=event.refusal)
    return _go(state, Phase.LOOKUP, outcome_why=event.note)


def _lookup_ended(state: State, event: LookupEnded) -> tuple[State, tuple[Action, ...]]:
    if state.outcome == "refused":
        return _report(state)
    if event.hit:
        return _go(state, Phase.ADOPTING, Adopt(state.result), outcome="hit")
    return _report(
        dataclasses.replace(state, outcome="miss", outcome_why="the entry's guards fail this rank's size hints")
    )


def _adopted(state: State, event: Adopted) -> tuple[State, tuple[Action, ...]]:
    return _report(state if event.why is None else dataclasses.replace(state, outcome_why=event.why))


def _compile_ended_before_lookup(state: State, event: CompileEnded) -> tuple[State, tuple[Action, ...]]:
    """A loader's compile ended with its lookup's end never seen: taken as a miss, reported."""
    ended = dataclasses.replace(state, ended=True, failure=event.failure)
    if state.outcome == "refused":
        return _report(ended)
    return _report(dataclasses.replace(ended, outcome="miss", outcome_why="no lookup's end was seen"))


# --------------------------------------------------------------------- the end of this rank's compile


def _compiled(state: State, event: CompileEnded) -> tuple[State, tuple[Action, ...]]:
    state = dataclasses.replace(state, ended=True, failure=event.failure)
    if not state.any_source:
        return _done(state)
    return _go(state, Phase.CHECKING, Span(FINISH), LookForPeers())


def _peers_heard(state: State, event: PeersHeard) -> tuple[State, tuple[Action, ...]]:
    if event.failure is not None:
        return _done(state, Raise("peer failed", heard=event.failure))
    if state.serving:
        return _go(state, Phase.COLLECTING, Collect(state.failure))
    return _go(state, Phase.SOURCES, AwaitSources())


def _collected(state: State, event: Collected) -> tuple[State, tuple[Action, ...]]:
    return _go(state, Phase.SOURCES, Post("source"), AwaitSources(), result=event.result, bundle=event.bundle)


def _served(state: State, event: Served) -> tuple[State, tuple[Action, ...]]:
    return _report(dataclasses.replace(state, bundle=b""))


# ----------------------------------------------------------------------------- the load report


def _report(state: State) -> tuple[State, tuple[Action, ...]]:
    loaded = state.outcome not in ("miss", "refused")
    return _go(state, Phase.REPORTING, Report(loaded, state.outcome, state.outcome_why))


def _report_in(state: State, event: ReportIn) -> tuple[State, tuple[Action, ...]]:
    state = dataclasses.replace(state, local=event.local)
    if state.rank in event.local:
        if state.ended:
            return _itself_ended(state)
        return _go(state, Phase.ITSELF)
    others = tuple(r for r in event.local if r != state.rank)
    return _go(state, Phase.LOCALS, AwaitLocals(others))


def _locals_posted(state: State, event: Posted) -> tuple[State, tuple[Action, ...]]:
    raised_here = state.rank in state.local and state.failure is not None
    if event.raised and not raised_here:
        ranks = tuple(sorted(event.raised))
        return _done(state, Raise("itself raised", ranks, event.raised[ranks[0]]))
    if state.role == LOAD and state.result is not None and state.result.status == "failed":
        assert state.plan is not None and state.plan.source is not None
        return _done(state, Raise("source raised", (state.plan.source,), state.result.failure or ""))
    if state.ended:
        return _done(state)
    return _go(state, Phase.LOADED)


def _loaded_compile_ended(state: State, event: CompileEnded) -> tuple[State, tuple[Action, ...]]:
    return _done(state, ended=True, failure=event.failure)


def _itself_compile_ended(state: State, event: CompileEnded) -> tuple[State, tuple[Action, ...]]:
    return _itself_ended(dataclasses.replace(state, ended=True, failure=event.failure))


def _itself_ended(state: State) -> tuple[State, tuple[Action, ...]]:
    """This rank's own compile after it did not load ended: the ranks that loaded wait for its post."""
    value = b"ok" if state.failure is None else state.failure.encode()[:2000]
    others = tuple(r for r in state.local if r != state.rank)
    return _go(state, Phase.LOCALS, Post("itself", value), AwaitLocals(others))


_Handler = Callable[[State, Any], tuple[State, tuple[Action, ...]]]
_HANDLERS: dict[tuple[Phase, type], _Handler] = {
    (Phase.OPEN, LookupBegan): _open_lookup,
    (Phase.OPEN, CompileEnded): _no_lookup,
    (Phase.LOOKING, KeyComputed): _key,
    (Phase.LOOKING, LookupEnded): _lookup_without_key,
    (Phase.LOOKING, CompileEnded): _no_lookup,
    (Phase.KEYING, Planned): _planned,
    (Phase.COMPILING, CompileEnded): _compiled,
    (Phase.CHECKING, PeersHeard): _peers_heard,
    (Phase.COLLECTING, Collected): _collected,
    (Phase.SOURCES, Posted): _sources_posted,
    (Phase.RESULTS, ResultsIn): _results_in,
    (Phase.INSTALLING, Installed): _installed,
    (Phase.SERVING, Served): _served,
    (Phase.LOOKUP, LookupEnded): _lookup_ended,
    (Phase.LOOKUP, CompileEnded): _compile_ended_before_lookup,
    (Phase.ADOPTING, Adopted): _adopted,
    (Phase.REPORTING, ReportIn): _report_in,
    (Phase.LOCALS, Posted): _locals_posted,
    (Phase.LOADED, CompileEnded): _loaded_compile_ended,
    (Phase.ITSELF, CompileEnded): _itself_compile_ended,
}

TRANSITIONS: dict[tuple[Phase, str], tuple[Phase, ...]] = {
    (Phase.OPEN, "LookupBegan"): (Phase.LOOKING,),
    (Phase.OPEN, "CompileEnded"): (Phase.DONE,),
    (Phase.LOOKING, "KeyComputed"): (Phase.KEYING,),
    (Phase.LOOKING, "LookupEnded"): (Phase.KEYING,),
    (Phase.LOOKING, "CompileEnded"): (Phase.DONE,),
    (Phase.KEYING, "Planned"): (Phase.SOURCES, Phase.COMPILING),
    (Phase.COMPILING, "CompileEnded"): (Phase.CHECKING, Phase.DONE),
    (Phase.CHECKING, "PeersHeard"): (Phase.COLLECTING, Phase.SOURCES, Phase.DONE),
    (Phase.COLLECTING, "Collected"): (Phase.SOURCES,),
    (Phase.SOURCES, "Posted"): (Phase.RESULTS,),
    (Phase.RESULTS, "ResultsIn"): (Phase.INSTALLING, Phase.LOOKUP, Phase.SERVING, Phase.REPORTING),
    (Phase.INSTALLING, "Installed"): (Phase.LOOKUP,),
    (Phase.SERVING, "Served"): (Phase.REPORTING,),
    (Phase.LOOKUP, "LookupEnded"): (Phase.ADOPTING, Phase.REPORTING),
    (Phase.ADOPTING, "Adopted"): (Phase.REPORTING,),
    (Phase.LOOKUP, "CompileEnded"): (Phase.REPORTING,),
    (Phase.REPORTING, "ReportIn"): (Phase.ITSELF, Phase.LOCALS),
    (Phase.LOCALS, "Posted"): (Phase.DONE, Phase.LOADED),
    (Phase.LOADED, "CompileEnded"): (Phase.DONE,),
    (Phase.ITSELF, "CompileEnded"): (Phase.LOCALS,),
}
"""Every move ``advance`` makes, as the diagram in ``docs/design.md`` draws it: (state, event) ->
the states it may lead to. From every state but ``DONE``, ``Failed`` and ``Abandoned`` lead to
``DONE``."""


def diagram() -> str:
    """``TRANSITIONS`` as a Mermaid state diagram, and each state with what it waits for: the
    text ``docs/design.md`` shows (a test checks that the two agree)."""
    lines = ["```mermaid", "stateDiagram-v2", "    [*] --> OPEN"]
    for (phase, event), targets in TRANSITIONS.items():
        lines += [f"    {phase.name} --> {target.name}: {event}" for target in targets]
    lines += ["    DONE --> [*]", "```", "", "| state | waits for |", "|---|---|"]
    lines += [f"| `{phase.name}` | {phase.waits_for} |" for phase in Phase]
    lines += ["", "| action | what the driver does |", "|---|---|"]
    lines += [f"| `{kind.__name__}` | {_said(kind)} |" for kind in ACTIONS]
    lines += ["", "| event | what it reports |", "|---|---|"]
    lines += [f"| `{kind.__name__}` | {_said(kind)} |" for kind in EVENTS]
    return "\n".join(lines)


def _said(kind: type) -> str:
    """A class's docstring on one line."""
    return " ".join((kind.__doc__ or "").split())
