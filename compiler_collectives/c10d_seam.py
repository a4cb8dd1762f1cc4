"""The one torch.distributed function we wrap: ``destroy_process_group``.

When the default group is destroyed, everything of ours that belongs to its
generation (our gloo groups, the store they and the heartbeat hold, the guard
channel, sequence numbers, a failure) must go at once, as
``compiler_collectives.reset()`` would drop it, without the user calling it:
a later ``init_process_group`` on the same port must find the old store's
server gone, and our next collective must start a new generation. Noticing
the change only at our next collective would be too late for the port.

Both names users call it by are wrapped (``torch.distributed`` and
``torch.distributed.distributed_c10d``). Code that took a reference to the
function before our import calls torch's own; our groups then notice the new
default group at their next use, as before.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

log = logging.getLogger("compiler_collectives.c10d")

_original: Callable[..., Any] | None = None
_on_destroyed: Callable[[], None] | None = None


def install(on_default_group_destroyed: Callable[[], None]) -> None:
    """Wrap ``destroy_process_group`` (idempotent): call ``on_default_group_destroyed``
    after the default group is gone."""
    global _original, _on_destroyed
    _on_destroyed = on_default_group_destroyed
    if _original is not None or not dist.is_available():
        return
    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        world = dist.group.WORLD
        try:
            return original(*args, **kwargs)
        finally:
            if world is not None and dist.group.WORLD is not world and _on_destroyed is not None:
                try:
                    _on_destroyed()
                except Exception as e:  # noqa: BLE001 - never fail the user's destroy
                    log.warning("dropping our state with the destroyed default group failed: %s", e)

    _original = original
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def uninstall() -> None:
    global _original
    if _original is not None:
        c10d.destroy_process_group = _original
        dist.destroy_process_group = _original
        _original = None
