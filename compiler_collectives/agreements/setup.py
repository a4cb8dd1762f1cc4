"""Setup agreement: before our first group of a generation exists, the ranks check that
they run the same versions and hold the same settings that shape a collective.

Ranks that disagree about, say, ``COMPILER_COLLECTIVES_GUARD_DESYNC_CHECK``
would otherwise meet in gloo operations of different sizes (which gloo can
end in ``std::terminate``), or wait for each other in different collectives
until the timeout and then blame a "stuck" rank. Here every rank raises
``SetupMismatchError`` within seconds, naming each differing item and each
rank's value.

What is compared (``local_record``):

* versions: this record's format, the compiler-collective wire format, our
  transport protocol and shared-memory layout, the package, torch;
* every setting whose row in ``config.SETTINGS_TABLE`` says ``must_match``,
  by its environment variable's name;
* switches only known at run time, from functions registered with
  ``register_source`` (install wires the seams' source: the guard-collective
  hook, the compiler-collective flag and Dynamo's ``automatic_dynamic_shapes``); they
  override a setting of the same name (the guard switch's effective state
  wins over ``COMPILER_COLLECTIVES_GUARDS``).

The exchange runs on the c10d store, once per generation, and is also the
first group's rendezvous. Every rank's record is msgpack
(``wire.setup``: ``[format, rank, [[item, value], ...]]``), read by the bounded
reader and validated before use; a record that cannot be read shows as that
rank's "readable setup record" item. To stay at O(1) store operations per
rank, each rank compares its record with rank 0's; only the ranks that differ
publish theirs for the others to read:

1. ``setup/<rank>``: this rank's record (also its arrival mark);
2. compare with ``setup/0``; if different, ``setup/mismatches`` += 1 and the
   record goes to ``setup/mismatch/<i>``;
3. ``setup/arrived`` += 1; the last rank sets ``setup/done``;
4. after ``setup/done``, every rank reads the same mismatching records and
   raises the same error (or none).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

from .. import config, health
from ..errors import SCOPE_HINT, CollectiveTimeoutError, PeerFailureError, SetupMismatchError, WireFormatError
from . import wire

log = logging.getLogger("compiler_collectives.setup")

_SHOWN_MISMATCHES = 32  # records read and shown when many ranks differ from rank 0

_sources: list[Callable[[], dict[str, Any]]] = []


def register_source(source: Callable[[], dict[str, Any]]) -> None:
    """Add items only known at run time (idempotent per function)."""
    if source not in _sources:
        _sources.append(source)


def local_record(versions: dict[str, Any]) -> dict[str, Any]:
    """Everything this rank must hold alike with every other, by the name messages show."""
    import torch

    from ..version import __version__

    record: dict[str, Any] = {
        "compiler_collectives version": __version__,
        "torch version": torch.__version__,
        "wire format version": wire.FORMAT_VERSION,
    }
    record.update(versions)
    for row in config.MUST_MATCH:
        record[row.env] = getattr(config.settings, row.attr)
    for source in _sources:
        record.update(source())
    return record


_MISSING = "<not sent>"


def differences(reference: tuple[int, dict[str, Any]], other: tuple[int, dict[str, Any]]) -> list[str]:
    """Names of the items that differ between two decoded records."""
    if reference[0] != other[0]:
        return ["setup record format"]
    names = list(reference[1]) + [n for n in other[1] if n not in reference[1]]
    return [
        n
        for n in names
        if reference[1].get(n, _MISSING) != other[1].get(n, _MISSING)
        or type(reference[1].get(n)) is not type(other[1].get(n))
    ]


def _show(record: tuple[int, dict[str, Any]], item: str) -> str:
    if item == "setup record format":
        return str(record[0])
    value = record[1].get(item, _MISSING)
    return value if value is _MISSING else repr(value)


def mismatch_error(
    rank: int,
    world: int,
    reference: tuple[int, dict[str, Any]],
    others: list[tuple[int, tuple[int, dict[str, Any]]]],
    total: int,
    *,
    reference_rank: int = 0,
) -> SetupMismatchError:
    """The error every rank raises: each differing item, the reference rank's value (rank 0's, or
    the scope leader's) and each differing rank's."""
    items: list[str] = []
    for _, record in others:
        for item in differences(reference, record):
            if item not in items:
                items.append(item)
    lines = []
    for item in items:
        values = [f"rank {r}: {_show(record, item)}" for r, record in others]
        rest = "" if world == 1 + len(others) else " (and every rank not named here)"
        lines.append(f"  {item}: rank {reference_rank}{rest}: {_show(reference, item)}; " + "; ".join(values))
    more = ""
    if total > len(others):
        more = f"\n  ... and {total - len(others)} more rank(s) differ from rank {reference_rank} (not shown)"
    named = tuple(r for r, _ in others)
    return SetupMismatchError(
        f"setup check on rank {rank}: the ranks disagree about settings or versions that must "
        f"match on every rank (checked when compiler_collectives created its process groups):\n"
        + "\n".join(lines)
        + more
        + "\nSet each of them the same on every rank (the environment of every node and launcher, "
        "or the same enable()/config calls); docs/configuration.md lists what must match.",
        kind="setup",
        rank=rank,
        ranks=named,
    )


def agree(
    store: Any,
    rank: int,
    world: int,
    timeout_s: float,
    record: dict[str, Any],
    on_reference: Callable[[tuple[int, dict[str, Any]], Any], None] | None = None,
) -> None:
    """Run the exchange of ``record`` (``local_record``, taken on the caller's thread).

    Store calls only, so the caller can run it on a helper thread and bound
    it. Raises on a mismatch or an absent rank. ``on_reference`` sees rank
    0's record first and may raise at once (rank 0 in a scope: see ``scope``).
    """
    mine = wire.encode_setup(rank, record)
    deadline = time.monotonic() + timeout_s
    store.set(f"setup/{rank}", mine)
    if rank == 0:
        reference_bytes = mine
    else:
        _wait_or_raise(store, "setup/0", deadline, rank, world, timeout_s)
        reference_bytes = store.get("setup/0")
    reference = read_record(reference_bytes, 0)
    if on_reference is not None:
        on_reference(reference, store)
    if reference_bytes != mine and differences(reference, wire.decode_setup(mine, sender=rank)):
        index = store.add("setup/mismatches", 1)
        store.set(f"setup/mismatch/{index}", str(rank))
    if store.add("setup/arrived", 1) == world:
        store.set("setup/done", "1")
    _wait_or_raise(store, "setup/done", deadline, rank, world, timeout_s)
    total = int(store.add("setup/mismatches", 0))
    if total == 0:
        return
    others = []
    for index in range(1, min(total, _SHOWN_MISMATCHES) + 1):
        sender = int(store.get(f"setup/mismatch/{index}"))
        others.append((sender, read_record(store.get(f"setup/{sender}"), sender)))
    others.sort(key=lambda pair: pair[0])
    raise mismatch_error(rank, world, reference, others, total)


def read_record(data: bytes, sender: int) -> tuple[int, dict[str, Any]]:
    """The record ``sender`` posted, decoded; one that cannot be read is a record whose only
    item says why (itself a difference worth naming)."""
    try:
        return wire.decode_setup(data, sender=sender)
    except WireFormatError as e:
        return wire.SETUP_FORMAT, {"readable setup record": f"no ({e})"}


def _wait_or_raise(store: Any, key: str, deadline: float, rank: int, world: int, timeout_s: float) -> None:
    """Wait for ``key`` until ``deadline``; past it, raise naming the ranks that never arrived."""
    while True:
        # In slices: a rank that fails its own check (a scope that overlaps) reports it on the
        # store, and the heartbeat thread poisons this rank; stop then, not at the timeout.
        remaining = deadline - time.monotonic()
        try:
            store.wait([key], datetime.timedelta(seconds=max(0.001, min(0.25, remaining))))
            return
        except Exception:  # noqa: BLE001 - c10d raises DistStoreError/RuntimeError on a timeout
            pass
        failure = health.latch.first_failure
        if failure is not None:
            raise PeerFailureError(
                f"setup check on rank {rank}: stopped waiting: {failure}", kind="setup", rank=rank, ranks=failure.ranks
            )
        if time.monotonic() >= deadline:
            break
    absent = [r for r in range(world) if not store.check([f"setup/{r}"])]
    raise CollectiveTimeoutError(
        f"setup check on rank {rank}: rank(s) {absent or '(none missing; the store is slow)'} did not "
        f"arrive within {timeout_s:.0f}s (COMPILER_COLLECTIVES_TIMEOUT) when compiler_collectives "
        "created its process groups. They are stuck, much slower, crashed, never compile this code, "
        "or have the compiler and guard collectives switched differently (TORCH_COMPILER_COLLECTIVES "
        "and COMPILER_COLLECTIVES_GUARDS must be the same on every rank). A rank that never ran "
        "any of our code cannot be told apart from a slow one; the likely cause in a pipeline-"
        "parallel job is a later stage waiting for this one's activations. " + SCOPE_HINT,
        kind="setup",
        rank=rank,
        ranks=tuple(absent),
    )
