"""The composition root: ``install()`` is the one thing importing the package does.

Importing ``compiler_collectives`` (or any of its modules: Python runs the
package's ``__init__`` first) runs ``install()`` once; ``enable()`` and
autoload (``compiler_collectives_autoload``, through that import) run it too.
It is the one place that

* reads the settings (``config.load``), once, and warns about a retired
  variable; no module reads a setting before it;
* registers the ledger's readers: the timing recorder's (``timing.read``:
  samples and the Chrome trace) here, the structured-trace artifacts'
  (``tooling.read``) with the Dynamo wiring;
* patches torch and wires the layers together (``dynamo.install``, which
  runs ``dynamo/wiring.py``), handing the Dynamo seams the moments they run
  at torch's own reset and destroy: the seams may not import this layer;
* registers the fork handler (a forked child, a DataLoader worker, builds a
  runtime of its own);
* keeps a torch whose internals changed from killing ``doctor``, which
  reports the broken install instead of dying of it.

It builds the process's ``Runtime``, and runs the moments that end a
generation (``reset()``, ``default_group_destroyed()``, a fork) or clear a
cache of one (``torch_reset()``, ``default_group_ending()``,
``reset_stats()``): each moment's steps are written out below, in order, and
a new generation is built here and handed to each layer (``Runtime.begin``).
Every other module only defines when imported (``tests/contract/test_import.py``,
``tests/contract/test_layering.py``).

``STATE`` says what global state the package holds, module by module, and
what renews or clears each piece; ``tests/unit/test_runtime_state.py`` fails on a
module-level mutable it does not list.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

from . import config, dynamo, health, ledger, transport
from .agreements import entry, guard_owner, guard_state
from .agreements import generation as agreements_generation
from .dynamo.bound import Moments
from .errors import UnsupportedTorchError
from .health.latch import Latch
from .instrument import timing
from .ledger import Ledger
from .tools import doctor

log = logging.getLogger("compiler_collectives")


@dataclasses.dataclass(frozen=True)
class Held:
    """One piece of the package's global state: ``names`` of ``module``, and what renews it."""

    module: str  # below the package: "transport.generation"
    names: tuple[str, ...]
    what: str
    # "generation": replaced by each new generation (``Runtime.begin``); "cleared": cleared at
    # the moments ``at`` names; "wired": set once by install's wiring; "kept": for the process's life.
    kind: str
    at: str = ""


# The moments, as ``at`` names them.
RESET = "compiler_collectives.reset()"
TORCH_RESET = "torch.compiler.reset()"
ENDING = "the start of destroy_process_group() of the default group"
DESTROYED = "the end of the default group"
FORK = "a forked child"
STATS = "compiler_collectives.reset_stats()"
NEW_GENERATION = f"{RESET}, {DESTROYED}, {FORK}"

