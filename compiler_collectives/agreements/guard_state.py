"""The guard collective's state: one object, and the moments that clear it.

``state`` holds what the guard hook (``guard``) and the modules it calls read
and write: the number of the last guard collective, this generation's guard
channel, whether this generation has peers at all, whether this rank is apart
from its peers inside one call (``guard_paths``), the miss every rank last
agreed on, and the thread that owns this rank's collectives
(``guard_owner``). The hook reads it as a module global of its own (it imports
``state``), so keeping it here costs the hook's fast path nothing.

What clears it: each moment that ends a generation clears the generation's
part (``reset_sequence``); the owning thread is kept across them, since
releasing it would let each rank's threads race for it anew; a forked child
starts from a fresh state (``after_fork_in_child``).
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from .. import process_state
from ..transport import GuardChannel, groups


class GuardState:
    __slots__ = ("agreed_miss", "apart", "channel", "owner", "owner_thread", "seq", "solo")

    def __init__(self) -> None:
        self.seq = 0
        # Ranks took different graph-break paths through one call of a frame (see
        # ``guard_paths.paths_diverged``): calls made from inside compiled code decide
        # alone until this rank is back at a call from the user's own code.
        self.apart = False
        # This generation's channel; the moments that end a generation clear it, and
        # ``groups.notice()`` runs theirs when it finds a new default group.
        self.channel: GuardChannel | None = None
        # The thread that runs compiled code with guards on (see ``guard``'s docstring); 0: none yet.
        self.owner = 0
        self.owner_thread: threading.Thread | None = None
        self.solo = False  # this generation's default group has one rank: no collective
        # (seq, this rank missed) of the last call where some rank missed;
        # the compile that follows exchanges why (guard.take_agreed_miss).
        self.agreed_miss: tuple[int, bool] | None = None


state = GuardState()


def with_peers() -> bool:
    """Whether this process is one of several ranks (else there is nobody to agree with)."""
    if not dist.is_initialized() or state.solo:
        return False
    if not groups.available():  # a forked child: the default group is its parent's
        return False
    if dist.get_world_size() == 1:
        state.solo = True
        return False
    return True


@process_state.clears(
    process_state.RESET,
    process_state.GROUP_DESTROYED,
    names=("state",),
    what="the guard collective's sequence number, channel and default group",
)
def reset_sequence() -> None:
    state.seq = 0
    state.apart = False
    state.channel = None
    state.agreed_miss = None
    state.solo = False


@process_state.clears(process_state.GROUP_ENDING, names=("state",), what="the guard channel (it holds the store)")
def let_go() -> None:
    """The default group is about to go: drop what holds its store (the rest goes after)."""
    state.channel = None


@process_state.clears(process_state.FORK, names=("state",), what="the guard collective's state and its owning thread")
def after_fork_in_child() -> None:
    """A forked child: a fresh state. The parent's channel (its segment mapping, its
    gloo group) stays referenced by ``groups`` and is never used here."""
    reset_sequence()
    state.owner = 0
    state.owner_thread = None
