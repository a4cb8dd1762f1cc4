"""The guard collective: after guard evaluation, every rank agrees on hit or miss.

``hook`` is what Dynamo's C++ frame evaluation calls (through
``set_guard_complete_hook``) once guards were evaluated for a frame that
already has compiled code. It returns True to run the cached code and False
to force a compile; if any rank missed, every rank gets False.

It must never raise: an exception inside the hook aborts the process from C++.
On failure it parks a ``CollectiveError`` in the latch (``health.latch``) and
returns False; the compile that follows raises the parked error from the
user's call site.

Process models:

* One rank (world size 1) and no default group: nothing to agree with, the
  hook returns the local result without any exchange.
* Threads: one Python thread per rank owns our collectives: the thread of the
  rank's first compiled call, a compiling one included (the compile entry
  point claims through ``claim_for_compile``, since a frame's first call never
  reaches this hook), until it ends. Each call and each compile is a
  collective numbered in call order, and two threads' calls interleave
  differently on each rank, so any other thread's call is refused before it
  enters any exchange (even before this hook builds its channel): it gets
  ``ConcurrentThreadsError`` at its own call site, naming both threads, and
  did not run. The error is parked for that thread only (``health``), so the
  owner's collectives go on undisturbed. Threads are never compared across
  ranks. ``reset()`` keeps the owner: releasing it would let each rank's
  threads race for it anew. The fast path pays one ``threading.get_ident()``
  comparison for this.
* Signal handlers: an exception the user's own signal handler raises while
  this rank waits (a SIGTERM preemption handler, say) reaches the user as
  itself; this rank refuses later collectives, and the peers are told that it
  left (not that a collective failed). ``KeyboardInterrupt`` stays itself and
  is told to nobody (Ctrl-C usually reaches every rank at once).
* Fork: a forked child starts from a fresh state (``after_fork_in_child``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function as _record_function

from .. import health, process_state
from ..errors import (
    SCOPE_HINT,
    CollectiveDesyncError,
    CollectiveError,
    ConcurrentThreadsError,
    describe,
)
from ..instrument import timing
from ..ledger import ledger
from ..records import PathsDiverged
from ..transport import GuardChannel, groups
from . import failure

log = logging.getLogger("compiler_collectives.guard")

_perf_counter = time.perf_counter
_time_ns = time.time_ns
_get_ident = threading.get_ident


class _GuardState:
    __slots__ = ("agreed_miss", "apart", "channel", "owner", "owner_thread", "seq", "solo")

    def __init__(self) -> None:
        self.seq = 0
        # Ranks took different graph-break paths through one call of a frame (see
        # ``paths_diverged``): calls made from inside compiled code decide alone
        # until this rank is back at a call from the user's own code.
        self.apart = False
        # This generation's channel; the moments that end a generation clear it, and
        # ``groups.notice()`` runs theirs when it finds a new default group.
        self.channel: GuardChannel | None = None
        # The thread that runs compiled code with guards on (see the docstring); 0: none yet.
        self.owner = 0
        self.owner_thread: threading.Thread | None = None
        self.solo = False  # this generation's default group has one rank: no collective
        # (seq, this rank missed) of the last call where some rank missed;
        # the compile that follows exchanges why (take_agreed_miss).
        self.agreed_miss: tuple[int, bool] | None = None


_state = _GuardState()

# Frame identity. The hook is not told which frame it guards, and that frame
# is not on the Python stack yet. Its caller is: torch's compile wrapper (whose
# local ``fn`` is the compiled function), ``Module._call_impl`` (whose local
# ``forward_call`` is the forward being compiled), or plain Python code that
# calls the compiled frame directly (a resume function after a graph break,
# a nested function). The Dynamo seam names the first two, and which code
# objects are Dynamo's output, through ``set_frame_sources``.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_wrapper_locals: dict[Any, str] = {}  # wrapper code object -> name of the local holding the target


def _never(code: Any) -> bool:
    return False


def _off() -> bool:
    return False


_is_dynamo_output_code: Callable[[Any], bool] = _never
# Whether torch's profiler is on (then each call gets a record_function range);
# the Dynamo seam supplies the probe, since the flag is a torch internal.
_profiler_enabled: Callable[[], bool] = _off


@process_state.wired(
    names=("_wrapper_locals", "_is_dynamo_output_code"),
    what="torch's wrapper frames and the test for Dynamo's output code",
)
def set_frame_sources(wrapper_locals: dict[Any, str], is_dynamo_output_code: Callable[[Any], bool]) -> None:
    """Called by the Dynamo seam at install: torch's wrapper frames, and a test for Dynamo's output code."""
    global _is_dynamo_output_code
    _wrapper_locals.update(wrapper_locals)
    _is_dynamo_output_code = is_dynamo_output_code
    _code_kinds.clear()


@process_state.wired(names=("_profiler_enabled",), what="whether torch's profiler is on")
def set_profiler_probe(probe: Callable[[], bool]) -> None:
    """Called by the Dynamo seam at install: a cheap read of whether torch's profiler is on."""
    global _profiler_enabled
    _profiler_enabled = probe


