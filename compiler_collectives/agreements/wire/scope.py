"""The verdict of a scope's setup check: what a scope's leader (its lowest rank) posts on the
c10d store (``setup/scope/<key>/verdict``) for every member to raise the same error, or none
(``agreements/scope.py``).

Layout::

    [kind, [rank, ...]]

``kind`` is one of ``VERDICT_KINDS``; the ranks are distinct global ranks below the world size:

* ``"ok"``: none;
* ``"overlap"``: the two ranks whose scopes share ranks;
* ``"absent"``: the members that never arrived (at least one);
* ``"setup"``: the rank whose record is the reference, then each rank whose record differs
  from it (at least two in all).

No version: a member reads the verdict to learn, among other things, that its leader runs
another release (a "setup" verdict naming the versions), so every release must read it alike.
The layout never changes; a new one would need a new store key. A malformed verdict is a
``WireFormatError`` naming the leader.
"""

from __future__ import annotations

import dataclasses

from .codec import expect, failure, int_in, pack, reading, show

VERDICT_KINDS = ("ok", "overlap", "absent", "setup")
_RANK_COUNTS = {"ok": (0, 0), "overlap": (2, 2), "absent": (1, None), "setup": (2, None)}


@dataclasses.dataclass
class Verdict:
    """A decoded verdict."""

    kind: str
    ranks: list[int]


def max_verdict_bytes(world_size: int) -> int:
    """The most bytes a verdict can take in a job of ``world_size`` ranks (a msgpack int takes at
    most 9 bytes; the kind and the headers fewer than 64)."""
    return 64 + 9 * world_size


def encode_verdict(kind: str, ranks: list[int]) -> bytes:
    """A leader's verdict, as it goes on the store."""
    return pack([kind, ranks])


def decode_verdict(data: bytes, *, sender: int, world_size: int, max_bytes: int | None = None) -> Verdict:
    """The verdict ``sender`` (the scope's leader) posted; raise ``WireFormatError`` naming the
    sender on anything malformed. ``max_bytes`` defaults to ``max_verdict_bytes(world_size)``."""
    fail = failure("scope-verdict", "setup", sender, "compiler_collectives version")
    cap = max_verdict_bytes(world_size) if max_bytes is None else max_bytes
    with reading(data, cap, fail, limit="a verdict's, from the world size") as r:
        r.array("verdict [kind, ranks]", 2, 2)
        kind = r.scalar("verdict kind")
        expect(
            type(kind) is str and kind in VERDICT_KINDS, f"verdict kind {show(kind)}, expected one of {VERDICT_KINDS}"
        )
        lo, hi = _RANK_COUNTS[kind]
        count = r.array(f"a {kind!r} verdict's ranks", lo, world_size if hi is None else hi)
        ranks: list[int] = []
        seen: set[int] = set()
        for i in range(count):
            rank = int_in(r.scalar(f"verdict rank {i}"), f"verdict rank {i}", lo=0)
            expect(rank < world_size, f"verdict rank {rank} is not below the world size {world_size}")
            expect(rank not in seen, f"verdict names rank {rank} twice")
            seen.add(rank)
            ranks.append(rank)
        r.end()
    return Verdict(kind, ranks)
