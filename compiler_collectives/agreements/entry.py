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
apart until their next call from their own code (``guard_paths.paths_diverged``).
Otherwise every rank renders every group of ranks' entry from its own
registry and raises the same ``ProgramDivergenceError``, naming global ranks.
Nothing has run on any rank.

Plain Python over the guard channel; the Dynamo seam (``dynamo/compiler_seam.py``,
``dynamo/audit_seam.py``) calls in. Here: the registry of every frame and what the seams call
at a compile; an entry's program and a frame's entries are ``entry_program.py``, the check at a
call ``entry_check.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from ..observations import FrameId
from .entry_check import check_entry
from .entry_program import Entry, Frame, GraphProgram
from .guard_paths import apart

# code object -> Frame. Weak: a code object nothing else holds (a freed FX
# module's forward) has no cache entries left to check.
_frames: weakref.WeakKeyDictionary[Any, Frame] = weakref.WeakKeyDictionary()
_building: dict[Any, Entry] = {}  # code object -> the entry its running compile is building


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
    A compile on this rank's own path (``guard_paths.apart()``) is not registered:
    the registry holds the compiles every rank ran together.
    """
    entry = _building.pop(code, None)
    if token is not None:
        _building[code] = token  # a compile of the same code further up this thread's stack
    if not kept or apart():
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
