"""Entry agreement: on every call, every rank is about to run a cache entry with the same collective program.

The guard collective makes ranks agree on *whether* they hit a frame's cache,
not on *which* entry they hit. A frame whose entries run different collectives
(an ``if x.size(0) > 20: all_reduce`` traced once static and once dynamic, LRU
order that differs by rank) can send rank 0 into an entry that all-reduces and
rank 1 into one that does not.

What this module keeps, per frame (the code object Dynamo caches on):

* a registry of its cache entries in creation order. Every compile is a
  collective (the guard collective makes every rank compile together), so the
  registry is the same on every rank: entry ``i`` is the ``i``-th entry on
  every rank, with the same *program*;
* an entry's program: the ordered collectives, without their sizes
  (``size_free``), of every graph level the program audit compared for its
  graphs (levels every rank produced, so the same on every rank), backward
  levels compiled with the forward included. A graph without collectives is
  the empty program; an entry without a graph too;
* ``mixed``: whether the frame's entries do not all share one program. Set
  at a compile, which every rank runs at the same call, so it flips on every
  rank at the same point.

What runs on a call: the program audit's seam wraps what each backend returns
(``wrap``). The wrapper's fast path is one attribute read (``frame.mixed``).
Only in a mixed frame does the first graph of the entry run the check before
it runs anything: one more agreement on the guard channel whose key is the
entry's program (shared memory: one word; gloo: the same two-int64
all-reduce). Equal keys on every rank: go on. Different: every rank takes the
slow path (one all-gather of ``(-guard seq, entry index)`` on the guard group),
renders every group of ranks' entry from its own registry, and raises the same
``ProgramDivergenceError``. Nothing has run on any rank.

Plain Python over the guard channel; the Dynamo seam (``dynamo/compiler_seam.py``,
``dynamo/audit_seam.py``) calls in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import time
from typing import Any, Callable, Sequence

from .. import health
from ..errors import CollectiveError, ProgramDivergenceError, describe
from ..state import FrameId
from ..stats import counters
from . import guard as guard_collective
from .fingerprint import Collective

log = logging.getLogger("compiler_collectives.entry")

_KEY_BITS = (1 << 45) - 1  # the program travels in the guard word's 46-bit key
EMPTY_PROGRAM: tuple[tuple[str, bytes], ...] = ()


_SHAPE = re.compile(r"\[([^\[\]]*)\]")


def size_free(c: Collective) -> tuple[str, ...]:
    """A collective without its sizes: op, group, reduce op, dtypes and ranks of its tensors, arguments.

    Entries differ in sizes all the time without running other collectives: a
    static entry all-reduces ``float32[32, 4]`` where the dynamic one beside it
    all-reduces ``float32[s0, 4]``, and at a call both move the caller's rows.
    Which collectives run, in which order, on which group, is the program.
    """
    def dims(m: re.Match[str]) -> str:
        inner = m.group(1).strip()
        return f"[{inner.count(',') + 1 if inner else 0}d]"

    return (c.op, c.group, c.reduce_op, "\x1d".join(_SHAPE.sub(dims, t) for t in c.tensors), c.args)


@dataclasses.dataclass
class GraphProgram:
    """What the audit agreed on for one graph: per compared level, its collectives."""

    levels: list[tuple[str, bytes, list[Collective]]]  # (level, collectives digest, collectives)


class Entry:
    """One cache entry of a frame: its graphs' programs, in the order Dynamo compiled them."""

    __slots__ = ("index", "compile_id", "attempt", "graphs", "key", "site", "has_graph")

    def __init__(self, compile_id: str, attempt: int) -> None:
        self.index = -1  # creation order in the frame's cache, set when Dynamo keeps the entry
        self.compile_id = compile_id
        self.attempt = attempt
        self.graphs: list[GraphProgram] = []
        self.has_graph = False
        self.key = b""
        self.site = 0
        self._rekey()

    def _rekey(self) -> None:
        h = hashlib.blake2b(digest_size=8)
        for position, graph in enumerate(self.graphs):
            for level, _, collectives in graph.levels:
                h.update(f"{position}:{level}\x1e".encode())
                for c in collectives:
                    h.update("\x1f".join(size_free(c)).encode() + b"\x1e")
        self.key = h.digest()
        self.site = int.from_bytes(self.key, "little") & _KEY_BITS

    def add(self, graph: GraphProgram) -> int:
        self.graphs.append(graph)
        self.has_graph = True
        self._rekey()
        return len(self.graphs) - 1

    def collectives(self, level: str) -> list[Collective]:
        return [c for g in self.graphs for lv, _, cs in g.levels if lv == level for c in cs]

    def levels(self) -> list[str]:
        seen: list[str] = []
        for g in self.graphs:
            for lv, _, _ in g.levels:
                if lv not in seen:
                    seen.append(lv)
        return seen


