"""The Dynamo seam: the only part of the package that touches torch's private internals.

Every torch internal the package replaces or relies on (Dynamo's, and one
function of ``torch.distributed``) is a row of ``table.SEAMS``, checked at
install. One module per concern:

* ``table``: the seam table and its checks;
* ``install``: check, patch, unpatch (transactional);
* ``bound``: torch's internals as the seam modules read them, each resolved
  from its row (and the generic patch of a row, optional levels included);
* ``wiring``: the one place every setter and registry of the layers below
  is connected, at install;
* ``convert``: our ``SizeEntry`` <-> Dynamo's ``FrameStateSizeEntry``;
* ``compiler_seam``: the compiler collective inside Dynamo's first trace;
* ``guard_seam``: torch's guard switch and the C++ guard-hook slot;
* ``tooling``: structured-trace artifacts and recompile reasons;
* ``audit_seam``: the program audit's view of each compiled graph, and the
  entry check wrapped around what the backend returns;
* ``c10d_seam``: ``destroy_process_group``, so a re-init starts afresh.

Everything above this package (the agreements) is plain Python over
``torch.distributed``.
"""

from __future__ import annotations

from .audit_seam import missing_backend_seams as missing_audit_backend_seams
from .bound import original as torch_original
from .compiler_seam import compiler_collectives_flag, forget_entries, set_compiler_collectives_flag
from .convert import entry_from_torch, entry_to_torch
from .guard_seam import hook_active as guard_hook_active
from .guard_seam import set_guard_hook
from .install import (
    SUPPORTED_TORCH,
    TESTED_TORCH,
    check_seams,
    install,
    installed,
    missing_seams,
    supported_range,
    uninstall,
    version_supported,
)
from .table import SEAMS

__all__ = [
    "SEAMS",
    "SUPPORTED_TORCH",
    "TESTED_TORCH",
    "check_seams",
    "compiler_collectives_flag",
    "entry_from_torch",
    "entry_to_torch",
    "forget_entries",
    "guard_hook_active",
    "install",
    "installed",
    "missing_audit_backend_seams",
    "missing_seams",
    "set_compiler_collectives_flag",
    "set_guard_hook",
    "supported_range",
    "torch_original",
    "uninstall",
    "version_supported",
]
