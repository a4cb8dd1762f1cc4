"""The one torch.distributed function we wrap: ``destroy_process_group``.

When the default group is destroyed, everything of ours that belongs to its
generation (our gloo groups, the store they and the heartbeat hold, the guard
channel, sequence numbers, a failure) must go at once, as
``compiler_collectives.reset()`` would drop it, without the user calling it:
a later ``init_process_group`` on the same port must find the old store's
server gone, and our next collective must start a new generation. Noticing
the change only at our next collective would be too late for the port.
What runs is the package runtime's moments (``bound.moments``, handed in at
install): this layer may not import the one above it.

In two steps around torch's own destroy: before it, we let go of the store
(references dropped, threads told to stop: microseconds), so that torch's
teardown drops the store's last reference and its server closes within
torch's own time; after it, the moment that ends our generation runs. A peer
that finished its destroy first and re-initializes on the same port at once
would otherwise connect to the old server while ours is still up, and both
ranks hang (one binding the port, the other waiting on the old store).

Both names users call it by are rows of the seam table
(``torch.distributed`` and ``torch.distributed.distributed_c10d``). Code that
took a reference to the function before our import calls torch's own; then
``transport.groups.notice()``, the one place that notices a new default group,
runs the same moment when it first sees the next one.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..transport import groups
from . import bound

log = logging.getLogger("compiler_collectives.c10d")


def wrap_destroy(original: Callable[..., Any]) -> Callable[..., Any]:
    """``destroy_process_group``, then drop our generation if the default group went."""

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        had_default = dist.is_initialized()
        # A subgroup's destroy is torch's alone: nothing of ours goes with it.
        ending = groups.ends_the_default_group(kwargs["group"] if "group" in kwargs else (args[0] if args else None))
        if ending:
            try:
                bound.moments.default_group_ending()
            except Exception as e:  # noqa: BLE001 - never fail the user's destroy
                log.warning("letting go of the default group's store failed: %s", e)
        try:
            return original(*args, **kwargs)
        finally:
            # Once we let go, a new generation starts even if torch's destroy raised.
            if ending or (had_default and not dist.is_initialized()):
                try:
                    bound.moments.default_group_destroyed()
                except Exception as e:  # noqa: BLE001 - never fail the user's destroy
                    log.warning("dropping our state with the destroyed default group failed: %s", e)

    return destroy_process_group
