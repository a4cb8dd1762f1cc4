"""Compile once's exchanges over the host tree (``transport.HostTree``): the key settlement (one
MIN, then a gather of every offer only where the MIN cannot settle it), the result gather to
which only the serving ranks contribute, and the load report (a MIN of a flag, then a gather of
the ranks that did not load). Each runs in the agreements' one exchange frame
(``agreements.exchange.framed``) under the graph's phase (``agreements.phases``).

What stays from graph to graph within a generation, the compile group's ranks by host (built at
the generation's first graph) and what the last full key exchange saw (``keys.Known``), is the
generation's (``agreements.generation``): a new generation starts without either.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ... import config
from ...errors import CollectiveDesyncError
from ...ledger import ledger
from ...records import OnceKeys, OnceLoadReport, OnceTreeExchange
from ...transport import HostTree
from .. import exchange as exchange_frame
from .. import generation, phases
from ..wire.once import Loaded, Offer, Result, decode_once, encode_once
from . import keys, rows
from .graph import Graph, once_error, where_of
from .plan import COMPILE, SERVE, Plan

log = logging.getLogger("compiler_collectives.once")


def host_tree(graph: Graph, gen: generation.Generation) -> HostTree:
    """The compile group's ranks by host, ``gen``'s; built at the generation's first graph (every
    rank together)."""
    tree = gen.once_tree
    if tree is None or tree.size != graph.pg.size():
        pg = graph.pg
        where = where_of(graph, "hosts")
        tree = gen.once_tree = exchange_frame.framed(
            pg,
            lambda: HostTree.build(pg, keys.record_width, where, phases.HOST_TREE),
            kind="compile_once",
            seq=graph.seq,
            frame=str(graph.frame),
            where=where,
        )
    return tree


def settle_keys(graph: Graph, mine: Offer, gen: generation.Generation) -> dict[int, Offer]:
    """Every rank's offer: from one fixed-size MIN over the host tree when, for each index on a
    host, every host's rank of that index has the same key (and the cache dirs are those of the
    last full exchange), else from a gather of every offer over the tree (``keys`` builds the
    record and reads it back). Every rank takes both steps or the first only, by the MIN's
    outcome: the same everywhere. ``gen``: the generation the graph's number was taken from."""
    kept, seq = gen.once_known, graph.seq or 0
    tree = host_tree(graph, gen)
    record = keys.record(mine, kept, members=graph.members, tree=tree, seq=seq, level=graph.level)
    out = tree_min(graph, tree, record, phases.ONCE_KEYS, "keys")
    settled = keys.offers(out, mine, kept, members=graph.members, tree=tree, seq=seq)
    if settled is not None:
        ledger.add(OnceKeys(reduced=True))
        return settled
    ledger.add(OnceKeys(reduced=False))
    pg, where = graph.pg, where_of(graph, "keys")
    offers = exchange_frame.framed(
        pg,
        lambda: rows.offers(tree, pg, mine, members=graph.members, seq=seq, describe=where),
        kind="compile_once",
        seq=graph.seq,
        frame=str(graph.frame),
        where=where,
    )
    gen.once_known = keys.known(graph.members, offers)
    return offers


def tree_min(graph: Graph, tree: HostTree, record: list[int], phase: int, what: str) -> list[int]:
    """The element-wise MIN of every rank's ``record`` over the host tree, in this graph's ``phase``."""
    ledger.add(OnceTreeExchange(what))
    pg, where = graph.pg, where_of(graph, what)
    stamp = HostTree.stamp(phase, graph.seq or 0)
    return exchange_frame.framed(
        pg,
        lambda: tree.min_ints(pg, record, where, stamp, lambda i: graph.members[i]),
        kind="compile_once",
        seq=graph.seq,
        frame=str(graph.frame),
        where=where,
    )


_BODIES = {phases.ONCE_KEYS: "keys", phases.ONCE_RESULT: "result", phases.ONCE_LOADED: "loaded"}


