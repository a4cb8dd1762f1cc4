"""Compile once's vocabulary: the events that move one graph's machine (``machine.py``) and the
actions it asks the driver (``driver.py``) to run.

Events come from torch's callbacks (through the seam: the lookup began, its key, its end, the
compile's end, ours failing inside it) and from the answers to this rank's own actions (the
plan, the posts awaited, the results, the install, the load report, a peer's failure heard).
Actions are what to exchange, post, wait for, fetch, install, serve, keep or raise; those in
``ANSWERED`` answer with an event, and each is the last of its list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .plan import Plan

WAIT, FINISH = "wait", "finish"  # the seam's timed events: a loader's fetch, any other rank's end

# ------------------------------------------------------------------------------------- events


@dataclasses.dataclass(frozen=True)
class LookupBegan:
    """Torch's cache lookup of this graph's level began."""


@dataclasses.dataclass(frozen=True)
class KeyComputed:
    """The lookup computed its key (``key`` None: it could not, ``why``)."""

    key: str | None
    why: str | None = None


@dataclasses.dataclass(frozen=True)
class LookupEnded:
    """The lookup ended: ``hit`` True or False (None: this rank refused the artifact first);
    ``raised``: the lookup raised (a miss, for a loader)."""

    hit: bool | None
    raised: bool = False


@dataclasses.dataclass(frozen=True)
class CompileEnded:
    """The compile ended (``failure``: the text of what it raised); ``no_lookup``: why it took no
    lookup, if it took none."""

    failure: str | None = None
    no_lookup: str = ""


@dataclasses.dataclass(frozen=True)
class Abandoned:
    """Ours failed inside the compile: no further exchange of this graph can be trusted."""


@dataclasses.dataclass(frozen=True)
class Planned:
    """The key exchange's answer: every rank's plan (global rank -> plan), this rank's own."""

    rank: int
    plans: Mapping[int, Plan]


