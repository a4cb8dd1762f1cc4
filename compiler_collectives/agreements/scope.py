"""The setup check of a scope, and the first rendezvous of every generation.

The setup check covers the whole job, on the c10d store, without making one
scope wait for another (``agree``):

1. every rank posts its record at ``setup/<rank>`` (its settings, versions and
   its scope), at ``scope()`` or, without a call, when its first group is made;
2. the scope's lowest rank (its leader) reads each member's record as it
   arrives (a member naming other ranks is an overlap) and compares it with its
   own; a member reads its leader's record (the same check, from its side);
3. the leader registers at ``setup/leader/<k>`` and compares its record with
   every leader registered before it: scopes must be disjoint and settings
   equal. Of two leaders, the one that registers second always sees the
   other, so every difference between scopes is found by one of them;
4. the leader posts a verdict for its scope (``wire.scope``, validated like a
   payload); every member raises the same error from it (or none). A rank
   that finds a problem also reports it on the store, so ranks of other
   scopes, which passed already, are stopped by their heartbeat thread within
   a heartbeat.

Nothing here waits for a rank outside the caller's scope. Without a scope the
whole-world check of ``setup`` runs, and stops at once if rank 0 is scoped.
``first_rendezvous`` is what transport runs before a generation's first group (wired at install).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .. import health
from ..errors import CollectiveTimeoutError, PeerFailureError, ScopeError, SetupMismatchError
from ..transport import PROTOCOL_VERSION, SHM_LAYOUT_VERSION, Scope
from . import setup as setup_agreement
from . import wire

log = logging.getLogger("compiler_collectives.scope")

SCOPE_ITEM = "compiler_collectives scope"
"""The setup-record item that names a rank's scope (compared by its key, not its text)."""
RANKS_ITEM = "compiler_collectives scope ranks"
"""A leader's record also lists its scope's ranks, for the other leaders' overlap check."""

_SLICE_S = 0.25  # store waits are sliced so a peer's reported failure stops them

WORLD_ITEM = "the whole world"


def record_item(chosen: Scope | None) -> str:
    return WORLD_ITEM if chosen is None else chosen.item()


def _scope_key(record: tuple[int, dict[str, Any]]) -> str:
    """The exact scope identity in a decoded record ("" for the whole world or none sent)."""
    text = record[1].get(SCOPE_ITEM)
    if not isinstance(text, str) or "#" not in text:
        return ""
    return text.split("#", 1)[1].split(" ", 1)[0]


def agree(store: Any, rank: int, world: int, timeout_s: float, chosen: Scope, record: dict[str, Any]) -> None:
    """The setup check of ``chosen``'s ranks, and of this scope against the others (see the module
    docstring). Store calls only: the caller bounds it. Raises like ``setup_agreement.agree``."""
    deadline = time.monotonic() + timeout_s
    mine = wire.encode_setup(rank, record)
    store.set(f"setup/{rank}", mine)
    leader = chosen.ranks[0]
    verdict_key = f"setup/scope/{chosen.key}/verdict"
    if rank == leader:
        verdict = _lead(store, rank, chosen, wire.decode_setup(mine, sender=rank), deadline, timeout_s)
        store.set(verdict_key, verdict)
    else:
        _wait(store, f"setup/{leader}", deadline, rank, timeout_s, chosen, [leader])
        reference = _record(store, leader)
        if _scope_key(reference) != chosen.key:
            raise _overlap(rank, store, leader, rank)
        _wait(store, verdict_key, deadline, rank, timeout_s, chosen, None)
        verdict = store.get(verdict_key)
    _raise_verdict(store, rank, world, timeout_s, chosen, verdict)


def _record(store: Any, sender: int) -> tuple[int, dict[str, Any]]:
    return setup_agreement.read_record(store.get(f"setup/{sender}"), sender)


