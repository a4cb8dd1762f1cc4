"""Compile once's gathers of many small bodies, as tables over the host tree: every rank's offer
(a generation's first graph, or keys the MIN cannot settle) and the outcomes of the ranks that did
not load (a load report with a miss or a refusal).

Each rank's body is one row (``wire.once.encode_row``: a column per field); the host tree's table
gather (``transport.HostTree.gather_table``) folds the rows as the leaders merge them, each
column's distinct values kept once, so a rank receives, and decodes (``wire.once.decode_rows``),
each distinct key, dir or reason once and a few ints per rank: O(log hosts) tree steps, and work
per rank that grows with what differs, not with the world's msgpack payloads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch.distributed as dist

from ... import config
from ...transport import HostTree
from .. import phases
from ..wire.once import Loaded, Offer, decode_rows, encode_row, row_columns


def _gather(
    tree: HostTree,
    pg: dist.ProcessGroup,
    body: Offer | Loaded | None,
    kind: str,
    phase: int,
    *,
    members: Sequence[int],
    seq: int,
    describe: Callable[[], str],
) -> dict[int, Offer | Loaded]:
    limit = config.settings.max_payload_bytes
    row = None if body is None else encode_row(world_size=pg.size(), seq=seq, body=body)
    table = tree.gather_table(
        pg, row, row_columns(kind), HostTree.stamp(phase, seq), limit, describe, lambda i: members[i]
    )
    senders = [members[i] for i in table.ranks()]
    columns = [table.column(c) for c in range(table.columns)]
    return dict(zip(senders, decode_rows(columns, senders, kind=kind, seq=seq, world_size=pg.size())))


def offers(
    tree: HostTree,
    pg: dist.ProcessGroup,
    mine: Offer,
    *,
    members: Sequence[int],
    seq: int,
    describe: Callable[[], str],
) -> dict[int, Offer]:
    """Every rank's offer (global rank -> offer), on every rank. ``members``: the group's global
    ranks in group-rank order; ``describe``: where this rank is, for errors."""
    got = _gather(tree, pg, mine, "keys", phases.ONCE_KEYS, members=members, seq=seq, describe=describe)
    return cast("dict[int, Offer]", got)


def outcomes(
    tree: HostTree,
    pg: dist.ProcessGroup,
    mine: Loaded | None,
    *,
    members: Sequence[int],
    seq: int,
    describe: Callable[[], str],
) -> dict[int, Loaded]:
    """The outcome of every rank that did not load (global rank -> outcome; ``mine`` None: this
    rank loaded, and contributes nothing), on every rank."""
    got = _gather(tree, pg, mine, "loaded", phases.ONCE_LOADED, members=members, seq=seq, describe=describe)
    return cast("dict[int, Loaded]", got)
