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
import time

from ... import config
from ...errors import CollectiveDesyncError
from ...ledger import ledger
from ...records import OnceKeys, OnceLoadReport, OnceTreeExchange
from ...transport import HostTree
from .. import exchange as exchange_frame
from .. import generation, phases
from ..wire.once import Loaded, Offer, Result, decode_once, encode_once
from . import keys, rows, waits
from .plan import COMPILE, SERVE
from .ticket import Step, Ticket, keep_record, once_error, where_of

log = logging.getLogger("compiler_collectives.once")


def host_tree(ticket: Ticket, gen: generation.Generation) -> HostTree:
    """The compile group's ranks by host, ``gen``'s; built at the generation's first graph (every
    rank together)."""
    tree = gen.once_tree
    if tree is None or tree.size != ticket.pg.size():
        pg = ticket.pg
        where = where_of(ticket, "hosts")
        tree = gen.once_tree = exchange_frame.framed(
            pg,
            lambda: HostTree.build(pg, keys.record_width, where, phases.HOST_TREE),
            kind="compile_once",
            seq=ticket.seq,
            frame=str(ticket.frame),
            where=where,
        )
    return tree


def settle_keys(ticket: Ticket, mine: Offer, gen: generation.Generation) -> dict[int, Offer]:
    """Every rank's offer: from one fixed-size MIN over the host tree when, for each index on a
    host, every host's rank of that index has the same key (and the cache dirs are those of the
    last full exchange), else from a gather of every offer over the tree (``keys`` builds the
    record and reads it back). Every rank takes both steps or the first only, by the MIN's
    outcome: the same everywhere. ``gen``: the generation the graph's number was taken from."""
    kept, seq = gen.once_known, ticket.seq or 0
    tree = host_tree(ticket, gen)
    record = keys.record(mine, kept, members=ticket.members, tree=tree, seq=seq, level=ticket.level)
    out = tree_min(ticket, tree, record, phases.ONCE_KEYS, "keys")
    settled = keys.offers(out, mine, kept, members=ticket.members, tree=tree, seq=seq)
    if settled is not None:
        ledger.add(OnceKeys(reduced=True))
        return settled
    ledger.add(OnceKeys(reduced=False))
    pg, where = ticket.pg, where_of(ticket, "keys")
    offers = exchange_frame.framed(
        pg,
        lambda: rows.offers(tree, pg, mine, members=ticket.members, seq=seq, describe=where),
        kind="compile_once",
        seq=ticket.seq,
        frame=str(ticket.frame),
        where=where,
    )
    gen.once_known = keys.known(ticket.members, offers)
    return offers


def tree_min(ticket: Ticket, tree: HostTree, record: list[int], phase: int, what: str) -> list[int]:
    """The element-wise MIN of every rank's ``record`` over the host tree, in this graph's ``phase``."""
    ledger.add(OnceTreeExchange(what))
    pg, where = ticket.pg, where_of(ticket, what)
    stamp = HostTree.stamp(phase, ticket.seq or 0)
    return exchange_frame.framed(
        pg,
        lambda: tree.min_ints(pg, record, where, stamp, lambda i: ticket.members[i]),
        kind="compile_once",
        seq=ticket.seq,
        frame=str(ticket.frame),
        where=where,
    )


_BODIES = {phases.ONCE_KEYS: "keys", phases.ONCE_RESULT: "result", phases.ONCE_LOADED: "loaded"}


def tree_gather(
    ticket: Ticket, gen: generation.Generation, body: Offer | Result | Loaded | None, phase: int, what: str
) -> dict[int, Offer | Result | Loaded]:
    """The ``body`` of every rank that has one (global rank -> body; None: this rank has none),
    on every rank, over the host tree (``HostTree.gather``): O(log hosts) rounds, and bytes per
    rank those of the bodies, not of the world."""
    tree = host_tree(ticket, gen)
    pg, seq, where = ticket.pg, ticket.seq or 0, where_of(ticket, what)
    limit = config.settings.max_payload_bytes
    payload = None if body is None else encode_once(rank=ticket.rank, world_size=pg.size(), seq=seq, body=body)

    def step() -> dict[int, Offer | Result | Loaded]:
        got = tree.gather(pg, payload, HostTree.stamp(phase, seq), limit, where, lambda i: ticket.members[i])
        out: dict[int, Offer | Result | Loaded] = {}
        for i, data in sorted(got.items()):
            sender = ticket.members[i]
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

    return exchange_frame.framed(pg, step, kind="compile_once", seq=ticket.seq, frame=str(ticket.frame), where=where)


def exchange_results(ticket: Ticket, mine: Result) -> dict[int, Result]:
    """Every serving rank's result (global rank -> result), on every rank: one gather over the
    host tree to which only the serving ranks contribute (the plans say who they are), however
    many there are."""
    t0 = time.perf_counter()
    ledger.add(OnceTreeExchange("result"))
    plan = ticket.plan
    source = plan is not None and plan.role in (COMPILE, SERVE)
    out = tree_gather(ticket, generation.current(), mine if source else None, phases.ONCE_RESULT, "result")
    for r, p in ticket.plans.items():
        body = out.get(r)
        if body is None and p.role not in (COMPILE, SERVE):
            continue
        bad = not isinstance(body, Result) or (p.role in (COMPILE, SERVE)) != (body.status != "none")
        if bad:
            raise once_error(
                ticket,
                f"compile once #{ticket.seq} of {ticket.frame}: rank {r} sent a result that does not fit "
                f"its role ({p.role}); the ranks disagree about the plan (a version or setting differs).",
                (r,),
            )
    ticket.exchange_s += time.perf_counter() - t0
    return out  # type: ignore[return-value]


def load_report(ticket: Ticket) -> None:
    """Who did not load (a miss or a refusal): first one MIN of a flag over the host tree; only
    when some rank did not load, a gather over the tree to which only those ranks contribute,
    for the names and the reasons."""
    ticket.step = Step.REPORTED
    t0 = time.perf_counter()
    loaded_here = ticket.outcome not in ("miss", "refused")
    gen = generation.current()
    tree = host_tree(ticket, gen)
    if tree_min(ticket, tree, [1 if loaded_here else 0], phases.ONCE_LOADED, "load report")[0] == 1:
        ticket.local = ()
        ticket.exchange_s += time.perf_counter() - t0
        waits.wait_for_local_compiles(ticket)
        keep_record(ticket)
        return
    ledger.add(OnceTreeExchange("load report"))
    mine = None if loaded_here else Loaded(ticket.outcome, ticket.outcome_why)
    pg, where = ticket.pg, where_of(ticket, "load report")
    details = exchange_frame.framed(
        pg,
        lambda: rows.outcomes(tree, pg, mine, members=ticket.members, seq=ticket.seq or 0, describe=where),
        kind="compile_once",
        seq=ticket.seq,
        frame=str(ticket.frame),
        where=where,
    )
    ledger.add(OnceLoadReport(len(details)))
    for r, body in details.items():
        plan = ticket.plans.get(r)
        log.warning(
            "compile once #%d of %s: rank %d did not load rank %s's artifact (%s: %s); it compiled locally",
            ticket.seq,
            ticket.frame,
            r,
            plan.source if plan is not None else "?",
            body.outcome,
            body.why,
        )
    ticket.local = tuple(details)
    ticket.exchange_s += time.perf_counter() - t0
    if ticket.rank not in ticket.local:
        waits.wait_for_local_compiles(ticket)
    keep_record(ticket)
