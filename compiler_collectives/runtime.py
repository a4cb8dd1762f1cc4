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
* registers the fork handler (a forked child, a DataLoader worker, gets a
  fresh state of its own);
* keeps a torch whose internals changed from killing ``doctor``, which
  reports the broken install instead of dying of it.

It builds the process's ``Runtime``. Every other module only defines when
imported (``tests/test_import.py``, ``tests/test_layering.py``).

The moments that clear the process's state (``process_state`` lists what each
clears; its docstring says who runs which) are run from here: ``reset()``,
``torch_reset()``, ``default_group_ending()``, ``default_group_destroyed()``,
``after_fork_in_child()`` and ``reset_stats()``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

from . import config, dynamo, health, ledger, process_state
from .agreements import audit, compiler, entry, guard, guard_owner, guard_state, once
from .agreements import generation as agreements_generation
from .dynamo.bound import Moments
from .errors import UnsupportedTorchError
from .health.latch import Latch
from .instrument import timing
from .ledger import Ledger
from .tools import doctor
from .transport import groups

log = logging.getLogger("compiler_collectives")

# Imported so that each has declared its state in process_state before any moment runs.
DECLARING = (health, ledger, groups, audit, compiler, entry, guard, guard_owner, guard_state, once)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The process's runtime, built once by ``install()``.

    It holds now:

    * ``settings``: every setting, read from the environment once, at install
      (``config.load``; ``config.settings`` is the same object, and
      ``enable()``, ``disable()`` and ``config.override`` change its values);
    * ``install_error``: what patching torch raised, kept only where
      ``doctor`` runs (anywhere else install raises it);
    * ``latch``: the first failure on this rank and any error waiting to
      leave our code (``health.latch``, read anew on each use: a moment that
      ends a generation binds a new one there);
    * ``ledger``: one frozen record per agreement or graph, from which
      ``stats()`` is computed and which its readers turn into the Chrome trace
      and our structured-trace artifacts (``ledger.ledger``: ``reset_stats()``
      clears it in place, its readers stay);
    * ``generation``: the number of the current generation (``process_state``
      counts it, as the layers below read it, until it moves here);
    * ``agreements``: this generation's agreement state (the compiler, audit
      and compile-once sequence numbers, compile once's hosts:
      ``agreements.generation``, read anew on each use: a moment that ends a
      generation binds a fresh one there).

    Still to move onto it (issue 42): transport's generation (our groups, the
    store channel), which its moments still clear in place, and the guard
    collective's state (``guard_state``, read by the guard hook), handed to the
    layers below as arguments; until then those layers reach the latch, the
    ledger and the generation through their own modules, and never import
    this one.
    """

    settings: Any
    ledger: Ledger
    install_error: UnsupportedTorchError | None = None

    @property
    def latch(self) -> Latch:
        return health.latch

    @property
    def generation(self) -> int:
        return process_state.generation()

    @property
    def agreements(self) -> agreements_generation.Generation:
        return agreements_generation.current()


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
    os.register_at_fork(after_in_child=after_fork_in_child)
    _runtime = Runtime(settings, ledger.ledger, install_error)
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


def reset() -> None:
    """``compiler_collectives.reset()`` on every rank: a new generation.

    Frames whose entries ran different collectives lose their Dynamo entries
    first (``dynamo.forget_entries``), then the ``RESET`` moment clears the rest.
    """
    if dynamo.installed():
        dynamo.forget_entries()
    process_state.run(process_state.RESET)


def torch_reset() -> None:
    """``torch.compiler.reset()`` (the Dynamo seam runs it): Dynamo's caches went."""
    process_state.run(process_state.TORCH_RESET)


def default_group_ending() -> None:
    """The start of ``destroy_process_group()`` of the default group (the c10d seam runs it)."""
    process_state.run(process_state.GROUP_ENDING)


def default_group_destroyed() -> None:
    """The end of ``destroy_process_group()`` of the default group (the c10d seam runs it)."""
    process_state.run(process_state.GROUP_DESTROYED)


def after_fork_in_child() -> None:
    """A forked child gets a fresh state of its own (the fork handler install registers)."""
    process_state.run(process_state.FORK)


def reset_stats() -> None:
    """``compiler_collectives.reset_stats()``."""
    process_state.run(process_state.STATS)