# code -> ("wrapper", local name) | ("torch", None) | ("code", (crc, use f_lasti))
_code_kinds: dict[Any, tuple[str, Any]] = {}


_stable_ids: dict[Any, int] = {}


@process_state.kept(names=("_stable_ids",), why="a cache of code objects' ids, bounded")
def _stable_id(code: Any) -> int:
    ident = _stable_ids.get(code)
    if ident is None:
        text = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}:{code.co_name}"
        ident = zlib.crc32(text.encode())
        if len(_stable_ids) > 4096:
            _stable_ids.clear()
        _stable_ids[code] = ident
    return ident


@process_state.kept(names=("_code_kinds",), why="a cache of code objects' kinds, bounded")
def _classify(code: Any) -> tuple[str, Any]:
    if code in _wrapper_locals:
        kind: tuple[str, Any] = ("wrapper", _wrapper_locals[code])
    elif code.co_filename.startswith(_TORCH_DIR):
        kind = ("torch", None)
    else:
        # Dynamo's rewritten bytecode may differ between cache entries: leave
        # f_lasti out for it and keep only the function's identity.
        kind = ("code", (_stable_id(code), not _is_dynamo_output_code(code)))
    if len(_code_kinds) > 4096:
        _code_kinds.clear()
    _code_kinds[code] = kind
    return kind


def _target_code(obj: Any) -> Any:
    code = getattr(obj, "__code__", None)
    if code is None:
        code = getattr(getattr(obj, "__func__", None), "__code__", None)
    return code


def frame_identity(frame: Any) -> int:
    """A 46-bit id of the compiled frame being entered, equal across ranks for the same frame."""
    while frame is not None:
        code = frame.f_code
        kind, detail = _code_kinds.get(code) or _classify(code)
        if kind == "wrapper":
            target = _target_code(frame.f_locals.get(detail))
            if target is not None:
                return (_stable_id(target) << 14) & 0x3FFFFFFFFFFF
        elif kind == "code":
            crc, with_lasti = detail
            ident: int = ((crc << 14) + (frame.f_lasti & 0x3FFF if with_lasti else 0)) & 0x3FFFFFFFFFFF
            return ident
        frame = frame.f_back
    return 0


def progress() -> dict[str, Any]:
    """What the heartbeat tells of the guard collective (a progress source, wired at install)."""
    return {"guard_seq": _state.seq}


@process_state.clears(
    process_state.RESET,
    process_state.GROUP_DESTROYED,
    names=("_state",),
    what="the guard collective's sequence number, channel and default group",
)
def reset_sequence() -> None:
    _state.seq = 0
    _state.apart = False
    _state.channel = None
    _state.agreed_miss = None
    _state.solo = False


@process_state.clears(process_state.GROUP_ENDING, names=("_state",), what="the guard channel (it holds the store)")
def let_go() -> None:
    """The default group is about to go: drop what holds its store (the rest goes after)."""
    _state.channel = None


