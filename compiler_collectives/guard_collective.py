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
import os
import sys
import time
import zlib
from typing import Any, Callable

import torch
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

# Call-site identity. The hook is not told which frame it guards, so we use
# the nearest caller outside torch: the user's line that called compiled code.
# Two ranks at the same guard-collective count but at different call sites are
# out of step. Cached per code object: (stable id, include f_lasti?).
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_code_ids: dict[Any, tuple[int, bool] | None] = {}  # None: a torch frame, look further up
_is_dynamo_output_code: Callable[[Any], bool] = lambda code: False  # set by the seams


def _code_identity(code: Any) -> tuple[int, bool] | None:
    if code.co_filename.startswith(_TORCH_DIR):
        ident = None
    else:
        text = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}:{code.co_name}"
        # Dynamo's rewritten bytecode may differ between cache entries: leave
        # f_lasti out for it, keep the function's identity.
        ident = (zlib.crc32(text.encode()), not _is_dynamo_output_code(code))
    if len(_code_ids) > 4096:
        _code_ids.clear()
    _code_ids[code] = ident
    return ident


def call_site(frame: Any) -> int:
    """A 46-bit id of the first non-torch frame at or above ``frame``, equal across ranks."""
    while frame is not None:
        code = frame.f_code
        ident = _code_ids.get(code, _MISSING)
        if ident is _MISSING:
            ident = _code_identity(code)
        if ident is not None:
            crc, with_lasti = ident
            return ((crc << 14) + (frame.f_lasti if with_lasti else 0)) & 0x3FFFFFFFFFFF
        frame = frame.f_back
    return 0


_MISSING = object()
groups.progress_sources.append(lambda: {"guard_seq": _state.seq})


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
        site = call_site(sys._getframe(1))
        recorder = timing.recorder
        if _profiler._is_profiler_enabled:
            with _record_function("compiler_collectives.guard_collective"):
                started = _perf_counter()
                all_hit, lo, hi, same_site = channel.agree(guard_eval_result, seq, site)
                elapsed = _perf_counter() - started
        else:
            if recorder is not None:
                start_ns = _time_ns()
            started = _perf_counter()
            all_hit, lo, hi, same_site = channel.agree(guard_eval_result, seq, site)
            elapsed = _perf_counter() - started
        counters.guard_time_s += elapsed
        counters.guard_collectives += 1
        if lo != hi or not same_site:
            caller = sys._getframe(1)
            while caller is not None and caller.f_code.co_filename.startswith(_TORCH_DIR):
                caller = caller.f_back
            here = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller is not None else "?"
            what = (f"ranks are at different guard-collective counts (lowest #{lo}, highest #{hi})"
                    if lo != hi else
                    f"ranks reached this guard collective from different call sites (this rank: {here})")
            raise CollectiveDesyncError(
                f"{describe('guard', channel.pg.rank(), seq, None)}: {what}. One rank called "
                "compiled code more, fewer or other times than the others; neither call ran. "
                "Look for rank-dependent control flow around torch.compile'd calls.",
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
    if not isinstance(err, CollectiveDesyncError):  # a desync is seen by every rank alike
        err = groups.fail(err, seq=seq)
    counters.errors += 1
    health.poison(err)
    health.park(err)
