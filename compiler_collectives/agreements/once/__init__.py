"""Compile once: among the ranks whose graphs have the same AOTAutograd cache key, one rank compiles
(or serves the entry its cache holds) and the others load what it made.

Flow, per graph that AOTAutograd looks up in its cache while compiler collectives are on (the
seam ``dynamo/once_seam.py`` calls in; every rank of the agreement scope takes every step, warm
or cold, so the exchanges never depend on cache state):

1. **Keys** (the machine's ``SettleKeys``, at the cache lookup): each rank's key (or why the
   graph is not cacheable here), whether its cache holds an entry, its cache dir's identity,
   which of torch's compile-time collectives are on, the largest artifact it accepts, and its
   build (``build``: the vector ISA, the C++ compiler and torch it builds kernels with). First one MIN of a
   fixed record over the host tree (``transport.HostTree``: a host's ranks through their leader,
   the leaders in log2(hosts) rounds): a digest of what must match (the switches, and the dirs
   and limits the last full exchange saw) and, per index on a host, the digest of that index's
   key and graph, its lowest holder and its warmest rank. Where each index's key is the same on
   every host (every rank's, or a GPU job's key per device), that settles it
   (``once_keys_reduced``): the bytes per rank do not grow with the world. Otherwise (a
   generation's first graph, keys that differ otherwise, a dir that changed) one table gather
   of every rank's offer over the same tree follows (``rows``: each distinct key, dir or graph
   travels and is decoded once, with a few ints per rank). ``decide`` turns
   that into a plan, the same on every rank: ranks whose key no other rank has, or whose graph is
   not cacheable, compile locally; so does every rank when any of torch's compile-time
   collectives is on (ranks that are not compiling could not join them). In each group of equal
   keys, the lowest rank that holds the entry serves it; otherwise the warmest rank compiles: one
   whose FX graph cache holds the compiles the key took there (``sidecar``), else the one whose
   cache dir holds the most FX graph entries; among equals (cold ranks too) one rank is chosen in
   turn across graphs so that the work spreads over ranks and hosts. The others load.
2. **Compile**: the serving or compiling rank runs AOTAutograd as usual (backward lowered with
   the forward, so the entry exists when the compile ends); local ranks compile; loading ranks
   wait inside the backend, for this graph only (waiting around a whole step would deadlock on
   DDP's all-reduce). They wait while the compiling rank is alive, up to
   ``COMPILER_COLLECTIVES_COMPILE_TIMEOUT``, logging about every 30 s.
3. **Result** (``ExchangeResults``, then ``Install`` or ``Serve``): once every serving rank has
   posted that it is done, each serving rank's outcome reaches every rank in one gather over
   the host tree, to which only the serving ranks contribute: the manifest of its artifact
   (every file of the cache entries and kernel binaries, relative to the cache dir, with its SHA-256) and the
   program audit's fingerprints of the compile, and the SHA-256 of each piece of its bundle. The
   manifest comes over the job's own gloo group; the bytes do not travel to ranks that share the
   serving rank's dir. In each other cache dir one rank receives them (``transfer``): those
   receivers form a tree rooted at the serving rank (``COMPILER_COLLECTIVES_ONCE_FANOUT``), each
   checks every piece before it forwards it (one whose check fails names who sent the bytes
   altered and takes the serving rank's own copy, sent to it directly), and the dir's other ranks
   read its install. A rank
   writes into its dir only received files whose SHA-256 matches, only for a key it computed
   itself; anything else is refused, named in the log, and that rank compiles the graph itself,
   AOTAutograd's lookup bypassed. Within a dir the trust is torch's own (its lookup reads every
   entry there): the checks are on the bytes that travel between dirs (docs/design.md, "Trust").
4. **Loaded** (``Report``): one MIN over the host tree of whether every rank loaded; only where
   some rank did not, one table gather over the tree of the outcomes of the ranks that did not
   (the others contribute nothing; each distinct reason once), so every rank logs and counts
   who loaded, whose load missed (an
   entry's guards fail that rank's size hints: it compiled locally) and who refused.

Failures: a serving rank whose compile raises publishes the error; its loaders raise
``CompileOnceError`` quoting it (the serving rank raises its own); so do the ranks waiting for a
rank that did not load and compiles the graph itself, when that compile raises. A serving rank
that dies is seen through its heartbeat or its broken gloo connection: the loaders raise
``PeerFailureError`` naming it; so does the subtree of a receiver that dies while it forwards.
Never a hang.

Modules: ``machine`` (one graph's states, the events that move it and the actions it asks
for: pure), ``driver`` (runs a graph's machine: the seam's events in, the actions out over the
exchanges, the mailbox and the artifact, each timed), ``graph`` (which graph, its times, its
errors and the record kept when it ends), ``plan`` (who does what: pure), ``keys`` (the key
record and the offers read back from it: pure), ``exchanges`` (the key, result and load-report
exchanges over the host tree), ``rows`` (the offers and the load outcomes gathered as tables
over the tree), ``waits`` (the mailbox: the posts and waits on the store),
``artifact`` (the files, their checks and their staged install, over a root dir), ``sidecar``
(the audit's fingerprints kept with an entry), ``transfer`` (each loader's route to the bytes,
the tree, the pieces and their checks), ``loading`` (a loader's receive and install by its
route) and ``tally`` (how a graph ended: the word the ledger counts it by). Plain Python over
``torch.distributed``; torch's cache internals are reached through the ``Cache`` the seam passes in.
"""

from . import build
from .artifact import dir_identity, manifest_problem, safe_relpath
from .driver import Driver, Spans, begin, current
from .graph import Cache, Graph, records
from .machine import NO_LOOKUP
from .plan import COMPILE, LOAD, LOCAL, SERVE, Plan, decide, fallback_allowed

__all__ = [
    "COMPILE",
    "LOAD",
    "LOCAL",
    "NO_LOOKUP",
    "SERVE",
    "Cache",
    "Driver",
    "Graph",
    "Plan",
    "Spans",
    "begin",
    "build",
    "current",
    "decide",
    "dir_identity",
    "fallback_allowed",
    "manifest_problem",
    "records",
    "safe_relpath",
]