@process_state.clears(
    process_state.FORK,
    names=("_state", "_claim_lock"),
    what="the guard collective's state, its owning thread and claim lock",
)
def after_fork_in_child() -> None:
    """A forked child: a fresh state. The parent's channel (its segment mapping, its
    gloo group) stays referenced by ``groups`` and is never used here."""
    global _claim_lock
    reset_sequence()
    _state.owner = 0
    _state.owner_thread = None
    _claim_lock = threading.Lock()


def take_agreed_miss() -> tuple[int, bool, Any] | None:
    """The miss every rank just agreed on, once: (guard seq, this rank missed, its gloo group).

    None unless the last guard collective ended in a miss: a miss followed by
    another guard collective produced no compile (e.g. the frame now runs
    eagerly after the recompile limit) and is stale. Every rank gets the same
    answer, so the exchange that follows pairs up.
    """
    miss, _state.agreed_miss = _state.agreed_miss, None
    if miss is None or miss[0] != _state.seq or _state.channel is None:
        return None
    return miss[0], miss[1], _state.channel.pg


def use_channel(channel: Any) -> None:
    """Make the hook use ``channel`` from its next call (benchmarks comparing mechanisms)."""
    groups.notice()  # a new default group noticed later would clear it
    _state.channel = channel


def entry_check_channel() -> tuple[GuardChannel, int] | None:
    """The guard channel and the number of the last guard collective, for entry agreement.

    None when no guard collective has run in this process group (not
    distributed, or the guard hook is off): then cache contents are not kept
    in step and there is nothing to check an entry against. None too while
    this rank is apart (``paths_diverged``): its peers run other frames.
    """
    groups.notice()  # a new default group clears the channel
    channel = _state.channel
    if channel is None or _state.seq == 0 or _state.apart:
        return None
    return channel, _state.seq


def translate_entry_failure(error: BaseException, *, seq: int, frame: str | None) -> CollectiveError:
    """An entry check's transport failure, through the same failure procedure as the hook's."""
    rank = dist.get_rank() if dist.is_initialized() else None
    return failure.fail(
        error,
        kind="entry",
        rank=rank,
        seq=seq,
        frame=frame,
        where=lambda: describe("entry", rank, seq, frame),
        pg=_guard_pg(),
        guard_channel=True,
    )


def _with_peers() -> bool:
    """Whether this process is one of several ranks (else there is nobody to agree with)."""
    if not dist.is_initialized() or _state.solo:
        return False
    if not groups.available():  # a forked child: the default group is its parent's
        return False
    if dist.get_world_size() == 1:
        _state.solo = True
        return False
    return True


def _channel() -> GuardChannel:
    """The guard channel of the current default group (built on first use: a collective)."""
    if _state.channel is None:
        channel = groups.guard_channel()
        _state.channel = channel
        timing.ensure(dist.get_rank(), channel.pg.size())
    return _state.channel


