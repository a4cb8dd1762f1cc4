"""The guard collective's state of one generation: one object, replaced by the next generation's.

``state`` holds what the guard hook (``guard``) and the modules it calls read
and write: the number of the last guard collective, this generation's guard
channel, whether this generation has peers at all, whether this rank is apart
from its peers inside one call (``guard_paths``), the miss every rank last
agreed on, and the thread that owns this rank's collectives
(``guard_owner``). Readers read ``guard_state.state`` anew (the hook once
per call, after ``groups.notice()``, which may start a new generation):
nobody keeps it across a moment.

The runtime builds each generation's (``GuardState.next``: the owning thread
is carried over, since releasing it would let each rank's threads race for it
anew; a forked child's starts fresh) and hands it over with ``adopt``.
Nothing is zeroed in place but the guard channel at ``let_go`` (the default
group is about to go: its store must go with it).
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from ..transport import GuardChannel, groups


class GuardState:
    __slots__ = ("agreed_miss", "apart", "channel", "owner", "owner_thread", "seq", "solo")

    def __init__(self, owner: int = 0, owner_thread: threading.Thread | None = None) -> None:
        self.seq = 0
        # Ranks took different graph-break paths through one call of a frame (see
        # ``guard_paths.paths_diverged``): calls made from inside compiled code decide
        # alone until this rank is back at a call from the user's own code.
        self.apart = False
        # This generation's channel (``groups.notice()`` ends the generation when it finds a new
        # default group, and the next generation's state has none yet).
        self.channel: GuardChannel | None = None
        # The thread that runs compiled code with guards on (see ``guard``'s docstring); 0: none yet.
        self.owner = owner
        self.owner_thread = owner_thread
        self.solo = False  # this generation's default group has one rank: no collective
        # (seq, this rank missed) of the last call where some rank missed;
        # the compile that follows exchanges why (guard.take_agreed_miss).
        self.agreed_miss: tuple[int, bool] | None = None

    def next(self) -> GuardState:
        """The next generation's state: nothing of this one's but the owning thread."""
        return GuardState(self.owner, self.owner_thread)


state = GuardState()


def adopt(new: GuardState) -> None:
    """Make ``new`` (the runtime built it) the state every reader reads from now on."""
    global state
    state = new


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


def let_go() -> None:
    """The default group is about to go: drop what holds its store (the rest goes with the
    generation, once the group ended)."""
    state.channel = None
