"""The guard collective: after guard evaluation, every rank agrees on hit or miss.

``hook`` is what Dynamo's C++ frame evaluation calls (through
``set_guard_complete_hook``) once guards were evaluated for a frame that
already has compiled code. It returns True to run the cached code and False
to force a compile; if any rank missed, every rank gets False.

It must never raise: an exception inside the hook aborts the process from C++.
On failure it parks a ``CollectiveError`` in ``health`` and returns False; the
compile that follows raises the parked error from the user's call site.
"""

from __future__ import annotations

import logging
import time

import torch.autograd.profiler as _profiler
import torch.distributed as dist
from torch.profiler import record_function as _record_function

from . import health, timing
from .errors import CollectiveDesyncError, CollectiveError, describe
from .stats import counters
from .transport import GuardChannel, groups, translate_failure

log = logging.getLogger("compiler_collectives.guard")

_perf_counter = time.perf_counter
_time_ns = time.time_ns


class _GuardState:
    __slots__ = ("seq", "channel", "world")

    def __init__(self) -> None:
        self.seq = 0
        self.channel: GuardChannel | None = None
        self.world: object | None = None


_state = _GuardState()


def reset_sequence() -> None:
    _state.seq = 0
    _state.channel = None
    _state.world = None


def _channel() -> GuardChannel | None:
    world = dist.group.WORLD if dist.is_initialized() else None
    if world is None:
        return None
    if _state.channel is None or _state.world is not world:
        _state.channel = groups.guard_channel()
        _state.world = world
        timing.ensure(_state.channel.pg.rank(), _state.channel.pg.size())
    return _state.channel


def hook(guard_eval_result: bool) -> bool:
    """Dynamo's guard-complete hook. True: run cached code; False: compile.

    This runs on every call of every compiled frame: keep it lean. Timing and
    profiler ranges cost one global check each when off.
    """
    try:
        if health._first_failure is not None:
            try:
                health.check("guard")
            except CollectiveError as e:
                health.park(e)
            return False
        channel = _state.channel
        if channel is None or _state.world is not dist.group.WORLD:
            channel = _channel()
            if channel is None:  # not distributed: nothing to agree with
                return guard_eval_result
        _state.seq += 1
        seq = _state.seq
        recorder = timing.recorder
        if _profiler._is_profiler_enabled:
            with _record_function("compiler_collectives.guard_collective"):
                started = _perf_counter()
                all_hit, lo, hi = channel.agree(guard_eval_result, seq)
                elapsed = _perf_counter() - started
        else:
            if recorder is not None:
                start_ns = _time_ns()
            started = _perf_counter()
            all_hit, lo, hi = channel.agree(guard_eval_result, seq)
            elapsed = _perf_counter() - started
        counters.guard_time_s += elapsed
        counters.guard_collectives += 1
        if lo != hi:
            raise CollectiveDesyncError(
                f"{describe('guard', channel.pg.rank(), seq, None)}: ranks are at different "
                f"guard-collective counts (lowest #{lo}, highest #{hi}): one rank called a "
                "compiled function more or fewer times than the others. Look for rank-dependent "
                "control flow around torch.compile'd calls.",
                kind="guard", rank=channel.pg.rank(), seq=seq, ranks=(),
            )
        if not guard_eval_result:
            counters.guard_local_misses += 1
        if not all_hit:
            counters.guard_agreed_misses += 1
            if guard_eval_result:
                counters.forced_recompiles += 1
                log.debug("guard collective #%d: this rank hit but another missed; recompiling", seq)
        if recorder is not None:
            if _profiler._is_profiler_enabled:
                start_ns = _time_ns() - int(elapsed * 1e9)
            recorder.guard(start_ns=start_ns, duration_s=elapsed, seq=seq,
                           hit=guard_eval_result, agreed=all_hit)
        return all_hit
    except BaseException as e:  # noqa: BLE001 - nothing may escape into C++
        try:
            _park_failure(e)
        except BaseException:  # noqa: BLE001
            pass
        return False


def _park_failure(error: BaseException) -> None:
    rank = dist.get_rank() if dist.is_initialized() else None
    seq = _state.seq
    if isinstance(error, CollectiveError):
        err = error
    else:
        err = translate_failure(
            error,
            kind="guard",
            describe=lambda: describe("guard", rank, seq, None),
            rank=rank,
            seq=seq,
            frame=None,
        )
        err.__cause__ = error
    counters.errors += 1
    health.poison(err)
    health.park(err)
