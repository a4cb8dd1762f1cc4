"""Compile once's waits on the store: a rank posts a notice when its part of a graph is done
(a source's compile, a dir receiver's install, a rank's own compile after it did not load), and
the ranks that need it wait for those posts (``agreements.compile_wait``: while the poster is
alive, up to ``COMPILER_COLLECTIVES_COMPILE_TIMEOUT``). The notices' names
(``once/<seq>/...``) are the graph's and the poster's; the time waited goes on the ticket and
into the ledger (``OnceWait``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ...errors import CompileOnceError
from ...ledger import ledger
from ...records import OnceWait
from .. import compile_wait
from .plan import COMPILE, SERVE
from .ticket import Ticket, once_error


def source_done(ticket: Ticket, rank: int) -> str:
    return f"once/{ticket.seq}/{rank}"


def dir_installed(ticket: Ticket, rank: int) -> str:
    return f"once/{ticket.seq}/in/{rank}"


def compiled_itself(ticket: Ticket, rank: int) -> str:
    return f"once/{ticket.seq}/local/{rank}"


def post(ticket: Ticket, notice: Callable[[Ticket, int], str], value: bytes, telling: str) -> None:
    """Post this rank's ``notice`` for the ranks waiting for it (``compile_wait.post``: a failed
    store raises our ``StoreFailureError``, published); ``telling``: what the post tells them."""
    compile_wait.post(
        notice(ticket, ticket.rank),
        value,
        me=ticket.rank,
        what=f"compile once #{ticket.seq} of {ticket.frame}",
        telling=telling,
        kind="compile_once",
        seq=ticket.seq,
        frame=str(ticket.frame),
    )


def wait_for_local_compiles(ticket: Ticket, raised_here: bool = False) -> None:
    """Wait until every rank that did not load (but this one) posted that its own compile ended:
    every rank leaves the graph's compile with the slowest, as it waited for the source. One
    whose compile raised is named, quoting its error (unless this rank's own compile raised:
    that error is the one this rank raises)."""
    pending = [r for r in ticket.local if r != ticket.rank]
    said = _wait_counted(ticket, pending, compiled_itself, "compile this graph itself (it did not load the artifact)")
    raised = {r: text for r, text in sorted(said.items()) if text != b"ok"}
    if raised and not raised_here:
        r, text = next(iter(raised.items()))
        raise once_error(
            ticket,
            f"rank {ticket.rank}: rank {r} compiled graph #{ticket.seq} of {ticket.frame} itself (it did not load "
            f"the artifact) and its compile raised: {text.decode('utf-8', 'replace')}. Every rank leaves a graph's "
            f"compile together, so this rank raises too; see rank {r}'s log for the traceback. "
            "COMPILER_COLLECTIVES_COMPILE_ONCE=0 makes every rank compile its own graphs.",
            tuple(raised),
        )


def wait_for_sources(ticket: Ticket) -> None:
    """Wait until every serving rank (but this one) posted that it is done."""
    me = ticket.rank
    pending = sorted({r for r, p in ticket.plans.items() if p.role in (COMPILE, SERVE) and r != me})
    if pending:
        _wait_counted(ticket, pending, source_done, "compile this graph for this rank")
        ticket.wait_ended_at = time.time()


def _wait_counted(
    ticket: Ticket, ranks: list[int], notice: Callable[[Ticket, int], str], doing: str
) -> dict[int, bytes]:
    """``wait_for_posts``, its time added to the graph's ``waited_s`` and ``once_wait_s``."""
    if not ranks:
        return {}
    started = time.monotonic()
    said = wait_for_posts(ticket, ranks, notice, doing)
    waited = time.monotonic() - started
    ticket.waited_s += waited
    ledger.add(OnceWait(waited))
    return said


def wait_for_posts(
    ticket: Ticket, ranks: list[int], notice: Callable[[Ticket, int], str], doing: str
) -> dict[int, bytes]:
    """What each of ``ranks`` posted under ``notice``, once all have (``compile_wait``)."""
    return compile_wait.wait_for_posts(
        {r: notice(ticket, r) for r in ranks},
        me=ticket.rank,
        doing=doing,
        what=f"compile once #{ticket.seq} of {ticket.frame}",
        kind="compile_once",
        seq=ticket.seq,
        frame=str(ticket.frame),
        on_timeout=CompileOnceError,
        advice="Raise COMPILER_COLLECTIVES_COMPILE_TIMEOUT if compiles legitimately take that long, or set "
        "COMPILER_COLLECTIVES_COMPILE_ONCE=0.",
    )