class Frame:
    """A frame's cache entries as every rank created them, and whether their programs differ."""

    __slots__ = ("frame", "entries", "mixed", "warned")

    def __init__(self, frame: FrameId) -> None:
        self.frame = frame
        self.entries: list[Entry] = []
        self.mixed = False
        self.warned = False

    def commit(self, entry: Entry) -> None:
        entry.index = len(self.entries)
        self.entries.append(entry)
        mixed = len({e.key for e in self.entries}) > 1
        if mixed and not self.mixed:
            counters.entry_mixed_frames += 1
            log.info("frame %s: cache entry #%d (compile %s) runs other collectives than entry #0; "
                     "every call of this frame now checks that every rank runs the same program",
                     self.frame, entry.index, entry.compile_id)
        self.mixed = mixed
        if mixed and not self.warned and any(not e.has_graph for e in self.entries):
            self.warned = True
            log.warning(
                "frame %s has a cache entry without a graph beside entries that run collectives: a "
                "rank entering it cannot take part in the entry check. If its next collective is "
                "one of ours, every rank raises; if it is the program's own, ranks may wait until "
                "a timeout. Avoid a graph break before the first tensor operation of this frame.",
                self.frame)


_frames: dict[Any, Frame] = {}  # code object -> Frame
_building: dict[Any, Entry] = {}  # code object -> the entry its running compile is building


def reset() -> None:
    """Forget every frame (with ``torch._dynamo.reset()``, whose caches this mirrors)."""
    _frames.clear()
    _building.clear()


def frames() -> dict[str, list[dict[str, Any]]]:
    """Every registered frame's entries, for tests and `doctor`: frame -> [{index, compile_id, ...}]."""
    return {
        str(f.frame): [{"index": e.index, "compile_id": e.compile_id, "graphs": len(e.graphs),
                        "program": e.key.hex(), "mixed": f.mixed} for e in f.entries]
        for f in _frames.values()
    }


# ------------------------------------------------------------------ compile time (the seams call in)


def compile_started(code: Any) -> Any:
    """A frame compile begins (``convert_frame._compile``); returns a token for ``compile_finished``."""
    previous = _building.pop(code, None)
    return previous


def compile_finished(code: Any, frame: FrameId, token: Any, kept: bool) -> None:
    """The compile of ``code`` ended; ``kept``: Dynamo added a cache entry for it."""
    entry = _building.pop(code, None)
    if token is not None:
        _building[code] = token  # a compile of the same code further up this thread's stack
    if not kept:
        return
    if entry is None:
        entry = Entry("?", 0)  # an entry without a graph: the empty program
    registry = _frames.get(code)
    if registry is None:
        registry = _frames[code] = Frame(frame)
    registry.commit(entry)


def wrap(
    compiled: Callable[..., Any], code: Any, frame: FrameId, compile_id: str, attempt: int,
    program: GraphProgram, *, check: bool,
) -> Callable[..., Any]:
    """Record ``program`` for the entry being compiled and return what Dynamo should call.

    ``check``: entry agreement is on (guard collective on, setting on). Only
    the entry's first graph checks: one check per call of the entry.
    """
    entry = _building.get(code)
    if entry is None or entry.attempt != attempt:
        # A restarted trace drops the graphs of the attempt before it.
        entry = _building[code] = Entry(compile_id, attempt)
    position = entry.add(program)
    if not check or position > 0:
        return compiled
    registry = _frames.get(code)
    if registry is None:
        registry = _frames[code] = Frame(frame)
    return _checked(compiled, registry, entry)


def _checked(compiled: Callable[..., Any], registry: Frame, entry: Entry) -> Callable[..., Any]:
    def entry_checked(*args: Any, **kwargs: Any) -> Any:
        if registry.mixed:
            check_entry(registry, entry)
        return compiled(*args, **kwargs)

    entry_checked.__wrapped__ = compiled  # type: ignore[attr-defined]
    return entry_checked


# ------------------------------------------------------------------ run time


def check_entry(registry: Frame, entry: Entry) -> None:
    """Every rank is about to run an entry of ``registry``'s frame: raise unless their programs agree."""
    health.check("entry")
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
        everyone = channel.describe_all(-seq, entry.index)
    except CollectiveError:
        raise
    except Exception as e:  # noqa: BLE001 - gloo's own errors: through the failure procedure
        err = guard_collective.translate_entry_failure(e, seq=seq, frame=str(registry.frame))
        raise err from e
    finally:
        counters.entry_checks += 1
        counters.entry_check_time_s += time.perf_counter() - started
    _compare(registry, entry, everyone, channel.pg.rank(), seq)


