"""How a graph ended on this rank under compile once: its record's "ended", the one word the
ledger counts it by (``ledger.ONCE_ENDED``: ``once_compiled``, ``once_loaded``, ...), so that a
new way for a graph to end that the ledger's table lacks is a ``KeyError`` the first time a
test makes it, never a silent zero.

The peers that compiled a graph themselves (``once_peer_local_compiles``) and the time waited
(``once_wait_s``) come from the record too. The exchanges and the transfer are records of their
own, and an error (``errors``) is one too.
"""

from __future__ import annotations

from .plan import COMPILE, LOAD, LOCAL, SERVE

_BY_ROLE = {COMPILE: "compiled", SERVE: "served", LOCAL: "local"}
# A loader's outcome (``machine.State.outcome``): "none" is left only when its source's compile raised.
_BY_LOAD = {"hit": "loaded", "miss": "miss", "refused": "refused", "none": "source raised"}


def ended(role: str, load: str, raised: bool, failed: bool = False) -> str:
    """How a graph ended on this rank (its record's "ended"): "failed" where an action of ours
    failed and ended it; a loader's by its load, any other rank's by its role, unless its own
    compile of the graph raised."""
    if failed:
        return "failed"
    if role == LOAD:
        return _BY_LOAD[load]
    return "raised" if raised else _BY_ROLE[role]
