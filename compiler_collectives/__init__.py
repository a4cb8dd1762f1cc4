"""compiler_collectives: every rank of a torch.compile job makes the same compile decisions.

Importing the package installs our compiler and guard collectives into
``torch._dynamo`` (see ``dynamo_seams``). They stay off until switched on:

* compiler collectives: ``TORCH_COMPILER_COLLECTIVES=1``,
  ``torch._dynamo.config.enable_compiler_collectives = True`` or ``enable()``;
* guard collectives: ``COMPILER_COLLECTIVES_GUARDS=1``,
  ``torch.compiler.set_enable_guard_collectives(True)`` or ``enable(guards=True)``.
"""

from __future__ import annotations

__version__ = "0.1.0"

import contextlib
from typing import Any, Iterator

from . import config, health
from .errors import (
    CollectiveDesyncError,
    CollectiveError,
    CollectivePoisonedError,
    CollectiveTimeoutError,
    ConcurrentThreadsError,
    PeerFailureError,
    ProgramDivergenceError,
    SetupMismatchError,
    UnsupportedTorchError,
    WireFormatError,
)
from .state import DistributedState, LocalState, SizeEntry, register_field
from .stats import counters as _counters
from .stats import reset_counters as _reset_counters

from . import dynamo_seams as _seams  # noqa: E402  (after __version__: wire imports it)


def _running_doctor() -> bool:
    # `python -m compiler_collectives doctor` (argv[0] is "-m" while the package
    # imports) or the console script: doctor must report a broken install,
    # not die of it.
    import sys

    argv = sys.argv
    return len(argv) > 1 and argv[1] == "doctor" and (
        argv[0] == "-m" or argv[0].endswith("compiler-collectives")
    )


def _warn_retired_variables() -> None:
    import logging
    import os

    if "COMPILER_COLLECTIVES_LOG_LEVEL" in os.environ:
        logging.getLogger("compiler_collectives").warning(
            "COMPILER_COLLECTIVES_LOG_LEVEL is no longer read: set TORCH_LOGS=compiler_collectives "
            "(INFO) or TORCH_LOGS=+compiler_collectives (DEBUG) instead"
        )


def _default_group_destroyed() -> None:
    """``destroy_process_group()``: what ``reset()`` does, without destroying anything
    (torch has shut our groups down with the default group)."""
    from . import audit, compiler_collective, guard_collective
    from .transport import groups

    groups.default_group_destroyed()
    health.clear()
    compiler_collective.reset_sequence()
    guard_collective.reset_sequence()
    audit.reset_sequence()
    # A guard channel sits in a reference cycle (its bound methods): collect it now, so
    # that the old store's server closes its port before a new init_process_group binds it.
    import gc

    gc.collect()


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker): its own fresh state; the parent's is left alone."""
    from . import audit, compiler_collective, guard_collective
    from .transport import groups

    groups.after_fork_in_child()
    health.clear()
    compiler_collective.reset_sequence()
    guard_collective.after_fork_in_child()
    audit.reset_sequence()


install_error: UnsupportedTorchError | None = None
_warn_retired_variables()
try:
    _seams.install()
except UnsupportedTorchError as _e:
    if not _running_doctor():
        raise
    install_error = _e

from . import c10d_seam as _c10d_seam  # noqa: E402

_c10d_seam.install(_default_group_destroyed)
import os as _os  # noqa: E402

_os.register_at_fork(after_in_child=_after_fork_in_child)

__all__ = [
    "__version__",
    "enable",
    "disable",
    "enabled",
    "is_enabled",
    "guards_enabled",
    "stats",
    "reset",
    "reset_stats",
    "install",
    "uninstall",
    "LocalState",
    "DistributedState",
    "SizeEntry",
    "register_field",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CollectiveDesyncError",
    "CollectivePoisonedError",
    "ConcurrentThreadsError",
    "PeerFailureError",
    "ProgramDivergenceError",
    "SetupMismatchError",
    "WireFormatError",
    "UnsupportedTorchError",
]


def install() -> None:
    """Install our implementation into torch._dynamo (done at import; idempotent)."""
    _seams.install()


def uninstall() -> None:
    """Restore torch's own compiler and guard collectives (mostly for tests)."""
    _seams.uninstall()


def enable(*, compiler: bool = True, guards: bool | None = None) -> None:
    """Switch collectives on. ``guards=None`` leaves the guard collective as it is."""
    _seams.install()
    if compiler:
        _seams.set_compiler_collectives_flag(True)
    if guards is not None:
        config.set_value("guards", guards)
        _seams.set_guard_hook(guards)


def disable() -> None:
    """Switch both collectives off."""
    _seams.set_compiler_collectives_flag(False)
    config.set_value("guards", False)
    _seams.set_guard_hook(False)


def is_enabled() -> bool:
    return _seams.installed() and _seams.compiler_collectives_flag()


def guards_enabled() -> bool:
    return _seams.installed() and _seams.guard_hook_active()


@contextlib.contextmanager
def enabled(*, compiler: bool = True, guards: bool = False) -> Iterator[None]:
    """Context manager: collectives on inside, previous state restored after."""
    previous_flag = _seams.compiler_collectives_flag()
    previous_guards = _seams.guard_hook_active()
    enable(compiler=compiler, guards=guards)
    try:
        yield
    finally:
        _seams.set_compiler_collectives_flag(previous_flag)
        _seams.set_guard_hook(previous_guards)
        config.set_value("guards", previous_guards)


def stats() -> dict[str, Any]:
    """Counters of this rank: collectives run, bytes, restarts, guard outcomes, time,
    and the guard collective's transport.

    With timing on (COMPILER_COLLECTIVES_TIMING / _TRACE_DIR), ``"timing"``
    holds per kind the count, total, p50/p90/p99/max (seconds) and bytes.
    """
    from . import timing
    from .transport import groups

    out = _counters.snapshot()
    # Which mechanism the guard collective runs on ("shm", "shm+leaders", "gloo"),
    # None before the first guard collective of this generation.
    out["guard_transport"] = groups.guard_transport()
    if timing.recorder is not None:
        out["timing"] = timing.recorder.figures()
    return out


def reset_stats() -> None:
    _reset_counters()


def reset() -> None:
    """Clear a failure on this rank and forget our groups; call on every rank together."""
    from . import audit, compiler_collective, guard_collective
    from .transport import groups

    health.clear()
    groups.forget()
    compiler_collective.reset_sequence()
    guard_collective.reset_sequence()
    audit.reset_sequence()
