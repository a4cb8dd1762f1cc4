"""The agreements: what the ranks agree on, each in its own module.

* ``compiler``: the compiler collective (every rank's observations at a
  frame's first trace, and the restart decision);
* ``guard``: the guard collective (hit or miss, on every compiled call);
* ``audit`` with ``fingerprint``: the program audit (the same collectives in
  every rank's compiled graphs);
* ``entry``: entry agreement (every rank runs a cache entry with the same
  collective program);
* ``reasons``: every rank's recompile reasons after an agreed miss;
* ``setup`` and ``scope``: the setup check at each generation's first
  rendezvous (versions and settings across the job; a scope's ranks);
* ``exchange``: the one all-gather frame the byte exchanges share;
* ``failure``: what an agreement does when its exchange fails;
* ``wire``: the msgpack payloads, versioned and validated;
* ``lifecycle``: reset, a destroyed default group, a forked child.

Plain Python over ``torch.distributed``; the Dynamo seam (``dynamo/``) calls in.
"""

# Importing these registers their policy with the layers below: the failure procedure's
# handler of a peer's report and explainer (failure.connect), the setup check as
# transport's first rendezvous (scope).
from . import failure, scope  # noqa: F401