def tree_gather(
    graph: Graph, gen: generation.Generation, body: Offer | Result | Loaded | None, phase: int, what: str
) -> dict[int, Offer | Result | Loaded]:
    """The ``body`` of every rank that has one (global rank -> body; None: this rank has none),
    on every rank, over the host tree (``HostTree.gather``): O(log hosts) rounds, and bytes per
    rank those of the bodies, not of the world."""
    tree = host_tree(graph, gen)
    pg, seq, where = graph.pg, graph.seq or 0, where_of(graph, what)
    limit = config.settings.max_payload_bytes
    payload = None if body is None else encode_once(rank=graph.rank, world_size=pg.size(), seq=seq, body=body)

    def step() -> dict[int, Offer | Result | Loaded]:
        got = tree.gather(pg, payload, HostTree.stamp(phase, seq), limit, where, lambda i: graph.members[i])
        out: dict[int, Offer | Result | Loaded] = {}
        for i, data in sorted(got.items()):
            sender = graph.members[i]
            envelope = decode_once(data, sender=sender, max_bytes=limit, expected_world_size=pg.size())
            if envelope.seq != seq or envelope.kind != _BODIES[phase]:
                raise CollectiveDesyncError(
                    f"{where()}: rank {sender} sent its {envelope.kind} of compile once #{envelope.seq} in this "
                    f"rank's exchange of {_BODIES[phase]} of #{seq}: the ranks are at different graphs.\n"
                    "Every rank must compile the same graphs in the same order.",
                    ranks=(sender,),
                )
            out[sender] = envelope.body
        return out

    return exchange_frame.framed(pg, step, kind="compile_once", seq=graph.seq, frame=str(graph.frame), where=where)


def exchange_results(graph: Graph, plans: Mapping[int, Plan], mine: Result | None) -> dict[int, Result]:
    """Every serving rank's result (global rank -> result), on every rank: one gather over the
    host tree to which only the serving ranks contribute (``mine``: this rank's, None where it
    serves nothing), however many there are."""
    ledger.add(OnceTreeExchange("result"))
    out = tree_gather(graph, generation.current(), mine, phases.ONCE_RESULT, "result")
    for r, p in plans.items():
        body = out.get(r)
        if body is None and p.role not in (COMPILE, SERVE):
            continue
        bad = not isinstance(body, Result) or (p.role in (COMPILE, SERVE)) != (body.status != "none")
        if bad:
            raise once_error(
                graph,
                f"compile once #{graph.seq} of {graph.frame}: rank {r} sent a result that does not fit "
                f"its role ({p.role}); the ranks disagree about the plan (a version or setting differs).",
                (r,),
            )
    return out  # type: ignore[return-value]


def load_report(
    graph: Graph, plans: Mapping[int, Plan], loaded: bool, outcome: str, why: str | None
) -> tuple[int, ...]:
    """Who did not load (a miss or a refusal): first one MIN of a flag over the host tree; only
    when some rank did not load, a gather over the tree to which only those ranks contribute,
    for the names and the reasons. Returns those ranks (global)."""
    gen = generation.current()
    tree = host_tree(graph, gen)
    if tree_min(graph, tree, [1 if loaded else 0], phases.ONCE_LOADED, "load report")[0] == 1:
        return ()
    ledger.add(OnceTreeExchange("load report"))
    mine = None if loaded else Loaded(outcome, why)
    pg, where = graph.pg, where_of(graph, "load report")
    details = exchange_frame.framed(
        pg,
        lambda: rows.outcomes(tree, pg, mine, members=graph.members, seq=graph.seq or 0, describe=where),
        kind="compile_once",
        seq=graph.seq,
        frame=str(graph.frame),
        where=where,
    )
    ledger.add(OnceLoadReport(len(details)))
    for r, body in details.items():
        plan = plans.get(r)
        log.warning(
            "compile once #%d of %s: rank %d did not load rank %s's artifact (%s: %s); it compiled locally",
            graph.seq,
            graph.frame,
            r,
            plan.source if plan is not None else "?",
            body.outcome,
            body.why,
        )
    return tuple(details)