def _compare(registry: Frame, entry: Entry, everyone: Sequence[tuple[int, int]], rank: int, seq: int) -> None:
    elsewhere = [r for r, (s, _) in enumerate(everyone) if s != -seq]
    if elsewhere:
        err = _elsewhere(registry, entry, everyone, elsewhere, rank, seq)
    else:
        hit = [registry.entries[i] if 0 <= i < len(registry.entries) else None for _, i in everyone]
        if all(h is not None and h.key == entry.key for h in hit):
            return  # the same program (the slow path of a channel without keys)
        err = _divergence(registry, [h if h is not None else Entry("?", 0) for h in hit],
                          [i for _, i in everyone], rank, seq)
    counters.entry_divergences += 1
    counters.errors += 1
    health.poison(err)
    raise err


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _first_difference(entries: list[Entry]) -> tuple[str, int]:
    """The first level at which the entries' collectives differ, and the index of the first difference."""
    for level in ("dynamo", "aot_forward", "inductor_forward", "aot_backward", "inductor_backward"):
        lists = [e.collectives(level) for e in entries]
        keys = [[size_free(c) for c in cs] for cs in lists]
        if any(k != keys[0] for k in keys):
            longest = max(len(k) for k in keys)
            index = next(i for i in range(longest + 1)
                         if len({k[i] if i < len(k) else None for k in keys}) > 1)
            return level, index
    return "", 0  # differ only in which levels were compared (an entry loaded from a cache on every rank)


def _divergence(registry: Frame, hit: list[Entry], indices: list[int], rank: int, seq: int) -> ProgramDivergenceError:
    by_entry: dict[int, list[int]] = {}
    for r, i in enumerate(indices):
        by_entry.setdefault(i, []).append(r)
    distinct = [hit[ranks[0]] for ranks in by_entry.values()]
    level, index = _first_difference(distinct)
    lines = []
    versions: dict[int, str | None] = {}
    for i, ranks in by_entry.items():
        e = hit[ranks[0]]
        if level:
            cs = e.collectives(level)
            text = (cs[index].render() if index < len(cs)
                    else f"no collective #{index + 1} ({len(cs)} collective(s) in all)")
        else:
            text = f"program {e.key.hex()} over level(s) {', '.join(e.levels()) or 'none'}"
        for r in ranks:
            versions[r] = text
        graph = "" if e.has_graph else " (no graph)"
        lines.append(f"  {_ranks_text(ranks)}: cache entry #{i}, compile {e.compile_id}{graph}: {text}")
    largest = max(by_entry.values(), key=lambda rs: (len(rs), -rs[0]))
    implicated = tuple(r for r in range(len(indices)) if r not in largest)
    where = f"collective #{index + 1} of {level}" if level else "the levels compared"
    message = (
        f"{describe('entry', rank, seq, str(registry.frame))}: the ranks hit different cache entries "
        f"of this frame, and those entries run different collectives; no rank has run its entry.\n"
        f"First difference: {where}:\n" + "\n".join(lines) + "\n"
        "The guard collective made every rank hit the cache, but each rank's own guards chose the "
        "entry: a guard on a size (e.g. `x.size(0) <= 20` of a dynamic dim beside a static entry) "
        "or the cache's LRU order let ranks with different inputs pick different entries. Make the "
        "program independent of the inputs that differ across ranks (branch on something every "
        "rank shares), or give every rank the same sizes at this call; mark the dim dynamic from "
        "the start (torch._dynamo.mark_dynamic) so one entry serves every size. "
        "COMPILER_COLLECTIVES_ENTRY_CHECK=0 on every rank turns this check off."
    )
    return ProgramDivergenceError(
        message, kind="entry", rank=rank, seq=seq, frame=str(registry.frame), ranks=implicated,
        level=level or None, index=index, versions=versions,
    )


def _elsewhere(registry: Frame, entry: Entry, everyone: Sequence[tuple[int, int]], elsewhere: list[int],
               rank: int, seq: int) -> ProgramDivergenceError:
    checking = [r for r in range(len(everyone)) if r not in elsewhere]
    message = (
        f"{describe('entry', rank, seq, str(registry.frame))}: {_ranks_text(checking)} entered cache "
        f"entry #{entry.index} (compile {entry.compile_id}) of this frame, whose entries run "
        f"different collectives, while {_ranks_text(elsewhere)} did not check an entry of it: they "
        "entered an entry without a graph (the empty program) and went on to another compiled "
        "frame. No rank has run the entry's collectives. Avoid a graph break before the first "
        "tensor operation of this frame, or make its program independent of per-rank inputs."
    )
    return ProgramDivergenceError(message, kind="entry", rank=rank, seq=seq, frame=str(registry.frame),
                                  ranks=tuple(elsewhere))
