"""compiler_collectives: every rank of a torch.compile job makes the same compile decisions.

Importing the package runs one thing, ``runtime.install()`` (the composition
root): it reads the settings and installs our compiler and guard collectives
into ``torch._dynamo`` (see the ``dynamo`` subpackage, the only part that
touches torch's internals). They stay off until switched on:

* compiler collectives: ``TORCH_COMPILER_COLLECTIVES=1``,
  ``torch._dynamo.config.enable_compiler_collectives = True`` or ``enable()``;
* guard collectives: ``COMPILER_COLLECTIVES_GUARDS=1``,
  ``torch.compiler.set_enable_guard_collectives(True)`` or ``enable(guards=True)``.

Pipeline parallelism: ``scope(stage_group)`` on every rank before its first
compile (or ``COMPILER_COLLECTIVES_SCOPE``) keeps every agreement within the
ranks that run the same program.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from . import config
from . import dynamo as _seams
from . import runtime as _runtime
from .errors import (
    CollectiveDesyncError,
    CollectiveError,
    CollectivePoisonedError,
    CollectiveTimeoutError,
    CompileOnceError,
    CompileTimeoutError,
    ConcurrentThreadsError,
    PeerFailureError,
    ProgramDivergenceError,
    ScopeError,
    SetupMismatchError,
    StoreFailureError,
    UnsupportedTorchError,
    WireFormatError,
)
from .observations import DistributedState, LocalState, SizeEntry, register_field
from .version import __version__

__all__ = [
    "CollectiveDesyncError",
    "CollectiveError",
    "CollectivePoisonedError",
    "CollectiveTimeoutError",
    "CompileOnceError",
    "CompileTimeoutError",
    "ConcurrentThreadsError",
    "DistributedState",
    "LocalState",
    "PeerFailureError",
    "ProgramDivergenceError",
    "ScopeError",
    "SetupMismatchError",
    "SizeEntry",
    "StoreFailureError",
    "UnsupportedTorchError",
    "WireFormatError",
    "__version__",
    "disable",
    "enable",
    "enabled",
    "guards_enabled",
    "install",
    "is_enabled",
    "register_field",
    "reset",
    "reset_stats",
    "scope",
    "stats",
    "uninstall",
]


def scope(group: Any = None) -> None:
    """Make every agreement of this rank run among the ranks of ``group`` only.

    Call it on every rank, after ``init_process_group`` and before the rank's
    first compile, with the group of the ranks that run the same program as
    this one (for pipeline parallelism: the ranks of its stage). ``group`` is a
    ``ProcessGroup``, a 1-D ``DeviceMesh`` or a flattened sub-mesh
    (``mesh["dp", "tp"]._flatten()``); ``None`` returns to the whole world.
    It overrides ``COMPILER_COLLECTIVES_SCOPE``. The setup check (settings and
    versions, across the whole job) and the check that scopes do not overlap
    run here, on the c10d store, waiting only for the ranks of this scope.

    Raises ``ScopeError`` after a compile (call ``reset()`` on every rank
    first), for a group without this rank, a mesh that is not 1-D, or scopes
    that overlap.
    """
    import torch.distributed as dist

    from .agreements import our_groups
    from .transport.scope import from_group

    if not (dist.is_available() and dist.is_initialized()):
        raise ScopeError(
            "compiler_collectives.scope() needs torch.distributed: call it after "
            "init_process_group, on every rank, before the first compile",
            kind="scope",
        )
    chosen = from_group(group, dist.get_rank(), dist.get_world_size())
    our_groups.use_scope(chosen)  # raises after a compile; runs the setup check for a scope


def install() -> None:
    """Install our implementation into torch._dynamo (done at import; idempotent)."""
    _runtime.install()


def uninstall() -> None:
    """Restore torch's own compiler and guard collectives (mostly for tests)."""
    _seams.uninstall()


def enable(*, compiler: bool = True, guards: bool | None = None) -> None:
    """Switch collectives on. ``guards=None`` leaves the guard collective as it is."""
    _runtime.install()
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
    from .agreements.once import records as once_records
    from .instrument import timing
    from .transport import groups

    out = _runtime.current().ledger.counters()
    # Compile once, per graph: compiled, served, loaded or compiled locally, and why.
    out["compile_once"] = once_records()
    # Which mechanism the guard collective runs on ("shm", "shm+leaders", "gloo"),
    # None before the first guard collective of this generation.
    out["guard_transport"] = groups.guard_transport()
    figures = timing.figures()
    if figures is not None:
        out["timing"] = figures
    return out


def reset_stats() -> None:
    """Zero the counters of ``stats()`` and drop its records (the ledger's)."""
    _runtime.reset_stats()


def reset() -> None:
    """Clear a failure on this rank, forget our groups and entry agreement; call on every rank together.

    Frames whose cache entries ran different collectives (checked on every
    call, ``docs/design.md`` "Entry agreement") lose their compiled entries
    too, and compile again at their next call.
    """
    _runtime.reset()


# The one thing importing the package does (runtime.py): read the settings, patch torch, wire
# the layers, register the fork handler. Where `doctor` runs, what patching torch raised.
install_error: UnsupportedTorchError | None = _runtime.install().install_error
