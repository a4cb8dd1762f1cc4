"""The transport layer: how our collectives move bytes between ranks.

One module per concern:

* ``gloo``: dedicated gloo groups; the compiler collective's byte all-gather
  and the guard collective's all-reduce path;
* ``channel``: ``GuardChannel``, the interface every guard mechanism offers
  the agreements;
* ``segment``: one shared-memory segment per host: its layout, creation,
  checks, registration and removal (leaked segments of dead jobs included);
* ``shm``: the wait protocol over a segment, where a host's ranks agree on a
  guard outcome in microseconds (publish, wait, the failure word, sleepers);
* ``futex``: the kernel sleeps and wake-ups the wait protocol uses;
* ``hierarchy``: which ranks share a host, the segment's set-up, and the host
  leaders' log-depth exchange; it builds the guard channel;
* ``hosttree``: a tree over a group's ranks by host (host leaders, recursive
  doubling between them; a MIN and a gather, each telling a peer in another
  exchange at its first message): compile once's exchanges in O(log hosts) steps;
* ``groups``: lazily created groups (after the first rendezvous, the
  agreements layer's setup check, wired at install), the store side channel,
  and the teardown at interpreter exit;
* ``scope``: which ranks our groups span.

Transport reports what it saw; what a failure means for the job is decided
above this layer (``agreements/failure.py``), whose handler of a peer's
failure report is wired here at install (``set_peer_report_handler``).

The layer above (the agreements) imports only what this module exports
(``tests/test_layering.py`` checks it).
"""

from .channel import GuardChannel
from .gloo import (
    PHASE_INPUTS,
    PHASE_ONCE_KEYS,
    PHASE_ONCE_LOADED,
    PHASE_ONCE_RESULT,
    PHASE_TRACE,
    PROTOCOL_VERSION,
    GlooGuardChannel,
    all_gather_bytes,
    broken_connection,
    broken_peers,
    byte_tensor,
    guard_key,
    is_connection_failure,
    set_enqueue_context,
    start_recv,
    start_send,
    tensor_view,
    translate_failure,
    wait,
)
from .groups import Groups, PeerReportHandler, groups, set_first_rendezvous, set_peer_report_handler
from .hierarchy import ShmGuardChannel
from .hosttree import HostTree, run_p2p
from .scope import Scope
from .segment import LAYOUT_VERSION as SHM_LAYOUT_VERSION

__all__ = [
    "PHASE_INPUTS",
    "PHASE_ONCE_KEYS",
    "PHASE_ONCE_LOADED",
    "PHASE_ONCE_RESULT",
    "PHASE_TRACE",
    "PROTOCOL_VERSION",
    "SHM_LAYOUT_VERSION",
    "GlooGuardChannel",
    "Groups",
    "GuardChannel",
    "HostTree",
    "PeerReportHandler",
    "Scope",
    "ShmGuardChannel",
    "all_gather_bytes",
    "broken_connection",
    "broken_peers",
    "byte_tensor",
    "groups",
    "guard_key",
    "is_connection_failure",
    "run_p2p",
    "set_enqueue_context",
    "set_first_rendezvous",
    "set_peer_report_handler",
    "start_recv",
    "start_send",
    "tensor_view",
    "translate_failure",
    "wait",
]
