"""Compile once's key settling without the exchange: the fixed record each rank puts into one MIN
over the host tree, and every rank's offer read back from the reduced record.

Pure: the same reduced record gives the same offers on every rank, with no counters and no I/O,
so it is unit-tested on its own (``tests/unit/test_compile_once_key_settlement.py``); ``exchanges`` runs the
exchanges around it (the MIN, and the table gather where the record does not settle the keys).

The record: the exchange's phase; a digest of what must match everywhere (graph number, level,
switches, the dirs, size limits and build fingerprints the last full gather saw); whether every
rank's kept table is valid and every rank has a key; a digest of this rank's key, why and graph; and, in the slot of
this rank's index on its host, that digest again, whether it holds the entry and how warm it is
(in turn among equals, as ``decide`` turns among cold ranks). Each value that must be equal
everywhere travels with its negation: the MIN of both gives the lowest and the highest.

Equal slots on every host are how GPU jobs (a key per device: ``cuda:k`` in the key of the
host's k-th rank) settle without the gather: torch's own cache keys hold the device index
(``FxGraphCachePickler`` keys with ``device_id_agnostic=False``; the compiled code names its
device), so ranks of different indices never share an artifact; the ranks of index k on every
host do. Each group of equal keys gets its lowest holder and its warmest rank from the slots of
its indices; the offers built from them give ``decide`` the same plans everywhere (a key this
rank does not have stands as a placeholder of its digest: ``decide`` only compares keys).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence

from ...transport import HostTree
from ..phases import ONCE_KEYS
from ..wire.once import Offer

HEAD, SLOT = 8, 4  # the record: the phase, then six items; then four per index on a host
PEER_KEY = "<the key of local index {} on every host: digest {:x}>"  # never one of torch's keys


@dataclasses.dataclass(frozen=True)
class Known:
    """What the last full key exchange of a generation saw that stays from graph to graph."""

    members: tuple[int, ...]  # the group's global ranks, ascending
    # global rank -> (cache dir identity, largest artifact it accepts, build fingerprint)
    dirs: Mapping[int, tuple[str, int, str]]
    digest: bytes  # of ``dirs``: every rank's equal one shows the tables agree


def known(members: Sequence[int], offers: Mapping[int, Offer]) -> Known:
    """What a gather of every rank's offer (a table gather: ``rows``) leaves for the graphs after it."""
    dirs = {r: (o.dir, o.max_artifact_bytes, o.build) for r, o in offers.items()}
    return Known(tuple(sorted(members)), dirs, hashlib.sha256(repr(sorted(dirs.items())).encode()).digest())


def record_width(ranks_per_host: int) -> int:
    """The record's length, for a tree with at most ``ranks_per_host`` ranks on a host."""
    return HEAD + SLOT * ranks_per_host


def _digest(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big") >> 2


def _turn(me: int, seq: int, n: int) -> int:
    """Highest for the group rank whose turn it is at graph ``seq``."""
    return n - 1 - ((me - seq) % n)


def record(
    mine: Offer, kept: Known | None, *, members: Sequence[int], tree: HostTree, seq: int, level: str
) -> list[int]:
    """This rank's record. ``members``: the group's global ranks in group-rank order; ``tree``:
    the group's, with this rank's place in it."""
    n, me = tree.size, tree.index
    valid = (
        kept is not None
        and kept.members == tuple(sorted(members))
        and kept.dirs.get(members[me]) == (mine.dir, mine.max_artifact_bytes, mine.build)
    )
    common = _digest(seq, level, tuple(sorted(mine.switches)), kept.digest) if kept is not None and valid else 0
    own = _digest(mine.key, mine.why, mine.graph)
    head = [ONCE_KEYS, -ONCE_KEYS, common, -common, 0 if valid else -1]
    head += [0 if mine.key is not None else -1, own, -own]
    slots = [HostTree.NEUTRAL] * (SLOT * tree.ranks_per_host)
    k = tree.local_index * SLOT
    slots[k : k + SLOT] = [own, -own, me if mine.holds else n, -(mine.warmth * n + _turn(me, seq, n))]
    return head + slots


def offers(
    out: Sequence[int], mine: Offer, kept: Known | None, *, members: Sequence[int], tree: HostTree, seq: int
) -> dict[int, Offer] | None:
    """Every rank's offer (global rank -> offer) from the reduced record ``out``; None where it
    does not settle the keys (the ranks then gather every offer: every rank decides alike,
    from the same ``out``). ``members``: the group's global ranks in group-rank order."""
    if kept is None:
        return None  # this rank put -1 in its validity: no rank settles
    n = len(members)
    phase_lo, phase_neg_hi, low, neg_high, neg_invalid, neg_keyless, own_lo, own_neg_hi = out[:HEAD]
    got = [tuple(out[i : i + SLOT]) for i in range(HEAD, len(out), SLOT)]
    if phase_lo != -phase_neg_hi or neg_invalid != 0 or low != -neg_high:
        return None
    # Per index: its key's digest (None where no host has that index), checked equal on every host.
    digests = [None if d == HostTree.NEUTRAL else d for d, *_ in got]
    if not all(d is None or d == -neg_d for d, neg_d, *_ in got):
        return None
    if own_lo != -own_neg_hi and neg_keyless != 0:
        return None
    own = _digest(mine.key, mine.why, mine.graph)
    # Each group of equal keys (a set of indices): its lowest holder, and its warmest rank.
    holder: dict[int, int] = {}
    best: dict[int, int] = {}
    for (_, _, hold, neg_best), digest in zip(got, digests):
        if digest is not None:
            holder[digest] = min(holder.get(digest, n), hold)
            best[digest] = max(best.get(digest, -1), -neg_best)
    settled: dict[int, Offer] = {}
    for i, r in enumerate(members):
        index = tree.place[i][1]
        digest = digests[index]
        assert digest is not None
        warmest, chosen = best[digest] // n, (seq + n - 1 - best[digest] % n) % n
        ours = digest == own
        settled[r] = Offer(
            mine.key if ours else PEER_KEY.format(index, digest),
            mine.why if ours else None,
            i == holder[digest],
            kept.dirs[r][0],
            list(mine.switches),
            kept.dirs[r][1],
            mine.graph if ours else "",
            warmest if i == chosen and i != holder[digest] else 0,
            kept.dirs[r][2],
        )
    return settled