def _lead(
    store: Any, rank: int, chosen: Scope, mine: tuple[int, dict[str, Any]], deadline: float, timeout_s: float
) -> bytes:
    """The leader's checks; returns the verdict its members read."""
    records = {rank: mine}
    pending = [m for m in chosen.ranks if m != rank]
    while pending:
        try:
            store.wait([f"setup/{m}" for m in pending], datetime.timedelta(seconds=_SLICE_S))
            ready = pending
        except Exception:  # noqa: BLE001 - a slice ran out: see who is there
            ready = [m for m in pending if store.check([f"setup/{m}"])]
        for m in ready:
            records[m] = _record(store, m)
            if _scope_key(records[m]) != chosen.key:
                return wire.encode_verdict("overlap", [rank, m])
        pending = [m for m in pending if m not in ready]
        if pending:
            _stop_if_poisoned(rank)
            if time.monotonic() >= deadline:
                return wire.encode_verdict("absent", pending)
    differing = [
        m
        for m in chosen.ranks
        if m != rank and setup_agreement.differences(_settings_only(mine), _settings_only(records[m]))
    ]
    if differing:
        return wire.encode_verdict("setup", [rank] + differing)
    # Against the other scopes: every leader registered before this one.
    k = int(store.add("setup/leaders", 1))
    store.set(f"setup/leader/{k}", str(rank))
    for j in range(1, k):
        key = f"setup/leader/{j}"
        store.wait([key], datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        other = int(store.get(key))
        theirs = _record(store, other)
        if _scope_key(theirs) == chosen.key:
            continue  # (cannot happen: one leader per scope)
        their_ranks = _ranks_in(theirs)
        if their_ranks is None or set(their_ranks) & set(chosen.ranks):
            return wire.encode_verdict("overlap", [other, rank])
        if setup_agreement.differences(_settings_only(theirs), _settings_only(mine)):
            return wire.encode_verdict("setup", [other, rank])
    return wire.encode_verdict("ok", [])


def _ranks_in(record: tuple[int, dict[str, Any]]) -> tuple[int, ...] | None:
    """The ranks a leader's record names (its leader posts them with the verdict), or None."""
    text = record[1].get(RANKS_ITEM)
    if not isinstance(text, str):
        return None
    try:
        return tuple(int(r) for r in text.split(",") if r)
    except ValueError:
        return None


def leader_items(chosen: Scope, rank: int) -> dict[str, Any]:
    """Extra record items a scope's leader sends: its scope's ranks, for other leaders' overlap check.

    Only leaders send it (members' records stay small), and records of different
    scopes are compared without it and without ``SCOPE_ITEM``."""
    if rank != chosen.ranks[0]:
        return {}
    text = ",".join(map(str, chosen.ranks))
    return {RANKS_ITEM: text} if len(text) <= 512 else {}


def _settings_only(record: tuple[int, dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """A record without its scope items: what must match across and within scopes."""
    return record[0], {k: v for k, v in record[1].items() if k not in (SCOPE_ITEM, RANKS_ITEM)}


def _raise_verdict(store: Any, rank: int, world: int, timeout_s: float, chosen: Scope, data: bytes) -> None:
    verdict = wire.decode_verdict(data, sender=chosen.ranks[0], world_size=world)
    kind, ranks = verdict.kind, verdict.ranks
    if kind == "ok":
        return
    if kind == "overlap":
        raise _overlap(rank, store, ranks[0], ranks[1])
    if kind == "absent":
        raise _absent(rank, timeout_s, chosen, ranks)
    reference, others = ranks[0], ranks[1:]
    shown = [(r, _settings_only(_record(store, r))) for r in others[:32]]
    ref_record = _settings_only(_record(store, reference))
    err = setup_agreement.mismatch_error(
        rank,
        len(chosen.ranks) if reference in chosen.ranks else 2,
        ref_record,
        shown,
        len(others),
        reference_rank=reference,
    )
    raise err


def _overlap(rank: int, store: Any, a: int, b: int) -> ScopeError:
    def shown(r: int) -> str:
        item = _record(store, r)[1].get(SCOPE_ITEM, "no scope sent")
        return f"rank {r}: {item}"

    return ScopeError(
        f"scope check on rank {rank}: ranks {a} and {b} name different scopes that share ranks:\n"
        f"  {shown(a)}\n  {shown(b)}\n"
        "Scopes must not overlap: every rank of a scope must pass the same ranks (the ranks of one "
        "pipeline stage), and each rank belongs to exactly one scope. Pass each rank the group of "
        "its own stage (compiler_collectives.scope(stage_group)), and set COMPILER_COLLECTIVES_SCOPE "
        "the same on every rank.",
        kind="scope",
        rank=rank,
        ranks=(a, b),
    )


def _absent(rank: int, timeout_s: float, chosen: Scope, absent: list[int]) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(
        f"setup check on rank {rank}: rank(s) {absent} of this scope {chosen.render()} (from "
        f"{chosen.source}) did not arrive within {timeout_s:.0f}s (COMPILER_COLLECTIVES_TIMEOUT). "
        "They are stuck, much slower, crashed, or were given another scope: every rank of a scope "
        "must call compiler_collectives.scope() with the same ranks (or none, with the same "
        "COMPILER_COLLECTIVES_SCOPE).",
        kind="setup",
        rank=rank,
        ranks=tuple(absent),
    )


def _wait(
    store: Any, key: str, deadline: float, rank: int, timeout_s: float, chosen: Scope, waiting_for: list[int] | None
) -> None:
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait([key], datetime.timedelta(seconds=max(0.001, min(_SLICE_S, left))))
            return
        except Exception:  # noqa: BLE001 - c10d raises DistStoreError/RuntimeError on a timeout
            pass
        _stop_if_poisoned(rank)
        if time.monotonic() >= deadline:
            raise _absent(rank, timeout_s, chosen, waiting_for if waiting_for is not None else [chosen.ranks[0]])


def _stop_if_poisoned(rank: int) -> None:
    failure = health.latch.first_failure
    if failure is not None:
        raise PeerFailureError(
            f"setup check on rank {rank}: stopped waiting: {failure}",
            kind="setup",
            rank=rank,
            ranks=failure.ranks,
            reported_by=failure.reported_by,
        )


def check_reference(rank: int, mine: Scope | None) -> Callable[[tuple[int, dict[str, Any]], Any], None]:
    """For the whole-world setup check: raise at once if rank 0 runs in a scope (the ranks would
    otherwise wait for each other in two different checks until the timeout)."""

    def check(reference: tuple[int, dict[str, Any]], store: Any) -> None:
        if _scope_key(reference) != (mine.key if mine is not None else ""):
            raise _overlap(rank, store, 0, rank)

    return check


def first_rendezvous(chosen: Scope | None) -> Callable[[Any, float], None]:
    """This rank's setup record, taken now (on the caller's thread); returns the check to run."""
    rank = dist.get_rank()
    items: dict[str, Any] = {
        "transport protocol version": PROTOCOL_VERSION,
        "shared-memory layout version": SHM_LAYOUT_VERSION,
        SCOPE_ITEM: record_item(chosen),
    }
    if chosen is not None:
        items.update(leader_items(chosen, rank))
    record = setup_agreement.local_record(items)

    def rendezvous(side: Any, timeout_s: float) -> None:
        try:
            if chosen is None:
                setup_agreement.agree(
                    side.store, side.rank, side.world, timeout_s, record, check_reference(side.rank, None)
                )
            else:
                agree(side.store, side.rank, side.world, timeout_s, chosen, record)
        except (ScopeError, SetupMismatchError) as err:
            if chosen is not None or isinstance(err, ScopeError):
                # Ranks of other scopes passed their own checks (or wait in another one):
                # the report stops them within a heartbeat.
                try:
                    side.report_failure("setup", None, str(err))
                except Exception as e:  # noqa: BLE001 - StoreUnresponsive or a store error
                    log.debug("could not report the setup failure: %s", e)
            raise

    return rendezvous
