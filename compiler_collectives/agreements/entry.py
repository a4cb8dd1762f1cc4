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
  every rank. Numbers are never reused; the newest entries are kept, as many
  as Dynamo keeps for one code object (``accumulated_recompile_limit``);
* an entry's *program*: per phase (forward, then backward), the ordered
  collectives, without their sizes (``size_free``), at the deepest level the
  backend produced for that phase (inductor's post-grad graph, else
  AOTAutograd's, else Dynamo's). Which levels exist (cache hits, a backend
  without AOTAutograd) never enters it: a graph without collectives, and an
  entry without a graph, run the empty program. Its *key* adds the resume
  functions the entry's code calls after a graph break;
* ``mixed``: whether two of the frame's entries ever had different keys. Set
  at a compile, which every rank runs at the same call, so it flips on every
  rank at the same point, and stays set until a reset.

What runs on a call: the program audit's seam wraps what each backend returns
(``wrap``). The wrapper's fast path is one attribute read (``frame.mixed``).
Only in a mixed frame does the first graph of the entry run the check before
it runs anything: one more agreement on the guard channel whose key is the
entry's key (shared memory: one word; gloo: the same two-int64 all-reduce).
Equal keys on every rank: go on. Different: every rank takes the slow path
(one all-gather of ``(-guard seq, entry index)`` on the guard group). Entries
that run the same collectives and differ only in their graph breaks (or a
rank in an entry without a graph that went into its resume function, beside
checking entries that communicate nothing) are no divergence: the ranks go on
apart until their next call from their own code (``guard.paths_diverged``).
Otherwise every rank renders every group of ranks' entry from its own
registry and raises the same ``ProgramDivergenceError``, naming global ranks.
Nothing has run on any rank.

Plain Python over the guard channel; the Dynamo seam (``dynamo/compiler_seam.py``,
``dynamo/audit_seam.py``) calls in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .. import health, process_state
from ..errors import CollectiveError, ProgramDivergenceError, describe, program_divergence, ranks_text
from ..ledger import ledger
from ..observations import FrameId
from ..records import Divergence, EntryCheck, Failure, MixedFrame
from ..transport import groups
from . import guard as guard_collective
from .fingerprint import Collective

log = logging.getLogger("compiler_collectives.entry")

_KEY_BITS = (1 << 45) - 1  # the program travels in the guard word's 46-bit key

# A phase's program is read at the deepest level the backend produced for it.
PHASE_LEVELS = {
    "forward": ("inductor_forward", "aot_forward", "dynamo"),
    "backward": ("inductor_backward", "aot_backward"),
}

_SHAPE = re.compile(r"\[([^\[\]]*)\]")


def _op_identity(op: str) -> str:
    """The collective an op performs, whichever variant a level spells it with.

    Inductor's post-grad graphs run ``all_reduce_`` (in place) or
    ``all_gather_into_tensor_out`` where Dynamo's graph has ``all_reduce``:
    the same message on the wire. An entry whose levels every rank loaded
    from a cache is read at a shallower level than one compiled in full, and
    the two must still compare equal when they run the same collectives.
    """
    namespace, _, rest = op.partition(".")
    name = rest.partition(".")[0] or namespace
    if rest:
        namespace = namespace.removesuffix("_autograd")
    else:
        namespace = ""
    name = name.removesuffix("_out").rstrip("_")
    return f"{namespace}.{name}" if namespace else name


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

    return (_op_identity(c.op), c.group, c.reduce_op, "\x1d".join(_SHAPE.sub(dims, t) for t in c.tensors), c.args)


@dataclasses.dataclass
class GraphProgram:
    """What the audit agreed on for one graph: per compared level, its collectives."""

    levels: list[tuple[str, bytes, list[Collective]]]  # (level, collectives digest, collectives)

    def phase(self, phase: str) -> tuple[str, list[Collective]]:
        """(level, collectives) of ``phase`` at the deepest level compared; ("", []) if none was."""
        by_level = {lv: cs for lv, _, cs in self.levels}
        for level in PHASE_LEVELS[phase]:
            if level in by_level:
                return level, by_level[level]
        return "", []


