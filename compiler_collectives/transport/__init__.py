"""The transport layer: how our collectives move bytes between ranks.

One module per concern:

* ``gloo``: the byte all-gather of the compiler collective, the guard
  collective's all-reduce path, the sliced wait on a gloo operation, and the
  translation of gloo's errors; ``Phases``, how a caller names its exchanges;
* ``probes``: whether this rank's gloo connection to a peer broke (connection
  probes; which members' connections broke after a failure);
* ``channel``: ``GuardChannel``, the interface every guard mechanism offers
  the agreements;
* ``segment``: one shared-memory segment per host: its layout, creation,
  checks, registration and removal (leaked segments of dead jobs included);
* ``shm``: the wait protocol over a segment, where a host's ranks agree on a
  guard outcome in microseconds (publish, wait, the failure word, sleepers);
* ``futex``: the kernel sleeps and wake-ups the wait protocol uses;
* ``hierarchy``: which ranks share a host, the segment's set-up, and the host
  leaders' log-depth exchange; it builds the guard channel;
* ``p2p``: point-to-point exchanges waited for in slices on a helper thread
  (``run_p2p``), and Bruck's all-gather of one int per rank;
* ``hosttree``: a tree over a group's ranks by host (host leaders, recursive
  doubling between them; a MIN and a gather, each telling a peer in another
  exchange at its first message): a caller's exchanges in O(log hosts) steps;
* ``table``: ``Table``, what the host tree's table gather folds and returns:
  rows by rank, each column's distinct values once;
* ``generation``: a generation's groups and its lifecycle (``notice()`` of
  a new default group, reset, destroy, fork, exit); the runtime builds each
  one and hands it over (``adopt``);
* ``groups``: building our groups into the generation (after the first
  rendezvous, the agreements layer's setup check, wired at install), the store
  side channel, a scope's own groups;
* ``facade``: ``groups``, the one object the agreements call: our groups,
  ``scope()``'s choice and setup check, and what they do with peers over the
  side channel (a failure to build raises; the agreements' ``our_groups``
  puts it through their failure procedure); and this layer's steps of the
  runtime's moments (``forget``, ``let_go``, ``default_group_destroyed``,
  ``forked_child_generation``);
* ``scope``: which ranks our groups span.

Transport reports what it saw; what a failure means for the job is decided
above this layer (``agreements/failure.py``), whose handler of a peer's
failure report is wired here at install (``set_peer_report_handler``). The
callers number and name their exchanges (``Phases``): this layer knows none.

The layer above (the agreements) imports only what this module exports
(``tests/contract/test_layering.py`` checks it).
"""

from .channel import GuardChannel
from .facade import (
    Groups,
    adopt,
    default_group_destroyed,
    forget,
    forked_child_generation,
    groups,
    let_go,
)
from .generation import Generation
from .gloo import (
    PROTOCOL_VERSION,
    GlooGuardChannel,
    Phases,
    all_gather_bytes,
    byte_tensor,
    guard_key,
    is_connection_failure,
    start_recv,
    start_send,
    tensor_view,
    translate_failure,
    wait,
)
from .groups import PeerReportHandler, set_first_rendezvous, set_peer_report_handler
from .hierarchy import ShmGuardChannel
from .hosttree import HostTree
from .p2p import run_p2p
from .probes import broken_connection, broken_peers
from .scope import Scope
from .segment import LAYOUT_VERSION as SHM_LAYOUT_VERSION
from .table import Table

__all__ = [
    "PROTOCOL_VERSION",
    "SHM_LAYOUT_VERSION",
    "Generation",
    "GlooGuardChannel",
    "Groups",
    "GuardChannel",
    "HostTree",
    "PeerReportHandler",
    "Phases",
    "Scope",
    "ShmGuardChannel",
    "Table",
    "adopt",
    "all_gather_bytes",
    "broken_connection",
    "broken_peers",
    "byte_tensor",
    "default_group_destroyed",
    "forget",
    "forked_child_generation",
    "groups",
    "guard_key",
    "is_connection_failure",
    "let_go",
    "run_p2p",
    "set_first_rendezvous",
    "set_peer_report_handler",
    "start_recv",
    "start_send",
    "tensor_view",
    "translate_failure",
    "wait",
]
