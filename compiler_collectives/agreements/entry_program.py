"""Entry agreement's programs: what a cache entry runs, and a frame's entries in creation order.

An entry's *program* is, per phase (forward, then backward), the ordered collectives without
their sizes (``size_free``), at the deepest level the backend produced for that phase
(``PHASE_LEVELS``: inductor's post-grad graph, else AOTAutograd's, else Dynamo's). Which levels
exist never enters it: a graph without collectives, and an entry without a graph, run the
empty program. Its *key* adds the resume functions the entry's code calls after a graph
break; its ``site`` is the key as the guard word carries it.

A ``Frame`` holds one frame's entries, numbered in creation order, and ``mixed``: whether two
of them ever had different keys. The registry of every frame is ``entry.py``; the check at a
call, ``entry_check.py``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re

from ..ledger import ledger
from ..observations import FrameId
from ..records import MixedFrame
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