@dataclasses.dataclass(frozen=True)
class Posted:
    """The posts waited for arrived: the ones that tell of a failure (rank -> its text)."""

    raised: Mapping[int, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ResultsIn:
    """The result exchange's answer: each serving rank's result (``wire.once.Result``)."""

    results: Mapping[int, Any]


@dataclasses.dataclass(frozen=True)
class Installed:
    """The loader's install: ``refusal`` None, or why it refused the artifact; ``note``: where the
    bytes came from, when not from its parent in the tree."""

    refusal: str | None
    note: str | None = None


@dataclasses.dataclass(frozen=True)
class Adopted:
    """The hit's fingerprints are this rank's own; ``why``: the hit was not the entry it was sent."""

    why: str | None = None


@dataclasses.dataclass(frozen=True)
class Collected:
    """The serving rank's artifact: its result and its bytes (``Result`` status "failed": it could
    not be gathered, its text says why)."""

    result: Any
    bundle: bytes = b""


@dataclasses.dataclass(frozen=True)
class Served:
    """This rank's part of sending the artifact is done."""


@dataclasses.dataclass(frozen=True)
class ReportIn:
    """The load report's answer: the ranks that did not load (they compile the graph themselves)."""

    local: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PeersHeard:
    """What this rank heard while it compiled: a peer's failure report (None: nothing)."""

    failure: BaseException | None


@dataclasses.dataclass(frozen=True)
class Failed:
    """An action raised (an exchange, a wait, a post): the graph ends here."""


Event = (
    LookupBegan
    | KeyComputed
    | LookupEnded
    | CompileEnded
    | Abandoned
    | Planned
    | Posted
    | ResultsIn
    | Installed
    | Adopted
    | Collected
    | Served
    | ReportIn
    | PeersHeard
    | Failed
)

# ------------------------------------------------------------------------------------ actions


@dataclasses.dataclass(frozen=True)
class Span:
    """Time the actions that follow, up to the next event torch reports, as the seam's timed event
    ``name`` (``WAIT``: a loader's fetch; ``FINISH``: any other rank's end of the graph)."""

    name: str


@dataclasses.dataclass(frozen=True)
class SettleKeys:
    """Exchange keys: answers ``Planned``."""

    key: str | None
    why: str | None


@dataclasses.dataclass(frozen=True)
class AwaitSources:
    """Wait for every serving rank's post (but this rank's): answers ``Posted``."""


@dataclasses.dataclass(frozen=True)
class ExchangeResults:
    """The result exchange, with this rank's result (None: it serves nothing): answers ``ResultsIn``."""

    mine: Any


@dataclasses.dataclass(frozen=True)
class Install:
    """Receive, check and install the source's artifact: answers ``Installed``."""

    result: Any


@dataclasses.dataclass(frozen=True)
class Bypass:
    """Tell the lookup to bypass the cache: this rank refused the artifact and compiles itself."""


@dataclasses.dataclass(frozen=True)
class Adopt:
    """The lookup hit: take the fingerprints of the artifact as this rank's own (``result``):
    answers ``Adopted``."""

    result: Any


@dataclasses.dataclass(frozen=True)
class LookForPeers:
    """Read what this rank heard while it compiled: answers ``PeersHeard``."""


@dataclasses.dataclass(frozen=True)
class Collect:
    """Gather this rank's artifact (``failure``: its compile raised, publish that): answers ``Collected``."""

    failure: str | None


@dataclasses.dataclass(frozen=True)
class Post:
    """Post a notice: ``what`` "source" (this rank's compile for others ended) or "itself" (its
    own compile after it did not load ended, ``value`` b"ok" or the error's text)."""

    what: str
    value: bytes = b"1"


@dataclasses.dataclass(frozen=True)
class Serve:
    """Send this rank's artifact down its receivers' tree: answers ``Served``."""

    bundle: bytes
    result: Any


@dataclasses.dataclass(frozen=True)
class Report:
    """The load report, with this rank's load (``loaded``; else its outcome and why): answers ``ReportIn``."""

    loaded: bool
    outcome: str
    why: str | None


@dataclasses.dataclass(frozen=True)
class AwaitLocals:
    """Wait for the posts of the ranks that compile the graph themselves: answers ``Posted``."""

    local: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Keep:
    """Keep the graph's record (``State`` says how it ended): the graph is done."""


@dataclasses.dataclass(frozen=True)
class Raise:
    """Raise compile once's own error: ``why`` "source raised" (the source's compile raised,
    ``text``), "itself raised" (ranks that compiled the graph themselves raised, ``ranks``, the first one's ``text``) or
    "peer failed" (a peer's report heard while this rank compiled, ``heard``)."""

    why: str
    ranks: tuple[int, ...] = ()
    text: str = ""
    heard: BaseException | None = None


Action = (
    Span
    | SettleKeys
    | AwaitSources
    | ExchangeResults
    | Install
    | Bypass
    | Adopt
    | LookForPeers
    | Collect
    | Post
    | Serve
    | Report
    | AwaitLocals
    | Keep
    | Raise
)
EVENTS = (
    LookupBegan,
    KeyComputed,
    LookupEnded,
    CompileEnded,
    Abandoned,
    Planned,
    Posted,
    ResultsIn,
    Installed,
    Adopted,
    Collected,
    Served,
    ReportIn,
    PeersHeard,
    Failed,
)
ACTIONS = (
    Span,
    SettleKeys,
    AwaitSources,
    ExchangeResults,
    Install,
    Bypass,
    Adopt,
    LookForPeers,
    Collect,
    Post,
    Serve,
    Report,
    AwaitLocals,
    Keep,
    Raise,
)
ANSWERED = (
    SettleKeys,
    AwaitSources,
    ExchangeResults,
    Install,
    Adopt,
    LookForPeers,
    Collect,
    Serve,
    Report,
    AwaitLocals,
)
"""The actions the driver answers with an event (each is the last of its list)."""
