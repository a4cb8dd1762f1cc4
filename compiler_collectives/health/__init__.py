"""Whether our collectives are still usable on this rank, and errors waiting to surface.

``latch`` (a ``health/latch.py`` ``Latch``) holds the first failure on this
rank (or a peer's report of one), after which every later collective refuses
(``latch.check``) until ``compiler_collectives.reset()``, and the error the
guard hook parked for its thread's next compile to raise. Only the failure
procedure (``agreements/failure.py``) poisons it; everyone else checks it,
reads ``latch.first_failure`` or parks on it.

One latch per generation: the runtime builds each generation's, taking over
the explainer that install wired (``failure.connect``), and binds it here
(``adopt``). So nobody keeps a latch: each use reads
``health.latch`` anew, as the guard hook does on every call (a module
attribute and a plain attribute read on its fast path, as before).
"""

from __future__ import annotations

from .latch import Latch

# The latch of this generation: its first failure and each thread's parked error.
latch = Latch()


def adopt(new: Latch) -> None:
    """Make ``new`` (the runtime built it for a new generation) the latch every use reads."""
    global latch
    latch = new
