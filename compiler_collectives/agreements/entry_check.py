"""Entry agreement's check: every rank is about to run an entry of a mixed frame; raise unless their programs agree.

Runs when the first graph of an entry of a frame whose entries run different programs is
called (``entry.wrap``): one more agreement on the guard channel whose key is the entry's key
(shared memory: one word; gloo: the same two-int64 all-reduce). Equal keys on every rank: go
on. Different: every rank takes the slow path (one all-gather of ``(-guard seq, entry index)``
on the guard group) and compares the entries from its own registry (``_compare``): entries
that differ only in their graph breaks go apart (``guard_paths.go_apart``); otherwise every rank
raises the same ``ProgramDivergenceError``, counted and poisoning this rank through the failure
procedure (``failure.fail``, ``VERDICT``: every rank reaches it alike, nothing is published).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from .. import health
from ..errors import CollectiveError, ProgramDivergenceError, describe, program_divergence, ranks_text
from ..ledger import ledger
from ..records import Divergence, EntryCheck
from ..transport import groups
from . import failure
from . import guard as guard_collective
from .entry_program import PHASE_LEVELS, Entry, Frame, size_free
from .guard_failure import translate_entry_failure
from .guard_paths import EMPTY, go_apart, paths_diverged


def check_entry(registry: Frame, entry: Entry) -> None:
    """Every rank is about to run an entry of ``registry``'s frame: raise unless their programs agree."""
    health.latch.check("entry")
    found = guard_collective.entry_check_channel()
    if found is None:  # not distributed, or no guard collective: cache contents need not be in step
        return
    channel, seq = found
    started = time.perf_counter()
    try:
        if channel.check_desync:
            _, in_step = channel.agree(True, seq, entry.site)
            if in_step:
                return
        # Every rank gets here together: the keys differed (or the channel carries no keys).
        empty = EMPTY if entry.runs_no_collective() else 0
        everyone = channel.describe_all(-seq, entry.index | empty)
    except CollectiveError:
        raise
    except Exception as e:
        err = translate_entry_failure(e, seq=seq, frame=str(registry.frame))
        raise err from e
    finally:
        ledger.add(EntryCheck(time.perf_counter() - started))
    members = groups.member_ranks(channel.pg)  # messages and fields name global ranks
    _compare(registry, entry, everyone, members, members[channel.pg.rank()], seq)


def _compare(
    registry: Frame, entry: Entry, everyone: Sequence[tuple[int, int]], members: Sequence[int], rank: int, seq: int
) -> None:
    """``everyone``: per group rank, (-guard seq, entry index); ``members``: their global ranks."""
    elsewhere = [members[r] for r, (s, _) in enumerate(everyone) if s != -seq]
    if elsewhere:
        if paths_diverged(everyone):
            # Peers went into a resume function of an entry that communicates nothing.
            go_apart(seq)
            return
        err = _elsewhere(registry, entry, [m for m in members if m not in elsewhere], elsewhere, rank, seq)
    else:
        index_bits = EMPTY - 1
        hit = {members[r]: registry.entries.get(i & index_bits) for r, (_, i) in enumerate(everyone)}
        if all(h is not None and h.key == entry.key for h in hit.values()):
            return  # the same program (the slow path of a channel without keys)
        if all(h is not None and h.program_key == entry.program_key for h in hit.values()):
            # The same collectives; the entries differ only in the resume functions they call.
            go_apart(seq)
            return
        indices = {members[r]: i & index_bits for r, (_, i) in enumerate(everyone)}
        err = _divergence(registry, hit, indices, rank, seq)
    ledger.add(Divergence("entry"))
    raise failure.fail(err, kind="entry", cause=failure.VERDICT)


def _first_difference(entries: list[Entry]) -> tuple[str, int]:
    """The first phase whose collectives differ between ``entries``, and the index of the first difference."""
    for phase in PHASE_LEVELS:
        keys = [[size_free(c) for c in e.collectives(phase)] for e in entries]
        if any(k != keys[0] for k in keys):
            longest = max(len(k) for k in keys)
            index = next(i for i in range(longest + 1) if len({k[i] if i < len(k) else None for k in keys}) > 1)
            return phase, index
    return "", 0  # an entry this rank no longer holds (older than Dynamo's limit)


def _divergence(
    registry: Frame, hit: dict[int, Entry | None], indices: dict[int, int], rank: int, seq: int
) -> ProgramDivergenceError:
    """``hit``/``indices``: per global rank, the entry it is about to run (None: no longer held here)."""
    by_entry: dict[int, list[int]] = {}
    for r, i in indices.items():
        by_entry.setdefault(i, []).append(r)
    known = [e for e in (hit[ranks[0]] for ranks in by_entry.values()) if e is not None]
    phase, index = _first_difference(known)
    shown = []
    versions: dict[int, str | None] = {}
    for i, ranks in by_entry.items():
        e = hit[ranks[0]]
        if e is None:
            text: str | None = None
            shown.append(
                (
                    ranks,
                    f"cache entry #{i} (older than the {len(registry.entries)} "
                    "entries this rank keeps for the frame; its program is not known here)",
                )
            )
        else:
            if phase:
                cs = e.collectives(phase)
                text = (
                    cs[index].render()
                    if index < len(cs)
                    else f"no collective #{index + 1} ({len(cs)} collective(s) in all)"
                )
            else:
                text = f"program {e.key.hex()}"
            graph = "" if e.has_graph else " (no graph)"
            shown.append((ranks, f"cache entry #{i}, compile {e.compile_id}{graph}: {text}"))
        for r in ranks:
            versions[r] = text
    return program_divergence(
        kind="entry",
        rank=rank,
        seq=seq,
        frame=str(registry.frame),
        problem=(
            "the ranks hit different cache entries of this frame, and those entries run different "
            "collectives; no rank has run its entry."
        ),
        where=f"collective #{index + 1} of the {phase} program" if phase else "the programs",
        shown=shown,
        ranks=sorted(indices),
        advice=(
            "The guard collective made every rank hit the cache, but each rank's own guards chose the "
            "entry: a guard on a size (e.g. `x.size(0) <= 20` of a dynamic dim beside a static entry) "
            "or the cache's LRU order let ranks with different inputs pick different entries. Make the "
            "program independent of the inputs that differ across ranks (branch on something every "
            "rank shares), or give every rank the same sizes at this call; mark the dim dynamic from "
            "the start (torch._dynamo.mark_dynamic) so one entry serves every size. "
            "COMPILER_COLLECTIVES_ENTRY_CHECK=0 on every rank turns this check off."
        ),
        level=phase or None,
        index=index,
        versions=versions,
    )


def _elsewhere(
    registry: Frame, entry: Entry, checking: list[int], elsewhere: list[int], rank: int, seq: int
) -> ProgramDivergenceError:
    message = (
        f"{describe('entry', rank, seq, str(registry.frame))}: {ranks_text(checking)} entered cache "
        f"entry #{entry.index} (compile {entry.compile_id}) of this frame, whose entries run "
        f"different collectives, while {ranks_text(elsewhere)} did not check an entry of it: they "
        "entered an entry without a graph (the empty program) and went on to another compiled "
        "frame. No rank has run the entry's collectives. Avoid a graph break before the first "
        "tensor operation of this frame, or make its program independent of per-rank inputs."
    )
    return ProgramDivergenceError(
        message, kind="entry", rank=rank, seq=seq, frame=str(registry.frame), ranks=tuple(elsewhere)
    )