def hook(guard_eval_result: bool) -> bool:
    """Dynamo's guard-complete hook. True: run cached code; False: compile.

    This runs on every call of every compiled frame: keep it lean. Timing and
    profiler ranges cost one global check each when off.
    """
    try:
        # First: a new default group (its destroy unseen) ends the old one's failure and channel.
        groups.notice()
        if health.latch.first_failure is not None:
            try:
                health.check("guard")
            except CollectiveError as e:
                health.latch.park(e)
            return False
        channel = _state.channel
        if channel is None:
            if not _with_peers():  # not distributed, or one rank: nothing to agree with
                return guard_eval_result
            # Refuse another thread before it builds the channel: that is a collective too.
            if _get_ident() != _state.owner and not _claim_or_park():
                return False
            channel = _channel()
        elif _get_ident() != _state.owner and not _claim_or_park():
            return False  # another thread owns this rank's collectives: parked an error
        if _state.apart and _apart_call(sys._getframe(1)):
            return guard_eval_result
        _state.seq += 1
        seq = _state.seq
        site = frame_identity(sys._getframe(1)) if channel.check_desync else 0
        recorder = timing.recorder
        if recorder is not None:
            start_ns = _time_ns()
        started = _perf_counter()
        if _profiler_enabled():
            with _record_function("compiler_collectives.guard_collective"):
                all_hit, in_step = channel.agree(guard_eval_result, seq, site)
        else:
            all_hit, in_step = channel.agree(guard_eval_result, seq, site)
        elapsed = _perf_counter() - started
        if not in_step:
            ledger.guard_call(elapsed, False, False)
            everyone = _describe_mismatch(channel, seq, site, sys._getframe(1))
            if paths_diverged(everyone):
                go_apart(seq - 1)
                return guard_eval_result
            raise _desync(channel, seq, site, everyone)
        ledger.guard_call(elapsed, not guard_eval_result, not all_hit)
        if not all_hit:
            _state.agreed_miss = (seq, not guard_eval_result)
            if guard_eval_result:
                log.debug("guard collective #%d: this rank hit but another missed; recompiling", seq)
        if recorder is not None:
            recorder.guard(start_ns=start_ns, duration_s=elapsed, seq=seq, hit=guard_eval_result, agreed=all_hit)
        return all_hit
    except BaseException as e:  # noqa: BLE001 - nothing may escape into C++
        try:
            if isinstance(e, KeyboardInterrupt):
                _park_interrupt(e)
            elif _raised_by_signal_handler(e):
                _park_left(e)
            elif isinstance(e, Exception):
                _park_failure(e)
            else:
                _park_interrupt(e)
        except BaseException:  # noqa: BLE001
            pass
        return False


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
            if _state.owner_thread is self.thread:
                _state.owner = 0
                _state.owner_thread = None
        except Exception:  # noqa: BLE001 - at interpreter exit our globals may be gone
            pass


_owner_mark = threading.local()


def _claim() -> threading.Thread | None:
    """Slow path: this thread is not the owner. It becomes it if there is none (or the
    owner ended); otherwise returns the owner, whose collectives this thread must not join."""
    me = threading.current_thread()
    with _claim_lock:
        owner = _state.owner_thread
        if owner is None or owner is me or not owner.is_alive():
            if owner is not None and owner is not me:
                log.debug("thread %r now owns this rank's collectives (thread %r ended)", me.name, owner.name)
            if getattr(_owner_mark, "mark", None) is None:  # a thread's mark is always its own
                _owner_mark.mark = _OwnerMark(me)
            _state.owner_thread = me
            _state.owner = _get_ident()
            return None
    return owner


@process_state.kept(names=("_owner_mark",), why="each thread's own mark, ending its ownership when it ends")
def _claim_or_park() -> bool:
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
            seq=_state.seq,
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
    if _get_ident() == _state.owner or not _with_peers():
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


def _raised_by_signal_handler(error: BaseException) -> bool:
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


# ------------------------------------------------------------------ paths through one call

# Flags on the slow path's (seq, site) all-gather. A guard call made from inside
# compiled code (a resume function after a graph break) sends its site with
# NESTED; an entry check (agreements/entry.py) sends (-seq, entry index), with
# EMPTY when its entry runs no collective.
NESTED = 1 << 46  # above the 46-bit frame id, which the channels' keys use alone
EMPTY = 1 << 40  # above any entry index


def apart() -> bool:
    """Whether this rank is on its own path through a call (``paths_diverged``): no collective runs."""
    return _state.apart


def paths_diverged(everyone: Sequence[tuple[int, int]]) -> bool:
    """Whether a mismatch is the ranks taking different graph-break paths through one call of a frame.

    After guard collective #p every rank entered a cache entry of the same
    frame, each as its own guards chose. An entry whose code calls a resume
    function (a graph break) has its rank's next guard call come from inside
    compiled code, at #p+1 (NESTED); a rank in an entry whose programs differ
    checks the entry at -p. When no rank is at a call of its own code, and every
    checking rank's entry runs no collective, the ranks merely run different
    compiled frames inside one call that communicates nothing: a job without
    this service runs it correctly, so each rank goes on alone
    (``go_apart``) until it calls compiled code from its own code again,
    where all ranks meet. Decided from the all-gather alone: the same on every
    rank.
    """
    checks = [f for s, f in everyone if s < 0]
    nested = [s for s, f in everyone if s > 0 and f & NESTED]
    if not nested or len(checks) + len(nested) != len(everyone):
        return False
    parents = {-s for s, _ in everyone if s < 0} | {s - 1 for s in nested}
    return len(parents) == 1 and all(f & EMPTY for f in checks)


