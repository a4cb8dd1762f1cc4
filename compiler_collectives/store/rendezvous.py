"""Our own rendezvous on the store, before each group of a generation after its first.

Every rank sets ``join/<name>/<rank>`` under the generation's prefix and waits
for its peers' keys, bounded by the caller's timeout (``COMPILER_COLLECTIVES_TIMEOUT``),
so that a rank that never comes is named instead of blocking group creation
for torch's 30-minute default. The first rendezvous of a generation is the
agreements' setup check (``setup/...`` keys), which transport runs instead.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterable
from typing import Any

from .calls import bounded, count_requests

SLICE_S = 0.25
"""How often a waiting rank looks whether it heard of a failure (one store request each)."""


def meet(
    store: Any,
    rank: int,
    peers: Iterable[int],
    name: str,
    timeout_s: float,
    heard: Callable[[], BaseException | None] = lambda: None,
) -> list[int]:
    """Wait until every rank of ``peers`` reached ``name`` on ``store`` (a generation's prefix,
    ``SideChannel.store``); returns the absent ranks ([] on success).

    Waits in slices: between two, ``heard()`` returning an error ends the wait by raising it.
    A peer that failed before it came reports it on the store, and this rank's heartbeat
    thread hears the report; the wait then ends at once, not at the timeout.
    """
    members = list(peers)
    keys = [f"join/{name}/{r}" for r in members]

    def join() -> list[int]:
        count_requests(1)
        store.set(f"join/{name}/{rank}", "1")
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            count_requests(1)
            try:
                store.wait(keys, datetime.timedelta(seconds=max(0.001, min(SLICE_S, left))))
                return []
            except Exception:  # noqa: BLE001 - c10d raises DistStoreError/RuntimeError on a timeout
                pass
            error = heard()
            if error is not None:
                raise error
            if time.monotonic() >= deadline:
                count_requests(len(keys))
                return [r for r, key in zip(members, keys) if not store.check([key])]

    return bounded(join, timeout_s + 5.0, f"at the {name} rendezvous")
