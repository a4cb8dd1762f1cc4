"""Compile once's mailbox: a rank posts a notice when its part of a graph is done (a source's
compile, a dir receiver's install, a rank's own compile after it did not load), and the ranks
that need it wait for those posts (``agreements.compile_wait``: while the poster is alive, up to
``COMPILER_COLLECTIVES_COMPILE_TIMEOUT``). The notices' names (``once/<seq>/...``) are the
graph's and the poster's. The driver (``driver.py``) times the waits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ...errors import CompileOnceError
from .. import compile_wait
from .graph import Graph
from .plan import COMPILE, SERVE, Plan


def source_done(graph: Graph, rank: int) -> str:
    return f"once/{graph.seq}/{rank}"


def dir_installed(graph: Graph, rank: int) -> str:
    return f"once/{graph.seq}/in/{rank}"


def compiled_itself(graph: Graph, rank: int) -> str:
    return f"once/{graph.seq}/local/{rank}"


NOTICES = {
    "source": (source_done, "its compile of this graph ended"),
    "itself": (compiled_itself, "its own compile of this graph ended"),
}
"""What a ``machine.Post`` posts: its notice, and what the post tells the ranks waiting for it."""


def post(graph: Graph, notice: Callable[[Graph, int], str], value: bytes, telling: str) -> None:
    """Post this rank's ``notice`` for the ranks waiting for it (``compile_wait.post``: a failed
    store raises our ``StoreFailureError``, published); ``telling``: what the post tells them."""
    compile_wait.post(
        notice(graph, graph.rank),
        value,
        me=graph.rank,
        what=f"compile once #{graph.seq} of {graph.frame}",
        telling=telling,
        kind="compile_once",
        seq=graph.seq,
        frame=str(graph.frame),
    )


def sources(graph: Graph, plans: Mapping[int, Plan]) -> list[int]:
    """The serving ranks of ``plans`` but this one: the ranks whose posts every other rank waits for."""
    return sorted({r for r, p in plans.items() if p.role in (COMPILE, SERVE) and r != graph.rank})


def raised_in_their_own_compile(said: Mapping[int, bytes]) -> dict[int, str]:
    """Of the posts of ranks that compiled a graph themselves, those that tell of a raise."""
    return {r: text.decode("utf-8", "replace") for r, text in sorted(said.items()) if text != b"ok"}


def wait_for_posts(graph: Graph, ranks: list[int], notice: Callable[[Graph, int], str], doing: str) -> dict[int, bytes]:
    """What each of ``ranks`` posted under ``notice``, once all have (``compile_wait``)."""
    if not ranks:
        return {}
    return compile_wait.wait_for_posts(
        {r: notice(graph, r) for r in ranks},
        me=graph.rank,
        doing=doing,
        what=f"compile once #{graph.seq} of {graph.frame}",
        kind="compile_once",
        seq=graph.seq,
        frame=str(graph.frame),
        on_timeout=CompileOnceError,
        advice="Raise COMPILER_COLLECTIVES_COMPILE_TIMEOUT if compiles legitimately take that long, or set "
        "COMPILER_COLLECTIVES_COMPILE_ONCE=0.",
    )
