"""Which thread owns this rank's guard and compiler collectives, and the refusal of any other.

One Python thread per rank owns our collectives: the thread of the rank's
first compiled call, a compiling one included (the compile entry point claims
through ``claim_for_compile``, since a frame's first call never reaches the
guard hook), until it ends. Each call and each compile is a collective
numbered in call order, and two threads' calls interleave differently on each
rank, so any other thread's call is refused before it enters any exchange:
the hook parks ``ConcurrentThreadsError`` for that thread only
(``claim_or_park``), and the compile entry point raises it. The owner is kept
in ``guard_state.state`` (the hook's fast path compares thread idents with it);
this module decides who it is.
"""

from __future__ import annotations

import logging
import threading

import torch.distributed as dist

from .. import health
from ..errors import ConcurrentThreadsError
from . import guard_state
from .guard_state import with_peers

log = logging.getLogger("compiler_collectives.guard")

_get_ident = threading.get_ident
_claim_lock = threading.Lock()


def after_fork_in_child() -> None:
    """A forked child: a fresh lock (the parent's may have been held by a thread the child lacks)."""
    global _claim_lock
    _claim_lock = threading.Lock()


class _OwnerMark:
    """Kept in the owner's thread-local storage, which Python drops as that thread ends.

    Thread idents are reused at once: a new thread can get the ended owner's
    ident and pass the hook's fast path (an ident comparison) as if it owned
    the rank, on this rank and not on another. Dropping the mark frees the
    ownership before the ident can be reused. It runs in the ending thread:
    no lock (the owner is still alive, so no other thread can claim meanwhile)
    and no ``threading`` calls.
    """

    __slots__ = ("thread",)

    def __init__(self, thread: threading.Thread) -> None:
        self.thread = thread

    def __del__(self) -> None:
        try:
            if guard_state.state.owner_thread is self.thread:
                guard_state.state.owner = 0
                guard_state.state.owner_thread = None
        except Exception:  # noqa: BLE001 - at interpreter exit our globals may be gone
            pass


_owner_mark = threading.local()


def _claim() -> threading.Thread | None:
    """Slow path: this thread is not the owner. It becomes it if there is none (or the
    owner ended); otherwise returns the owner, whose collectives this thread must not join."""
    me = threading.current_thread()
    with _claim_lock:
        state = guard_state.state
        owner = state.owner_thread
        if owner is None or owner is me or not owner.is_alive():
            if owner is not None and owner is not me:
                log.debug("thread %r now owns this rank's collectives (thread %r ended)", me.name, owner.name)
            if getattr(_owner_mark, "mark", None) is None:  # a thread's mark is always its own
                _owner_mark.mark = _OwnerMark(me)
            state.owner_thread = me
            state.owner = _get_ident()
            return None
    return owner


def claim_or_park() -> bool:
    """The hook's thread check: True if this thread owns the rank's collectives; else park
    the refusal for this thread's compile to raise (the hook must not raise) and return False."""
    owner = _claim()
    if owner is None:
        return True
    me = threading.current_thread()
    rank = dist.get_rank() if dist.is_initialized() else None
    health.latch.park(
        ConcurrentThreadsError(
            f"guard collective on rank {rank}: thread {me.name!r} (id {me.ident}) called compiled code "
            f"while thread {owner.name!r} (id {owner.ident}) is the one running compiled code on this "
            "rank. Only one thread may run compiled code with guard collectives on: every call is a "
            "collective numbered in call order, and two threads' calls would interleave differently on "
            "each rank. This call did not run and the other thread's collectives are unaffected. Run "
            "compiled code from one thread per rank, or switch guard collectives off "
            "(COMPILER_COLLECTIVES_GUARDS=0).",
            kind="guard",
            rank=rank,
            seq=guard_state.state.seq,
        )
    )
    return False


def claim_for_compile(frame: str) -> None:
    """The compile entry point's thread check, before any exchange of the compile.

    A frame's first call compiles without reaching the hook, so the owner is
    also claimed here: the thread of the rank's first compiled call owns its
    collectives. Raises ``ConcurrentThreadsError`` in any other thread; the
    caller decides whether this compile runs collectives at all.
    """
    if _get_ident() == guard_state.state.owner or not with_peers():
        return
    owner = _claim()
    if owner is None:
        return
    me = threading.current_thread()
    rank = dist.get_rank()
    raise ConcurrentThreadsError(
        f"compiler collective on rank {rank}: thread {me.name!r} (id {me.ident}) called {frame}, which "
        f"needs compiling, while thread {owner.name!r} (id {owner.ident}) is the one compiling and "
        "running compiled code on this rank. Only one thread per rank may compile with compiler or "
        "guard collectives on: every compile is a collective numbered in compile order, and two "
        "threads' compiles would interleave differently on each rank. This call did not run (nothing "
        "was compiled or sent to the other ranks) and the other thread is unaffected. Compile and run "
        "compiled code from one thread per rank (keep other threads eager), or switch compiler and "
        "guard collectives off (TORCH_COMPILER_COLLECTIVES=0, COMPILER_COLLECTIVES_GUARDS=0).",
        kind="compiler",
        rank=rank,
        frame=frame,
    )
