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
  point claims through ``guard_owner.claim_for_compile``, since a frame's first call never
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
* Fork: a forked child starts from a fresh state (its runtime's generation
  has a guard state of its own; ``guard_owner.after_fork_in_child``: a fresh
  claim lock).

Where the rest lives (each module's docstring says more):

* ``guard_state``: the one state object the hook reads (sequence number,
  channel, owner, apart) and the moments that clear it;
* ``guard_owner``: which thread owns this rank's collectives;
* ``guard_paths``: ranks taking different graph-break paths through one call;
* ``guard_frames``: which compiled frame a call is for (``frame_identity``);
* ``guard_failure``: the desync message and what the hook parks on failure.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any

import torch.distributed as dist
from torch.profiler import record_function as _record_function

from .. import health, torch_view
from ..errors import CollectiveError
from ..ledger import ledger
from ..records import GuardChannelBuilt
from ..transport import GuardChannel, groups
from . import guard_state

# The hook's helpers are imported under the private names its body has always used
# (the body stays as it was; each is one global lookup, as before).
from .guard_failure import describe_mismatch as _describe_mismatch
from .guard_failure import desync as _desync
from .guard_failure import park_failure as _park_failure
from .guard_failure import park_interrupt as _park_interrupt
from .guard_failure import park_left as _park_left
from .guard_failure import raised_by_signal_handler as _raised_by_signal_handler
from .guard_frames import frame_identity
from .guard_owner import claim_or_park as _claim_or_park
from .guard_paths import apart_call as _apart_call
from .guard_paths import go_apart, paths_diverged
from .guard_state import with_peers as _with_peers
from .our_groups import guard_channel as _guard_channel

log = logging.getLogger("compiler_collectives.guard")

_perf_counter = time.perf_counter
_time_ns = time.time_ns
_get_ident = threading.get_ident


def progress() -> dict[str, Any]:
    """What the heartbeat tells of the guard collective (a progress source, wired at install)."""
    return {"guard_seq": guard_state.state.seq}


def take_agreed_miss() -> tuple[int, bool, Any] | None:
    """The miss every rank just agreed on, once: (guard seq, this rank missed, its gloo group).

    None unless the last guard collective ended in a miss: a miss followed by
    another guard collective produced no compile (e.g. the frame now runs
    eagerly after the recompile limit) and is stale. Every rank gets the same
    answer, so the exchange that follows pairs up.
    """
    state = guard_state.state
    miss, state.agreed_miss = state.agreed_miss, None
    if miss is None or miss[0] != state.seq or state.channel is None:
        return None
    return miss[0], miss[1], state.channel.pg


def use_channel(channel: Any) -> None:
    """Make the hook use ``channel`` from its next call (benchmarks comparing mechanisms)."""
    groups.notice()  # a new default group noticed later starts a generation without it
    guard_state.state.channel = channel


def entry_check_channel() -> tuple[GuardChannel, int] | None:
    """The guard channel and the number of the last guard collective, for entry agreement.

    None when no guard collective has run in this process group (not
    distributed, or the guard hook is off): then cache contents are not kept
    in step and there is nothing to check an entry against. None too while
    this rank is apart (``guard_paths.paths_diverged``): its peers run other frames.
    """
    groups.notice()  # a new default group starts a generation, whose state has no channel yet
    state = guard_state.state
    channel = state.channel
    if channel is None or state.seq == 0 or state.apart:
        return None
    return channel, state.seq


def group() -> Any:
    """The process group the guard collective runs on (built on first use, on every rank together)."""
    return _guard_channel().pg


def _channel() -> GuardChannel:
    """The guard channel of the current default group (built on first use: a collective)."""
    state = guard_state.state
    if state.channel is None:
        channel = _guard_channel()
        state.channel = channel
        ledger.add(GuardChannelBuilt(dist.get_rank(), channel.pg.size()))  # the timing reader's rank
    return state.channel


def hook(guard_eval_result: bool) -> bool:
    """Dynamo's guard-complete hook. True: run cached code; False: compile.

    This runs on every call of every compiled frame: keep it lean. Timing (the
    ledger's guard reader) and profiler ranges cost one check each when off.
    """
    try:
        # First: a new default group (its destroy unseen) ends the old one's failure and channel.
        groups.notice()
        state = guard_state.state  # after notice(): a new generation's, if it started one
        if health.latch.first_failure is not None:
            try:
                health.latch.check("guard")
            except CollectiveError as e:
                health.latch.park(e)
            return False
        channel = state.channel
        if channel is None:
            if not _with_peers():  # not distributed, or one rank: nothing to agree with
                return guard_eval_result
            # Refuse another thread before it builds the channel: that is a collective too.
            if _get_ident() != state.owner and not _claim_or_park():
                return False
            channel = _channel()
        elif _get_ident() != state.owner and not _claim_or_park():
            return False  # another thread owns this rank's collectives: parked an error
        if state.apart and _apart_call(sys._getframe(1)):
            return guard_eval_result
        state.seq += 1
        seq = state.seq
        site = frame_identity(sys._getframe(1)) if channel.check_desync else 0
        # The clock only while the ledger has a guard reader (timing on): else 0, no allocation.
        start_ns = 0
        if ledger.guard_reader is not None:
            start_ns = _time_ns()
        started = _perf_counter()
        if torch_view.view.profiler_enabled():  # torch's flag, through the seam table
            with _record_function("compiler_collectives.guard_collective"):
                all_hit, in_step = channel.agree(guard_eval_result, seq, site)
        else:
            all_hit, in_step = channel.agree(guard_eval_result, seq, site)
        elapsed = _perf_counter() - started
        if not in_step:
            ledger.guard_call(elapsed, False, False)  # counted, offered to no reader: it raises or goes apart
            everyone = _describe_mismatch(channel, seq, site, sys._getframe(1))
            if paths_diverged(everyone):
                go_apart(seq - 1)
                return guard_eval_result
            raise _desync(channel, seq, site, everyone)
        ledger.guard_call(elapsed, not guard_eval_result, not all_hit, seq, start_ns)
        if not all_hit:
            state.agreed_miss = (seq, not guard_eval_result)
            if guard_eval_result:
                log.debug("guard collective #%d: this rank hit but another missed; recompiling", seq)
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