class Entry:
    """One cache entry of a frame: its graphs' programs, in the order Dynamo compiled them.

    Its program, per phase, is what runs when the entry runs: the forwards'
    collectives in graph order, then (at ``backward()``) the backwards' in
    reverse graph order, each read at the deepest level compared. Which levels
    exist never enters it: a graph without collectives, and an entry without
    a graph, run the empty program.
    """

    __slots__ = ("attempt", "compile_id", "graphs", "has_graph", "index", "key", "program_key", "resumes", "site")

    def __init__(self, compile_id: str, attempt: int) -> None:
        self.index = -1  # creation order in the frame's cache, set when Dynamo keeps the entry
        self.compile_id = compile_id
        self.attempt = attempt
        self.graphs: list[GraphProgram] = []
        # The resume functions its code calls after graph breaks (by bytecode offset): compiled
        # frames of their own, entered only by ranks that run this entry.
        self.resumes: tuple[str, ...] = ()
        self.has_graph = False
        self.program_key = b""  # the collectives alone
        self.key = b""  # the collectives and the resume functions: what the check compares
        self.site = 0
        self._rekey()

    def _rekey(self) -> None:
        h = hashlib.blake2b(digest_size=8)
        for phase in PHASE_LEVELS:
            h.update(f"{phase}\x1e".encode())
            for c in self.collectives(phase):
                h.update("\x1f".join(size_free(c)).encode() + b"\x1e")
        self.program_key = h.digest()
        if self.resumes:
            h.update(("resumes\x1e" + "\x1f".join(self.resumes)).encode())
        self.key = h.digest()
        self.site = int.from_bytes(self.key, "little") & _KEY_BITS

    def set_resumes(self, resumes: tuple[str, ...]) -> None:
        self.resumes = resumes
        self._rekey()

    def runs_no_collective(self) -> bool:
        return not any(g.phase(p)[1] for g in self.graphs for p in PHASE_LEVELS)

    def add(self, graph: GraphProgram) -> int:
        self.graphs.append(graph)
        self.has_graph = True
        self._rekey()
        return len(self.graphs) - 1

    def collectives(self, phase: str) -> list[Collective]:
        """The collectives ``phase`` runs, in run order."""
        graphs = self.graphs if phase == "forward" else reversed(self.graphs)
        return [c for g in graphs for c in g.phase(phase)[1]]

    def levels(self, phase: str) -> list[str]:
        """The level each graph's ``phase`` was read at (for messages)."""
        seen: list[str] = []
        for g in self.graphs:
            level = g.phase(phase)[0]
            if level and level not in seen:
                seen.append(level)
        return seen


class Frame:
    """A frame's cache entries as every rank created them, and whether their programs differ.

    Everything here changes only at a compile, which every rank runs at the
    same call (the guard collective): the registry is the same on every rank.
    Entries are numbered in creation order and a number is never reused. The
    registry keeps the newest ``limit`` entries (Dynamo's
    ``accumulated_recompile_limit``: it never holds more for one code object);
    ``mixed`` is sticky: once two entries ran different programs the frame is
    checked until a reset, whatever became of those entries on any rank (one
    rank's garbage collector can free a guarded object, and Dynamo drop the
    entry there only).
    """

    __slots__ = ("__weakref__", "created", "entries", "first_key", "frame", "mixed", "warned")

    def __init__(self, frame: FrameId) -> None:
        self.frame = frame
        self.entries: dict[int, Entry] = {}  # index -> entry, oldest first
        self.created = 0
        self.first_key: bytes | None = None
        self.mixed = False
        self.warned = False

    def commit(self, entry: Entry, limit: int) -> None:
        entry.index = self.created
        self.created += 1
        self.entries[entry.index] = entry
        while len(self.entries) > max(1, limit):
            del self.entries[next(iter(self.entries))]
        if self.first_key is None:
            self.first_key = entry.key
        elif entry.key != self.first_key and not self.mixed:
            self.mixed = True
            ledger.add(MixedFrame(str(self.frame)))
            log.info(
                "frame %s: cache entry #%d (compile %s) runs other collectives than entry #0; "
                "every call of this frame now checks that every rank runs the same program",
                self.frame,
                entry.index,
                entry.compile_id,
            )
        entries = self.entries.values()
        if (
            self.mixed
            and not self.warned
            and any(not e.has_graph for e in entries)
            and not all(e.runs_no_collective() for e in entries)
        ):
            self.warned = True
            log.warning(
                "frame %s has a cache entry without a graph beside entries that run other "
                "collectives: a rank entering it cannot take part in the entry check. If its next "
                "collective is one of ours, every rank raises; if it is the program's own, ranks "
                "may wait until a timeout. Avoid a graph break before the first tensor operation "
                "of this frame.",
                self.frame,
            )


