"""The envelope that compiler-collective and program-audit payloads share, and its version.

Both kinds travel on the same groups, in one msgpack array::

    [format_version, package_version, sender_rank, world_size,
     [co_name, co_filename, co_firstlineno], seq, sent_at, ...]

followed by ``state`` for a compiler collective (8 items, ``compiler.py``) or by ``"audit",
body`` for the program audit (9 items, ``audit.py``). ``sent_at`` is the sender's wall-clock
time (seconds since the epoch) when it entered the collective.

``format_version`` (``FORMAT_VERSION``, now 2) always comes first, so that a decoder refuses a
payload of another version before reading anything else. Any change to the envelope, the
compiler state or the audit body bumps it; ranks must run the same format version, and a
payload of another version is a ``WireFormatError`` naming the sender and both versions.

Each decoder recognises the other kind and raises ``CollectiveDesyncError`` naming the sender:
the ranks are then in different collectives, which is a desync, not a corrupt payload.
"""

from __future__ import annotations

from typing import Any

from ...errors import CollectiveDesyncError
from ...observations import FrameId
from ...version import __version__
from .codec import Reader, expect, int_in, reject, sender_and_world, show, version_in

FORMAT_VERSION = 2
AUDIT = "audit"
"""The tag at position 7 of a program-audit envelope."""
VERSIONS = "compiler_collectives and torch versions"
"""What every rank must run alike for these payloads to agree (for messages)."""


def header_out(*, rank: int, world_size: int, frame: FrameId, seq: int, sent_at: float) -> list[Any]:
    """The envelope's first seven items, as every sender writes them."""
    return [
        FORMAT_VERSION,
        __version__,
        rank,
        world_size,
        [frame.name, frame.filename, frame.line],
        seq,
        float(sent_at),
    ]


def envelope_head(r: Reader) -> tuple[int, list[Any]]:
    """(envelope length, [version, package, rank, world, frame, seq, sent_at]), the version
    checked before any other item is read."""
    if not r.array_next():
        r.value()
        reject("envelope must be a non-empty list")
    n = r.array("envelope")
    expect(n > 0, "envelope must be a non-empty list")
    version = r.scalar("format version")
    version_in(version, lambda: r.value() if n > 1 else None, "wire format", FORMAT_VERSION)
    expect(n <= 9, f"envelope must have 8 or 9 items, got {n}")
    head = [version] + [r.value() for _ in range(1, min(n, 7))]
    return n, head


def header_in(
    obj: list[Any], sender: int, expected_world_size: int | None
) -> tuple[str, int, int, FrameId, int, float]:
    """(package, rank, world size, frame, seq, sent_at) from the first seven items of an
    envelope (``envelope_head``), each checked."""
    _, pkg, rank, world, frame, seq, sent_at = obj[:7]
    expect(type(pkg) is str and len(pkg) < 64, "package version must be a short string")
    sender_and_world(rank, sender, world, expected_world_size)
    expect(type(frame) is list and len(frame) == 3, "frame must be [co_name, file, line]")
    expect(type(frame[0]) is str and type(frame[1]) is str, "frame name and file must be strings")
    line = int_in(frame[2], "frame line", lo=0)
    int_in(seq, "sequence number", lo=0)
    expect(type(sent_at) is float, "sent_at must be a float")
    return pkg, rank, world, FrameId(frame[0], frame[1], line), seq, sent_at


def peer_position(obj: list[Any]) -> str:
    """Where the sender of the envelope ``obj`` (as ``envelope_head`` read it) is, for messages."""
    frame = obj[4] if type(obj[4]) is list and len(obj[4]) == 3 else None
    where = f"frame {show(frame[0])} at {show(frame[1])}:{show(frame[2])}" if frame else "unknown frame"
    return f"#{show(obj[5])}, {where}"


def out_of_step(why: str, sender: int) -> CollectiveDesyncError:
    """The error when ``sender`` sent the other kind of envelope."""
    return CollectiveDesyncError(
        f"{why}: the ranks are out of step (one finished compiling a graph while the other "
        "started compiling another frame). Compiler collectives need every rank to compile the "
        "same frames in the same order; look for rank-dependent control flow around compiled calls.",
        ranks=(sender,),
    )
