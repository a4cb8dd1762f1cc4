"""When the guard collective goes wrong: the desync message, and what the hook parks.

The hook must never raise (an exception inside it aborts the process from
C++), so each way out is parked in the latch for the compile that follows to
raise at the user's call site:

* a failed collective (``park_failure``): through the failure procedure
  (``failure.fail``), as an entry check's transport failure is too
  (``translate_entry_failure``). A desync is one: the hook raises ``desync``'s
  error, which says who was where (``describe_mismatch``, one more exchange);
* ``KeyboardInterrupt`` (``park_interrupt``): stays itself, told to nobody
  (Ctrl-C usually reaches every rank at once: ``failure.INTERRUPTED``);
* an exception the user's own signal handler raised while this rank waited
  (``raised_by_signal_handler``, ``park_left``): stays itself; the peers are
  told that this rank left, not that a collective failed (``failure.LEFT``).

In each case the failure procedure poisons this rank: its later collectives refuse.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

import torch.distributed as dist

from .. import health
from ..errors import SCOPE_HINT, CollectiveDesyncError, CollectiveError, describe
from ..transport import GuardChannel, groups
from . import failure, guard_state
from .guard_frames import TORCH_DIR, in_compiled_code
from .guard_paths import EMPTY, NESTED


def describe_mismatch(channel: GuardChannel, seq: int, site: int, caller: Any) -> list[tuple[int, int]]:
    """Every rank saw the mismatch: one more exchange to say who was where."""
    flag = NESTED if in_compiled_code(caller) else 0
    try:
        return channel.describe_all(seq, site | flag)
    except Exception:  # noqa: BLE001 - the message is less precise, the error stands
        return []


def desync(channel: GuardChannel, seq: int, site: int, everyone: list[tuple[int, int]]) -> CollectiveDesyncError:
    """The desync error, called from the guard hook itself (it names the hook's caller)."""
    members = groups.member_ranks(channel.pg)  # global ranks, under a scope too
    rank = members[channel.pg.rank()]
    caller: FrameType | None = sys._getframe(2)
    while caller is not None and caller.f_code.co_filename.startswith(TORCH_DIR):
        caller = caller.f_back
    here = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else "?"
    mine_seq = [s for s, _ in everyone] or [seq]
    lines = "\n".join(
        f"  rank {members[i]}: guard collective #{s}, compiled frame id {f & (NESTED - 1):#x}"
        + (" (called from compiled code)" if f & NESTED else "")
        if s >= 0
        # the entry check's slow path sends (-seq, entry index): see agreements/entry.py
        else f"  rank {members[i]}: checking which cache entry it runs (entry #{f & (EMPTY - 1)}) "
        f"after guard collective #{-s}"
        for i, (s, f) in enumerate(everyone)
    )
    if any(s < 0 for s in mine_seq):
        what = (
            "other ranks are checking the cache entry they run of a frame whose entries run "
            "different collectives, while this rank went on to another compiled frame (it ran "
            "an entry without a graph there)"
        )
    elif len(set(mine_seq)) > 1:
        what = "ranks are at different guard-collective counts"
    else:
        what = "ranks are entering different compiled frames at the same guard-collective count"
    culprits = tuple(members[i] for i, (s, f) in enumerate(everyone) if (s, f & (NESTED - 1)) != (seq, site))
    return CollectiveDesyncError(
        f"{describe('guard', rank, seq, None)}: {what} (this rank was called from {here}):\n{lines}\n"
        "One rank called compiled code more, fewer or other times than the others; no rank ran "
        "this call. Look for rank-dependent control flow around torch.compile'd calls."
        + ("" if groups.scope() is not None else " " + SCOPE_HINT),
        kind="guard",
        rank=rank,
        seq=seq,
        ranks=culprits,
    )


def _guard_pg() -> Any:
    """The guard channel's group, if built: where gloo's error may name broken connections."""
    channel = groups.built_guard_channel()
    return None if channel is None else channel.pg


def _fail_on_guard_channel(error: BaseException, *, kind: str, seq: int, frame: str | None) -> CollectiveError:
    """A failure of the guard channel's all-gather (the hook's or an entry check's), through the
    failure procedure: every rank takes part there, so a mismatch is seen by all alike."""
    rank = dist.get_rank() if dist.is_initialized() else None
    return failure.fail(
        error,
        kind=kind,
        rank=rank,
        seq=seq,
        frame=frame,
        where=lambda: describe(kind, rank, seq, frame),
        pg=_guard_pg(),
        guard_channel=True,
    )


def translate_entry_failure(error: BaseException, *, seq: int, frame: str | None) -> CollectiveError:
    """An entry check's transport failure, through the same failure procedure as the hook's."""
    return _fail_on_guard_channel(error, kind="entry", seq=seq, frame=frame)


def park_failure(error: BaseException) -> None:
    """The hook's collective failed: through the failure procedure, parked for this thread's compile."""
    health.latch.park(_fail_on_guard_channel(error, kind="guard", seq=guard_state.state.seq, frame=None))


def park_interrupt(interrupt: BaseException) -> None:
    """Ctrl-C (or another non-error exit) inside the hook: it stays what it is.

    The user gets the ``KeyboardInterrupt`` back from the call site. This rank
    left a guard collective half-done, so its own later collectives refuse;
    nothing is reported to the other ranks (a Ctrl-C usually reaches every
    rank of a job at once, and is nobody's failure).
    """
    rank = dist.get_rank() if dist.is_initialized() else None
    note = CollectiveError(
        f"{describe('guard', rank, guard_state.state.seq, None)} was interrupted ({type(interrupt).__name__}); "
        "this rank is no longer in step with the others",
        kind="guard",
        rank=rank,
        seq=guard_state.state.seq,
    )
    note.__cause__ = interrupt
    failure.fail(note, kind="guard", cause=failure.INTERRUPTED)
    health.latch.park(interrupt)


def raised_by_signal_handler(error: BaseException) -> bool:
    """Whether ``error`` came out of a Python signal handler (the user's, e.g. SIGTERM's)."""
    handlers = set()
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        code = getattr(handler, "__code__", None) or getattr(getattr(handler, "__func__", None), "__code__", None)
        if code is not None:
            handlers.add(code)
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return True
        tb = tb.tb_next
    return False


def park_left(error: BaseException) -> None:
    """The user's own signal handler raised while this rank waited: it stays that exception.

    This rank left a guard collective half-done, so its later collectives
    refuse; the peers are told that it left, in those words, and stop
    waiting for it within about a heartbeat.
    """
    rank = dist.get_rank() if dist.is_initialized() else None
    seq = guard_state.state.seq
    what = (
        f"its own code raised {type(error).__name__}: {error} from a signal handler while it "
        f"waited in guard collective #{seq}"
    )
    note = CollectiveError(
        f"{describe('guard', rank, seq, None)}: this rank left it half-done ({what}); it is no "
        "longer in step with the others",
        kind="guard",
        rank=rank,
        seq=seq,
    )
    note.__cause__ = error
    health.latch.park(error)  # first: the user gets it back even if telling the peers fails
    failure.fail(note, kind="guard", cause=failure.LEFT, told=what)