# code object -> Frame. Weak: a code object nothing else holds (a freed FX
# module's forward) has no cache entries left to check.
_frames: weakref.WeakKeyDictionary[Any, Frame] = weakref.WeakKeyDictionary()
_building: dict[Any, Entry] = {}  # code object -> the entry its running compile is building


@process_state.clears(
    process_state.RESET,
    process_state.TORCH_RESET,
    names=("_frames", "_building"),
    what="entry agreement's registry of every frame's cache entries",
)
def reset() -> None:
    """Forget every frame (with ``torch._dynamo.reset()``, whose caches this mirrors)."""
    _frames.clear()
    _building.clear()


def mixed_codes() -> list[Any]:
    """The code objects of frames whose entries run different programs (checked on every call)."""
    return [code for code, f in list(_frames.items()) if f.mixed]


def frames() -> dict[str, list[dict[str, Any]]]:
    """Every registered frame's entries, for tests and `doctor`: frame -> [{index, compile_id, ...}]."""
    return {
        str(f.frame): [
            {
                "index": e.index,
                "compile_id": e.compile_id,
                "graphs": len(e.graphs),
                "program": e.key.hex(),
                "mixed": f.mixed,
            }
            for e in f.entries.values()
        ]
        for f in list(_frames.values())
    }


# ------------------------------------------------------------------ compile time (the seams call in)


def compile_started(code: Any) -> Any:
    """A frame compile begins (``convert_frame._compile``); returns a token for ``compile_finished``."""
    previous = _building.pop(code, None)
    return previous


def compile_finished(
    code: Any, frame: FrameId, token: Any, kept: bool, *, limit: int, resumes: tuple[str, ...] = ()
) -> None:
    """The compile of ``code`` ended; ``kept``: Dynamo added a cache entry for it.

    ``limit``: how many entries Dynamo keeps for one code object at most;
    ``resumes``: the resume functions the entry's code calls (graph breaks).
    A compile on this rank's own path (``guard.apart()``) is not registered:
    the registry holds the compiles every rank ran together.
    """
    entry = _building.pop(code, None)
    if token is not None:
        _building[code] = token  # a compile of the same code further up this thread's stack
    if not kept or guard_collective.apart():
        return
    if entry is None:
        entry = Entry("?", 0)  # an entry without a graph: the empty program
    entry.set_resumes(resumes)
    _registry(code, frame).commit(entry, limit)


def _registry(code: Any, frame: FrameId) -> Frame:
    registry = _frames.get(code)
    if registry is None:
        registry = _frames[code] = Frame(frame)
    return registry


def wrap(
    compiled: Callable[..., Any],
    code: Any,
    frame: FrameId,
    compile_id: str,
    attempt: int,
    program: GraphProgram,
    *,
    check: bool,
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
    return _checked(compiled, _registry(code, frame), entry)


def _checked(compiled: Callable[..., Any], registry: Frame, entry: Entry) -> Callable[..., Any]:
    def entry_checked(*args: Any, **kwargs: Any) -> Any:
        if registry.mixed:
            check_entry(registry, entry)
        return compiled(*args, **kwargs)

    entry_checked.__wrapped__ = compiled  # type: ignore[attr-defined]  # a function attribute, as functools.wraps sets
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
        empty = guard_collective.EMPTY if entry.runs_no_collective() else 0
        everyone = channel.describe_all(-seq, entry.index | empty)
    except CollectiveError:
        raise
    except Exception as e:
        err = guard_collective.translate_entry_failure(e, seq=seq, frame=str(registry.frame))
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
        if guard_collective.paths_diverged(everyone):
            # Peers went into a resume function of an entry that communicates nothing.
            guard_collective.go_apart(seq)
            return
        err = _elsewhere(registry, entry, [m for m in members if m not in elsewhere], elsewhere, rank, seq)
    else:
        index_bits = guard_collective.EMPTY - 1
        hit = {members[r]: registry.entries.get(i & index_bits) for r, (_, i) in enumerate(everyone)}
        if all(h is not None and h.key == entry.key for h in hit.values()):
            return  # the same program (the slow path of a channel without keys)
        if all(h is not None and h.program_key == entry.program_key for h in hit.values()):
            # The same collectives; the entries differ only in the resume functions they call.
            guard_collective.go_apart(seq)
            return
        indices = {members[r]: i & index_bits for r, (_, i) in enumerate(everyone)}
        err = _divergence(registry, hit, indices, rank, seq)
    ledger.add(Divergence("entry"))
    ledger.add(Failure("entry"))
    health.poison(err)
    raise err


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
