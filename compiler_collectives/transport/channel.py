"""What a guard channel is: the one interface both guard mechanisms offer the agreements.

``gloo.GlooGuardChannel`` (one all-reduce per call) and
``hierarchy.ShmGuardChannel`` (shared memory within a host, leaders between
hosts) both satisfy ``GuardChannel``; ``hierarchy.build_guard_channel`` picks
one per generation of our groups. The agreements type every channel they hold
as ``GuardChannel`` and use nothing else of it.
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist


class GuardChannel(Protocol):
    """A guard collective's transport, built on every rank of its group together."""

    @property
    def pg(self) -> dist.ProcessGroup:
        """The gloo guard group of every rank the channel spans (the slow path runs on it)."""
        ...

    @property
    def name(self) -> str:
        """The mechanism: "gloo", "shm" or "shm+leaders"."""
        ...

    @property
    def check_desync(self) -> bool:
        """Whether ``agree`` also says if every rank is at the same call of the same frame."""
        ...

    def agree(self, hit: bool, seq: int, site: int = 0) -> tuple[bool, bool]:
        """One guard collective: (every rank hit, every rank at the same call of the same frame)."""
        ...

    def describe_all(self, seq: int, site: int) -> list[tuple[int, int]]:
        """Slow path after a mismatch (every rank takes it): each rank's (seq, site)."""
        ...

    def publish_failure(self, rank: int, left: bool = False) -> None:
        """Tell the ranks that wait on this channel that ``rank`` failed (or, ``left``, left the
        job), where the mechanism has a faster way than the store report."""
        ...
