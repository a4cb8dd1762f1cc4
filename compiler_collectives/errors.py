"""The exception types compiler_collectives raises, and how their messages read.

Every exception type of the package is declared here. Every runtime failure
of a collective is a ``CollectiveError``; the subclass says what went wrong.
Messages are written for the engineer on call: which rank, which collective
and frame (``co_name`` at ``file:line``), what differed, and what to set or
check next.
"""

from __future__ import annotations

from collections.abc import Sequence


class CollectiveError(RuntimeError):
    """Raised when a compiler or guard collective cannot reach agreement.

    The attributes below give the context in machine-readable form: ``kind``,
    ``rank``, ``seq``, ``frame``, ``ranks`` and ``reported_by``.
    """

    kind: str | None
    """The collective: "compiler", "guard", "audit", "setup", "scope", ... (None if unknown)."""
    rank: int | None
    """This rank (global), where the error was raised."""
    seq: int | None
    """This rank's sequence number for that kind of collective, if it has one."""
    frame: str | None
    """The frame being compiled or guarded, ``co_name at file:line``, or None."""
    ranks: tuple[int, ...]
    """The peers implicated (the sender of a bad payload, the ranks absent or out of step, the
    rank that failed or left)."""
    reported_by: tuple[int, ...]
    """The peer(s) whose failure report this rank learned of the failure from (through the
    store, or the shared-memory failure word); empty when this rank saw the failure itself."""

    def __init__(
        self,
        message: str,
        *,
        kind: str | None = None,
        rank: int | None = None,
        seq: int | None = None,
        frame: str | None = None,
        ranks: tuple[int, ...] = (),
        reported_by: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.rank = rank
        self.seq = seq
        self.frame = frame
        self.ranks = tuple(ranks)
        self.reported_by = tuple(reported_by)


class WireFormatError(CollectiveError):
    """Raised when a payload from a rank is malformed, truncated, oversized or
    of another format version. Names the sending rank."""


class CollectiveTimeoutError(CollectiveError):
    """Raised when a collective (or the creation of our process groups) waited
    longer than COMPILER_COLLECTIVES_TIMEOUT for the other ranks."""


class PeerFailureError(CollectiveError):
    """Raised when a peer rank failed: its connection broke mid-collective (the
    peer process most likely crashed or was killed), or it reported a failure
    (``reported_by``), or it left the job (``left``: its own code raised while
    it waited in a collective). Names that rank and its cause."""

    left: bool
    """Whether the rank named left the job (its own code raised while it waited in a
    collective) rather than failed."""

    def __init__(
        self,
        message: str,
        *,
        kind: str | None = None,
        rank: int | None = None,
        seq: int | None = None,
        frame: str | None = None,
        ranks: tuple[int, ...] = (),
        reported_by: tuple[int, ...] = (),
        left: bool = False,
    ) -> None:
        super().__init__(message, kind=kind, rank=rank, seq=seq, frame=frame, ranks=ranks, reported_by=reported_by)
        self.left = left

    @classmethod
    def stopped_waiting(
        cls, where: str, failure: CollectiveError, *, kind: str | None = None, rank: int | None = None
    ) -> PeerFailureError:
        """A wait of ours that ended because this rank heard of ``failure`` (its latch's first):
        says ``where`` it waited, and keeps who failed and who reported it, so that the failure
        procedure quotes that report."""
        return cls(
            f"{where}: {failure}",
            kind=kind,
            rank=rank,
            ranks=failure.ranks,
            reported_by=failure.reported_by,
            left=getattr(failure, "left", False),
        )


class CollectiveDesyncError(CollectiveError):
    """Raised when ranks reached the same collective from different places:
    different frames, or a different number of earlier calls."""


class SetupMismatchError(CollectiveError):
    """Raised on every rank when our process groups are created and the ranks
    disagree about something that must match: a version (package, torch, wire
    format, protocol) or a setting that shapes a collective. Names each
    differing item and each rank's value."""


class CollectivePoisonedError(CollectiveError):
    """Raised by every collective after an earlier one failed on this rank;
    the original failure is chained as ``__cause__``. Recover with
    ``compiler_collectives.reset()`` on every rank."""


class ConcurrentThreadsError(CollectiveError):
    """Raised in a Python thread that calls compiled code with guard
    collectives on, or a function that needs compiling with compiler or guard
    collectives on, while another thread of the same rank owns them (the
    thread of the rank's first compiled call, while it lives). Names both
    threads. Nothing ran for that call; the other thread is unaffected."""


class ProgramDivergenceError(CollectiveError):
    """Raised on every rank, before any rank runs the graph, when the ranks
    compiled different collectives for the same compiled graph (the program
    audit). Attributes: ``level`` (the graph level that differed first, e.g.
    ``"dynamo"`` or ``"aot_backward"``), ``index`` (0-based position of the
    first differing collective at that level) and ``versions`` (rank -> that
    rank's rendering of it, or None where the rank has no collective there)."""

    def __init__(
        self,
        message: str,
        *,
        level: str | None = None,
        index: int | None = None,
        versions: dict[int, str | None] | None = None,
        **context: object,
    ) -> None:
        super().__init__(message, **context)  # type: ignore[arg-type]  # the context keywords, as CollectiveError types them
        self.level = level
        self.index = index
        self.versions = dict(versions or {})


class CompileOnceError(CollectiveError):
    """Raised on a rank that waited for another rank to compile a graph for it (compile once,
    ``COMPILER_COLLECTIVES_COMPILE_ONCE``) when that compile raised (quoting its error and rank),
    when the wait passed ``COMPILER_COLLECTIVES_COMPILE_TIMEOUT`` while the compiling rank was
    alive, or when the ranks' compile-once messages do not fit one plan. A compiling rank that
    died is a ``PeerFailureError`` naming it."""


class CompileTimeoutError(CollectiveError):
    """Raised on a rank that waited for other ranks to compile a graph again without caches (the
    program audit's recompile, after some ranks loaded levels from a cache that others compiled)
    past ``COMPILER_COLLECTIVES_COMPILE_TIMEOUT`` while they were alive. A rank that died while
    compiling is a ``PeerFailureError`` naming it."""


class StoreFailureError(CollectiveError):
    """Raised on a rank that waited for other ranks to compile (compile once's loaders, the
    audit's recompile) when the c10d store failed under the wait: its host went away (the
    connection was reset or closed), a store call raised, or the store stopped answering
    (a call of this rank's stayed unanswered past ``COMPILER_COLLECTIVES_TIMEOUT``). Names the
    store (``host:port`` for a TCPStore) and what it was asked; the store's own error is chained
    as ``__cause__``. Published like any failure, so the other ranks hear of it where the store
    or this host's shared memory still reaches them."""


class ScopeError(CollectiveError):
    """Raised by ``compiler_collectives.scope(...)`` (or where our groups are
    first created under ``COMPILER_COLLECTIVES_SCOPE``) when the scope cannot be
    used: called after a compile, a group that does not contain the calling
    rank, a mesh that is not 1-D, or scopes that overlap (two ranks name
    different, intersecting sets of ranks). Names the ranks and each one's scope."""


SCOPE_HINT = (
    "If these ranks run different programs by design (pipeline-parallel stages), scope the "
    "service to the ranks that run the same program: compiler_collectives.scope(stage_group) on "
    "every rank before its first compile, or COMPILER_COLLECTIVES_SCOPE=consecutive:<stages> "
    "(stage = a block of consecutive ranks, torchtitan's order) or strided:<stages> "
    '(stage = rank % stages); see docs/usage.md, "Pipeline parallelism".'
)
"""The fix the messages name when ranks look like they run different programs and no scope is set."""


class UnsupportedTorchError(ImportError):
    """Raised at import when the installed torch lacks a Dynamo seam we patch, or one of
    the seam table's reads no longer holds."""


class ConfigError(ValueError):
    """Raised when an environment variable holds a value we cannot parse."""


class ReportError(ValueError):
    """Raised by ``report`` when the trace directory or one of its files cannot be used."""


class StoreUnresponsive(Exception):
    """The c10d store did not answer within the bound (internal: the caller turns it into
    a ``CollectiveTimeoutError`` that says what it was doing)."""

    def __init__(self, what: str, timeout_s: float) -> None:
        super().__init__(f"the c10d store did not answer {what} within {timeout_s:.1f}s")
        self.what = what
        self.timeout_s = timeout_s


class MalformedPayload(Exception):
    """A peer's msgpack payload failed validation (internal to ``agreements/wire/``, whose
    ``decode`` functions turn it into a ``WireFormatError`` naming the sender)."""


def ranks_text(ranks: Sequence[int]) -> str:
    """'rank 3' or 'ranks 0, 2': how messages name (global) ranks."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def describe(
    kind: str | None,
    rank: int | None,
    seq: int | None,
    frame: str | None,
) -> str:
    """The common prefix of our messages: 'compiler collective #3 on rank 1 (frame f at a.py:10)'."""
    what = f"{kind} collective" if kind else "collective"
    if seq is not None:
        what += f" #{seq}"
    if rank is not None:
        what += f" on rank {rank}"
    if frame:
        what += f" (frame {frame})"
    return what


def program_divergence(
    *,
    kind: str,
    rank: int,
    seq: int,
    frame: str,
    problem: str,
    where: str,
    shown: Sequence[tuple[Sequence[int], str]],
    ranks: Sequence[int],
    advice: str,
    level: str | None,
    index: int,
    versions: dict[int, str | None],
) -> ProgramDivergenceError:
    """The one error every rank raises when the ranks' programs differ (the audit's and entry agreement's).

    ``shown``: per version of the first difference (``where``), the ranks that
    hold it and how it reads. The ranks outside the largest of those groups
    (the first one on a tie), in the order of ``ranks``, are the odd ones out
    the error names.
    """
    largest = max((group for group, _ in shown), key=lambda group: (len(group), -group[0]))
    lines = "\n".join(f"  {ranks_text(group)}: {text}" for group, text in shown)
    return ProgramDivergenceError(
        f"{describe(kind, rank, seq, frame)}: {problem}\nFirst difference: {where}:\n{lines}\n{advice}",
        kind=kind,
        rank=rank,
        seq=seq,
        frame=frame,
        ranks=tuple(r for r in ranks if r not in largest),
        level=level,
        index=index,
        versions=versions,
    )
