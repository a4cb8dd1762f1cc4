"""Torch's internals as the seam modules use them, bound once at install.

``install`` resolves every row of the seam table, then fills these names;
the seam modules read them at call time. Before install they are None (and
``originals`` empty): nothing here runs before install.
"""

from __future__ import annotations

from typing import Any

# Whether our implementation is swapped into torch now.
installed = False
# Torch's own object for every seam we replaced or read, by seam name.
originals: dict[str, Any] = {}
# The torch modules patched, by short name ("convert_frame", "pgo", ...).
modules: dict[str, Any] = {}

pgo: Any = None  # torch._dynamo.pgo
exc: Any = None  # torch._dynamo.exc
dynamo_timed: Any = None  # torch._dynamo.utils.dynamo_timed
guards: Any = None  # torch._dynamo.guards (its recompile loggers)
trace_structured: Any = None  # torch._logging.trace_structured


def original(name: str) -> Any:
    """Torch's own object that seam ``name`` replaced; KeyError before install or for an unknown name."""
    return originals[name]