STATE = (
    Held("runtime", ("_runtime",), "the process's runtime: settings, ledger, the current generation", "kept"),
    # Each generation's, built by ``Runtime.begin`` and handed to its layer.
    Held(
        "health", ("latch",), "the latch: the first failure, each thread's parked error", "generation", NEW_GENERATION
    ),
    Held(
        "transport.generation",
        ("current",),
        "our gloo groups, the guard channel, the side channel (its heartbeat thread and StoreCaller) "
        "and the scope they span; let go of its store at the start of a destroy",
        "generation",
        NEW_GENERATION,
    ),
    Held(
        "agreements.generation",
        ("_current",),
        "the compiler collective's, audit's and compile once's sequence numbers, the compiler "
        "collective's last frame, compile once's known cache dirs and ranks by host",
        "generation",
        NEW_GENERATION,
    ),
    Held(
        "agreements.guard_state",
        ("state",),
        "the guard collective's sequence number, channel, paths and agreed miss (its owner carried "
        "over, fresh in a fork); its channel dropped at the start of a destroy",
        "generation",
        NEW_GENERATION,
    ),
    # Cleared at the moments named.
    Held(
        "transport.probes",
        ("_probes", "_probes_lock"),
        "the pending connection probes, ended (a fork keeps the parent's, unused, and a fresh lock)",
        "cleared",
        f"{RESET}, {ENDING}, {DESTROYED}, {FORK}",
    ),
    Held(
        "transport.scope",
        ("_explicit",),
        "scope()'s choice, made for the default group that ended",
        "cleared",
        DESTROYED,
    ),
    Held(
        "agreements.entry",
        ("_frames", "_building"),
        "entry agreement's registry of frames' cache entries",
        "cleared",
        f"{RESET}, {TORCH_RESET}",
    ),
    Held("agreements.guard_owner", ("_claim_lock",), "the guard collective's claim lock", "cleared", FORK),
    Held("ledger", ("ledger",), "every record and counter of stats() (its readers stay)", "cleared", STATS),
    # Set once by install's wiring (``dynamo/wiring.py``).
    Held(
        "torch_view",
        ("view",),
        "what the layers below may see of torch (the c10d store, no_python_dispatcher, the compile id, "
        "the profiler's flag, wrapper frames, operator types), from the seam table",
        "wired",
    ),
    Held("transport.groups", ("_first_rendezvous",), "the setup check, a generation's first rendezvous", "wired"),
    Held("transport.groups", ("_peer_report_handler",), "the agreements' handler of a peer's failure report", "wired"),
    Held("agreements.setup", ("_sources",), "switches known only at run time", "wired"),
    # Kept for the process's life.
    Held("transport.facade", ("groups",), "the agreements' view of the current generation (rebound by adopt)", "kept"),
    Held("transport.generation", ("_inherited",), "what a forked child inherited: kept alive, never used", "kept"),
    Held("transport.generation", ("_exit_registered",), "our exit handler is registered once per process", "kept"),
    Held(
        "transport.probes", ("_inherited_probes",), "a forked child's copies of its parent's probes: never used", "kept"
    ),
    Held(
        "agreements.audit_record",
        ("_local",),
        "the graph audited on this thread, set and restored by its compile",
        "kept",
    ),
    Held(
        "agreements.compile_scope",
        ("_current",),
        "the compile in progress in this context, set and reset by it",
        "kept",
    ),
    Held("agreements.guard_frames", ("_stable_ids",), "a cache of code objects' ids, bounded", "kept"),
    Held("agreements.guard_frames", ("_code_kinds",), "a cache of code objects' kinds, bounded", "kept"),
    Held(
        "agreements.guard_owner", ("_owner_mark",), "each thread's own mark, ending its ownership when it ends", "kept"
    ),
    Held(
        "instrument.timing", ("recorder", "_atexit_registered"), "this rank's timing recorder, closed at exit", "kept"
    ),
    Held("instrument.timing", ("_forced",), "timing forced on or off from Python", "kept"),
)


def describe() -> str:
    """``STATE``, one line each, grouped by kind."""
    lines = []
    for kind, title in (
        ("generation", "each generation's (built by the runtime, handed to its layer)"),
        ("cleared", "cleared at the moments named"),
        ("wired", "wired by install"),
        ("kept", "kept for the process's life"),
    ):
        lines.append(f"{title}:")
        for held in STATE:
            if held.kind == kind:
                at = f" ({held.at})" if held.at else ""
                lines.append(f"  {held.module}: {', '.join(held.names)}: {held.what}{at}")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Generation:
    """One generation of this process: the life of our groups under one default group.

    ``number`` names our keys on the c10d store; each layer's part is handed
    to it when the generation begins, and read there anew on each use.
    """

    number: int
    latch: Latch
    transport: transport.Generation
    agreements: agreements_generation.Generation
    guard: guard_state.GuardState

    def hand_over(self) -> None:
        """Make this the generation every layer reads."""
        health.adopt(self.latch)
        transport.adopt(self.transport)
        agreements_generation.adopt(self.agreements)
        guard_state.adopt(self.guard)


