"""The recompile-reason payload: after the guard collective agreed on a miss, why each rank
missed (nothing if it hit), on the slow path only.

Layout (``REASONS_FORMAT_VERSION``, now 1; its own version, apart from the envelope's)::

    [REASONS_FORMAT_VERSION, "recompile_reasons", sender_rank, world_size,
     guard_seq, missed, [reason, ...]]

Reasons are Dynamo's guard-failure texts, cut to ``MAX_REASON_CHARS`` each and ``MAX_REASONS``
in all by the sender; the decoder enforces both, and that a rank that hit sent none. The
version comes first and is checked before anything else is read; any change to the layout
bumps it.
"""

from __future__ import annotations

import dataclasses

from .codec import expect, failure, int_in, pack, reading, sender_and_world, show, versioned_list

REASONS_FORMAT_VERSION = 1
REASONS_TAG = "recompile_reasons"
MAX_REASONS = 64
MAX_REASON_CHARS = 4096


@dataclasses.dataclass
class ReasonsEnvelope:
    """A decoded recompile-reason payload."""

    rank: int
    world_size: int
    seq: int
    missed: bool
    reasons: list[str]


def encode_reasons(*, rank: int, world_size: int, seq: int, missed: bool, reasons: list[str]) -> bytes:
    """Serialize one rank's recompile reasons (cut to ``MAX_REASONS`` of ``MAX_REASON_CHARS``)."""
    kept = [r[:MAX_REASON_CHARS] for r in reasons[:MAX_REASONS]]
    return pack([REASONS_FORMAT_VERSION, REASONS_TAG, rank, world_size, seq, bool(missed), kept])


def decode_reasons(
    data: bytes, *, sender: int, max_bytes: int, expected_world_size: int | None = None
) -> ReasonsEnvelope:
    """Parse and validate one rank's recompile reasons; raise ``WireFormatError`` naming the sender."""

    fail = failure("recompile-reason", "guard", sender, "compiler_collectives version")
    with reading(data, max_bytes, fail) as r:
        obj = versioned_list(r, REASONS_FORMAT_VERSION, "recompile-reason format", 7)
        _, tag, rank, world, seq, missed, reasons = obj
        expect(tag == REASONS_TAG, f"payload tag {show(tag)}, expected {REASONS_TAG!r}")
        sender_and_world(rank, sender, world, expected_world_size)
        int_in(seq, "guard sequence number", lo=0)
        expect(type(missed) is bool, "missed must be a bool")
        expect(
            type(reasons) is list and len(reasons) <= MAX_REASONS, f"reasons must be a list of at most {MAX_REASONS}"
        )
        for i, reason in enumerate(reasons):
            expect(
                type(reason) is str and len(reason) <= MAX_REASON_CHARS,
                f"reasons[{i}] must be a string of at most {MAX_REASON_CHARS} characters",
            )
        expect(missed or not reasons, "a rank that hit sent reasons")
    return ReasonsEnvelope(rank=rank, world_size=world, seq=seq, missed=missed, reasons=reasons)