def go_apart(parent_seq: int) -> None:
    """Every rank agreed that their paths through this call differ: go on alone (``paths_diverged``)."""
    _state.seq = parent_seq  # where every rank stands: the next call of the user's own code is #p+1
    _state.apart = True
    ledger.add(PathsDiverged(parent_seq))
    log.debug(
        "after guard collective #%d the ranks run different compiled frames of one call; "
        "each goes on alone until its next call from its own code",
        parent_seq,
    )


def in_compiled_code(frame: Any) -> bool:
    """Whether ``frame`` or a frame below it runs Dynamo's output code (a compiled frame's bytecode)."""
    depth = 0
    while frame is not None and depth < 512:
        if _is_dynamo_output_code(frame.f_code):
            return True
        frame = frame.f_back
        depth += 1
    return False


def _apart_call(caller: Any) -> bool:
    """While apart: True for a call from inside compiled code (decided alone); else the ranks meet here again."""
    if in_compiled_code(caller):
        return True
    _state.apart = False
    return False


def at_compile(caller: Any) -> None:
    """A frame compile starts: one called from the user's own code ends going apart (all ranks meet there)."""
    if _state.apart:
        _apart_call(caller)


def _describe_mismatch(channel: GuardChannel, seq: int, site: int, caller: Any) -> list[tuple[int, int]]:
    """Every rank saw the mismatch: one more exchange to say who was where."""
    flag = NESTED if in_compiled_code(caller) else 0
    try:
        return channel.describe_all(seq, site | flag)
    except Exception:  # noqa: BLE001 - the message is less precise, the error stands
        return []


def _desync(channel: GuardChannel, seq: int, site: int, everyone: list[tuple[int, int]]) -> CollectiveDesyncError:
    members = groups.member_ranks(channel.pg)  # global ranks, under a scope too
    rank = members[channel.pg.rank()]
    caller: FrameType | None = sys._getframe(2)
    while caller is not None and caller.f_code.co_filename.startswith(_TORCH_DIR):
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


def _park_failure(error: BaseException) -> None:
    """The hook's collective failed: through the failure procedure, parked for this thread's compile."""
    rank = dist.get_rank() if dist.is_initialized() else None
    seq = _state.seq
    err = failure.fail(
        error,
        kind="guard",
        rank=rank,
        seq=seq,
        frame=None,
        where=lambda: describe("guard", rank, seq, None),
        pg=_guard_pg(),
        guard_channel=True,
    )
    health.latch.park(err)


def _park_interrupt(interrupt: BaseException) -> None:
    """Ctrl-C (or another non-error exit) inside the hook: it stays what it is.

    The user gets the ``KeyboardInterrupt`` back from the call site. This rank
    left a guard collective half-done, so its own later collectives refuse;
    nothing is reported to the other ranks (a Ctrl-C usually reaches every
    rank of a job at once, and is nobody's failure).
    """
    rank = dist.get_rank() if dist.is_initialized() else None
    note = CollectiveError(
        f"{describe('guard', rank, _state.seq, None)} was interrupted ({type(interrupt).__name__}); "
        "this rank is no longer in step with the others",
        kind="guard",
        rank=rank,
        seq=_state.seq,
    )
    note.__cause__ = interrupt
    health.poison(note)
    health.latch.park(interrupt)


def group() -> Any:
    """The process group the guard collective runs on (built on first use, on every rank together)."""
    return groups.guard_pg()


def _park_left(error: BaseException) -> None:
    """The user's own signal handler raised while this rank waited: it stays that exception.

    This rank left a guard collective half-done, so its later collectives
    refuse; the peers are told that it left, in those words, and stop
    waiting for it within about a heartbeat.
    """
    rank = dist.get_rank() if dist.is_initialized() else None
    seq = _state.seq
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
    health.poison(note)
    health.latch.park(error)
    groups.leave(what, seq)
