"""Our own rendezvous on the store, before each group of a generation after its first.

Every rank sets ``join/<name>/<rank>`` under the generation's prefix and waits
for its peers' keys, bounded by the caller's timeout (``COMPILER_COLLECTIVES_TIMEOUT``),
so that a rank that never comes is named instead of blocking group creation
for torch's 30-minute default. The first rendezvous of a generation is the
agreements' setup check (``setup/...`` keys), which transport runs instead.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

from .calls import bounded, count_requests


def meet(store: Any, rank: int, peers: Iterable[int], name: str, timeout_s: float) -> list[int]:
    """Wait until every rank of ``peers`` reached ``name`` on ``store`` (a generation's prefix,
    ``SideChannel.store``); returns the absent ranks ([] on success)."""
    members = list(peers)
    keys = [f"join/{name}/{r}" for r in members]

    def join() -> list[int]:
        count_requests(2)
        store.set(f"join/{name}/{rank}", "1")
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout_s))
            return []
        except Exception:  # noqa: BLE001 - c10d raises DistStoreError/RuntimeError
            count_requests(1 + len(keys))
            return [r for r, key in zip(members, keys) if not store.check([key])]

    return bounded(join, timeout_s + 5.0, f"at the {name} rendezvous")
