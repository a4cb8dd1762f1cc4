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

import torch.distributed as dist

from . import health
from .errors import CollectiveDesyncError, CollectiveError, describe
from .stats import counters
from .transport import GuardChannel, groups, translate_failure

log = logging.getLogger("compiler_collectives.guard")

_perf_counter = time.perf_counter


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
    return _state.channel


def hook(guard_eval_result: bool) -> bool:
    """Dynamo's guard-complete hook. True: run cached code; False: compile."""
    try:
        return _agree(guard_eval_result)
    except BaseException as e:  # noqa: BLE001 - nothing may escape into C++
        try:
            _park_failure(e)
        except BaseException:  # noqa: BLE001
            pass
        return False


def _agree(hit: bool) -> bool:
    if health.poisoned() is not None:
        try:
            health.check("guard")
        except CollectiveError as e:
            health.park(e)
        return False
    channel = _state.channel
    if channel is None or not dist.is_initialized() or _state.world is not dist.group.WORLD:
        channel = _channel()
        if channel is None:  # not distributed: nothing to agree with
            return hit
    _state.seq += 1
    seq = _state.seq
    started = _perf_counter()
    all_hit, lo, hi = channel.agree(hit, seq)
    counters.guard_time_s += _perf_counter() - started
    counters.guard_collectives += 1
    if lo != hi:
        raise CollectiveDesyncError(
            f"{describe('guard', channel.pg.rank(), seq, None)}: ranks are at different "
            f"guard-collective counts (lowest #{lo}, highest #{hi}): one rank called a "
            "compiled function more or fewer times than the others. Look for rank-dependent "
            "control flow around torch.compile'd calls.",
            kind="guard", rank=channel.pg.rank(), seq=seq,
        )
    if not hit:
        counters.guard_local_misses += 1
    if not all_hit:
        counters.guard_agreed_misses += 1
        if hit:
            counters.forced_recompiles += 1
            log.debug("guard collective #%d: this rank hit but another missed; recompiling", seq)
    return all_hit


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