class Runtime:
    """The process's runtime, built once by ``install()`` (a forked child builds its own).

    * ``settings``: every setting, read from the environment once, at install
      (``config.load``; ``config.settings`` is the same object, and
      ``enable()``, ``disable()`` and ``config.override`` change its values);
    * ``ledger``: one frozen record per agreement or graph, from which
      ``stats()`` is computed and which its readers turn into the Chrome trace
      and our structured-trace artifacts;
    * ``install_error``: what patching torch raised, kept only where
      ``doctor`` runs (anywhere else install raises it);
    * ``generation``: the current ``Generation``, whose ``latch`` (the first
      failure on this rank and any error waiting to leave our code),
      ``agreements`` (sequence numbers, compile once's hosts), ``transport``
      (our groups, the store side channel) and ``guard`` (the guard
      collective's state) the layers below read as their own, handed over by
      ``begin``: they never import this module.
    """

    __slots__ = ("generation", "install_error", "ledger", "settings")

    def __init__(
        self, settings: Any, ledger: Ledger, install_error: UnsupportedTorchError | None, generation: Generation
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.install_error = install_error
        self.generation = generation

    @property
    def latch(self) -> Latch:
        return self.generation.latch

    @property
    def agreements(self) -> agreements_generation.Generation:
        return self.generation.agreements

    def begin(self) -> None:
        """A new generation, numbered next (after ``reset()`` or a destroyed default group)."""
        number = self.generation.number + 1
        groups = transport.groups.next_generation(number, default_group_destroyed)
        self.generation = begin_generation(number, groups, health.latch.explainer, self.generation.guard.next())

    def forked(self) -> Runtime:
        """A forked child's own runtime: the same settings and ledger, a generation of its own
        (the parent's number; its groups kept alive, never used; a fresh guard state)."""
        groups = transport.forked_child_generation(default_group_destroyed)
        generation = begin_generation(self.generation.number, groups, health.latch.explainer, guard_state.GuardState())
        return Runtime(self.settings, self.ledger, self.install_error, generation)


def begin_generation(
    number: int, groups: transport.Generation, explainer: Any, guard: guard_state.GuardState
) -> Generation:
    """A generation's parts (a healthy latch with install's ``explainer``, fresh agreement
    state), handed to their layers."""
    generation = Generation(number, Latch(explainer=explainer), groups, agreements_generation.Generation(), guard)
    generation.hand_over()
    return generation


_runtime: Runtime | None = None


def install() -> Runtime:
    """Build the runtime and patch torch (the first call); patch torch again after ``uninstall()``."""
    global _runtime
    if _runtime is not None:
        dynamo.install(moments())  # idempotent: patches again only after dynamo.uninstall()
        return _runtime
    warn_retired_variables()
    settings = config.load()  # a ConfigError stops here, before torch is touched
    ledger.ledger.add_reader(timing.read)  # every trace event of ours comes from a record
    install_error = None
    try:
        dynamo.install(moments())
    except UnsupportedTorchError as e:
        if not running_doctor():
            raise
        install_error = e
        doctor.set_install_error(e)
    first = begin_generation(
        0,
        transport.groups.next_generation(0, default_group_destroyed),
        health.latch.explainer,
        guard_state.GuardState(),
    )
    _runtime = Runtime(settings, ledger.ledger, install_error, first)
    os.register_at_fork(after_in_child=after_fork_in_child)
    return _runtime


def current() -> Runtime:
    """The process's runtime (``install()`` built it when the package was imported)."""
    if _runtime is None:
        raise RuntimeError("compiler_collectives is not installed: import compiler_collectives first")
    return _runtime


def moments() -> Moments:
    """What the Dynamo seams run at torch's own reset and destroy of the default group."""
    return Moments(
        torch_reset=torch_reset,
        default_group_ending=default_group_ending,
        default_group_destroyed=default_group_destroyed,
    )


def running_doctor() -> bool:
    """``python -m compiler_collectives doctor`` (argv[0] is "-m" while the package imports) or
    the console script: doctor must report a broken install, not die of it."""
    argv = sys.argv
    return len(argv) > 1 and argv[1] == "doctor" and (argv[0] == "-m" or argv[0].endswith("compiler-collectives"))


def warn_retired_variables() -> None:
    if "COMPILER_COLLECTIVES_LOG_LEVEL" in os.environ:
        log.warning(
            "COMPILER_COLLECTIVES_LOG_LEVEL is no longer read: set TORCH_LOGS=compiler_collectives "
            "(INFO) or TORCH_LOGS=+compiler_collectives (DEBUG) instead"
        )


# ------------------------------------------------------------------ the moments
# Each moment's steps, in order. Our groups go first: that stops the heartbeat thread, which
# could otherwise report into the old latch while the next generation is built.


def reset() -> None:
    """``compiler_collectives.reset()`` on every rank: a new generation.

    Frames whose entries ran different collectives lose their Dynamo entries
    first (``dynamo.forget_entries``); then our groups and probes go, entry
    agreement forgets its frames, and the next generation begins.
    """
    if dynamo.installed():
        dynamo.forget_entries()
    transport.forget()
    entry.reset()
    current().begin()


def torch_reset() -> None:
    """``torch.compiler.reset()`` (the Dynamo seam runs it): Dynamo's caches went, and with them
    every cache entry entry agreement registered."""
    entry.reset()


def default_group_ending() -> None:
    """The start of ``destroy_process_group()`` of the default group (the c10d seam runs it): let
    go of its store (``transport.let_go``; the guard collective's channel holds it too)."""
    transport.let_go()
    guard_state.let_go()


def default_group_destroyed() -> None:
    """The end of the default group: ``destroy_process_group()`` (the c10d seam runs it), or a new
    default group that ``transport``'s ``notice()`` found. What is left of our groups goes, with
    ``scope()``'s choice, and the next generation begins."""
    transport.default_group_destroyed()
    if _runtime is not None:
        _runtime.begin()


def after_fork_in_child() -> None:
    """A forked child builds its own runtime (the fork handler install registers)."""
    global _runtime
    guard_owner.after_fork_in_child()
    if _runtime is not None:
        _runtime = _runtime.forked()


def reset_stats() -> None:
    """``compiler_collectives.reset_stats()``: every record and counter of ``stats()`` (the
    ledger's readers stay)."""
    ledger.reset_ledger()
