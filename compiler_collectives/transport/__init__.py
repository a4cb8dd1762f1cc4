"""The transport layer: how our collectives move bytes between ranks.

One module per mechanism, and one for the groups they run on:

* ``gloo``: dedicated gloo groups; the compiler collective's byte all-gather
  and the guard collective's all-reduce path;
* ``shm``: one shared-memory segment per host, where a host's ranks agree on
  a guard outcome in microseconds;
* ``hierarchy``: which ranks share a host, the segment's set-up, and the host
  leaders' log-depth exchange; it builds the guard channel;
* ``groups``: lazily created groups (after the first rendezvous, the
  agreements layer's setup check, wired at install), the store side channel,
  and the teardown at interpreter exit. What a failure means for the job is
  decided above this layer (``agreements/failure.py``).

The layer above (the agreements) imports only what this module exports
(``tests/test_layering.py`` checks it).
"""

from .gloo import (
    PHASE_INPUTS,
    PHASE_TRACE,
    PROTOCOL_VERSION,
    GlooGuardChannel,
    GuardChannel,
    all_gather_bytes,
    guard_key,
    translate_failure,
)
from .groups import Groups, groups, report_error, set_first_rendezvous
from .hierarchy import ShmGuardChannel
from .scope import Scope
from .shm import LAYOUT_VERSION as SHM_LAYOUT_VERSION

__all__ = [
    "PHASE_INPUTS",
    "PHASE_TRACE",
    "PROTOCOL_VERSION",
    "SHM_LAYOUT_VERSION",
    "GlooGuardChannel",
    "Groups",
    "GuardChannel",
    "Scope",
    "ShmGuardChannel",
    "all_gather_bytes",
    "groups",
    "guard_key",
    "report_error",
    "set_first_rendezvous",
    "translate_failure",
]
