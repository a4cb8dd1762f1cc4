"""The counters of ``stats()`` that each graph's record adds to (``once_compiled``, ``once_loaded``,
...): one table from how a graph ended on this rank (the record's "ended") to the counter it
counts in, read where the protocol makes the record, so that a new way for a graph to end that
the table lacks is a ``KeyError`` the first time a test makes it, never a silent zero.

Counted elsewhere, as they happen: the exchanges (``once_exchanges``, ``once_keys_reduced``,
``once_tree_exchanges``, ``once_gathers``, ``once_report_entries``), the transfer's pieces, copies
and bytes (``transfer``), the time waited (``once_wait_s``: a rank also waits after its graph's
record, for the ranks that compile it themselves) and ``errors`` (an error may end a graph before
it has an outcome, and the counter is the whole package's). The peers that compiled a graph
themselves (``once_peer_local_compiles``) come from the record's "peers_local".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...stats import counters
from .plan import COMPILE, LOAD, LOCAL, SERVE

# How a graph ended on this rank (its record's "ended") -> the counter it adds one to.
COUNTED: dict[str, str | None] = {
    "compiled": "once_compiled",  # compiled it, for itself and the ranks that load it
    "served": "once_served",  # served the entry its cache held
    "local": "once_local",  # compiled it for itself alone (no match, not cacheable, torch's collectives)
    "loaded": "once_loaded",
    "miss": "once_load_misses",  # the entry it was sent failed its guards: it compiles the graph itself
    "refused": "once_refused",  # it refused the artifact: it compiles the graph itself
    "raised": None,  # its own compile raised: the user's error, or ours (counted in ``errors``)
    "source raised": None,  # its source's compile raised: it raises CompileOnceError (``errors``)
}

_BY_ROLE = {COMPILE: "compiled", SERVE: "served", LOCAL: "local"}
# A loader's ``Ticket.outcome``: "none" is left only when its source's compile raised.
_BY_LOAD = {"hit": "loaded", "miss": "miss", "refused": "refused", "none": "source raised"}


def ended(role: str, load: str, raised: bool) -> str:
    """How a graph ended on this rank (its record's "ended"): a loader's by its load
    (``Ticket.outcome``), any other rank's by its role, unless its own compile of the graph raised."""
    if role == LOAD:
        return _BY_LOAD[load]
    return "raised" if raised else _BY_ROLE[role]


def counts(record: Mapping[str, Any]) -> dict[str, int]:
    """The counters of ``stats()`` that one graph's record adds to, and by how much."""
    name = COUNTED[record["ended"]]
    out = {} if name is None else {name: 1}
    if record.get("peers_local"):  # the other ranks the load report named: they compiled it themselves
        out["once_peer_local_compiles"] = len(record["peers_local"])
    return out


def add(record: Mapping[str, Any]) -> None:
    """Add one graph's record to the counters of ``stats()``."""
    for name, n in counts(record).items():
        setattr(counters, name, getattr(counters, name) + n)
