"""The program audit's payload: one rank's summary of a compiled graph's collectives, or, once
the summaries disagreed, the details.

The envelope (``envelope.py``, format version ``FORMAT_VERSION``, now 2) is tagged ``"audit"``
at position 7 and ends in ``body``::

    [format_version, package_version, sender_rank, world_size,
     [co_name, co_filename, co_firstlineno], seq, sent_at, "audit", body]

``body`` is one of::

    ["summary", phase, failure, levels, graph_break]
        failure: nil, or "ExcType: message" when this rank's compile raised
        levels: [[level, graphs, collectives, collectives_digest, graph_digest], ...]
        graph_break: nil, or where this rank's trace broke the frame's graph
            ("file.py:18: reason"), when this graph ends at a graph break
            (format 2; format 1 carried pending lazy backwards here)
    ["details", phase, level, [[op, group, reduce_op, [tensor, ...], args, where], ...]]

``phase`` is one of ``AUDIT_PHASES``; digests are 8-byte binaries; texts are cut to 4096
characters by the sender, and the decoder enforces it. Only "details" carries text from the
graphs, and only after the summaries disagreed. Any change to the body bumps
``FORMAT_VERSION``. The body is built generically by the bounded reader (``codec.py``) and then
checked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...observations import FrameId
from ..fingerprint import Collective
from .codec import expect, failure, int_in, pack, reading, reject, show
from .envelope import AUDIT, VERSIONS, envelope_head, header_in, header_out, out_of_step, peer_position

AUDIT_PHASES = ("forward", "backward")
_MAX_LEVELS = 32
_MAX_TEXT = 4096
_MAX_ITEMS = 1_000_000


@dataclasses.dataclass
class AuditLevel:
    """One graph level of one rank's compile, as exchanged."""

    level: str
    graphs: int
    collectives: int
    collectives_digest: bytes
    graph_digest: bytes


@dataclasses.dataclass
class AuditSummary:
    phase: str
    failure: str | None
    levels: list[AuditLevel]
    graph_break: str | None = None  # "file.py:18: reason" when the graph ends at a graph break


@dataclasses.dataclass
class AuditDetails:
    phase: str
    level: str
    collectives: list[Collective]


@dataclasses.dataclass
class AuditEnvelope:
    format_version: int
    package_version: str
    rank: int
    world_size: int
    frame: FrameId
    seq: int
    sent_at: float
    body: AuditSummary | AuditDetails


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."


def encode_audit(
    body: AuditSummary | AuditDetails,
    *,
    rank: int,
    world_size: int,
    frame: FrameId,
    seq: int,
    sent_at: float,
) -> bytes:
    """Serialize one rank's audit summary or details into the tagged envelope."""
    if isinstance(body, AuditSummary):
        out: list[Any] = [
            "summary",
            body.phase,
            None if body.failure is None else _clip(body.failure),
            [[lv.level, lv.graphs, lv.collectives, lv.collectives_digest, lv.graph_digest] for lv in body.levels],
            None if body.graph_break is None else _clip(body.graph_break),
        ]
    else:
        out = [
            "details",
            body.phase,
            body.level,
            [
                [
                    _clip(c.op),
                    _clip(c.group),
                    _clip(c.reduce_op),
                    [_clip(t) for t in c.tensors],
                    _clip(c.args),
                    _clip(c.where),
                ]
                for c in body.collectives
            ],
        ]
    return pack(header_out(rank=rank, world_size=world_size, frame=frame, seq=seq, sent_at=sent_at) + [AUDIT, out])


def _text(v: Any, what: str) -> str:
    expect(type(v) is str and len(v) <= _MAX_TEXT, f"{what} must be a string of at most {_MAX_TEXT} characters")
    text: str = v
    return text


def _digest(v: Any, what: str) -> bytes:
    expect(type(v) is bytes and len(v) == 8, f"{what} must be 8 bytes")
    digest: bytes = v
    return digest


def _audit_body_in(v: Any) -> AuditSummary | AuditDetails:
    expect(type(v) is list and len(v) in (4, 5), "audit body must be a list of 4 or 5 items")
    expect(v[1] in AUDIT_PHASES, f"audit phase must be one of {AUDIT_PHASES}, got {show(v[1])}")
    if v[0] == "summary" and len(v) == 5:
        _, phase, failure, raw_levels, graph_break = v
        expect(failure is None or type(failure) is str, "audit failure must be nil or a string")
        expect(
            type(raw_levels) is list and len(raw_levels) <= _MAX_LEVELS,
            f"audit levels must be a list of at most {_MAX_LEVELS}",
        )
        levels = []
        seen: set[str] = set()
        for i, lv in enumerate(raw_levels):
            expect(type(lv) is list and len(lv) == 5, f"audit level {i} must have 5 items")
            name = _text(lv[0], f"audit level {i} name")
            expect(name not in seen, f"audit level {name!r} appears twice")
            seen.add(name)
            levels.append(
                AuditLevel(
                    name,
                    int_in(lv[1], f"audit level {name!r} graph count", lo=0),
                    int_in(lv[2], f"audit level {name!r} collective count", lo=0),
                    _digest(lv[3], f"audit level {name!r} collectives digest"),
                    _digest(lv[4], f"audit level {name!r} graph digest"),
                )
            )
        return AuditSummary(
            phase,
            None if failure is None else _text(failure, "audit failure"),
            levels,
            None if graph_break is None else _text(graph_break, "audit graph break"),
        )
    if v[0] == "details" and len(v) == 4:
        _, phase, level, raw = v
        _text(level, "audit details level")
        expect(type(raw) is list and len(raw) <= _MAX_ITEMS, "audit collectives must be a list")
        collectives = []
        for i, c in enumerate(raw):
            what = f"audit collective {i}"
            expect(type(c) is list and len(c) == 6, f"{what} must have 6 items")
            expect(type(c[3]) is list and len(c[3]) <= _MAX_ITEMS, f"{what} tensors must be a list")
            collectives.append(
                Collective(
                    op=_text(c[0], f"{what} op"),
                    group=_text(c[1], f"{what} group"),
                    reduce_op=_text(c[2], f"{what} reduce op"),
                    tensors=tuple(_text(t, f"{what} tensor") for t in c[3]),
                    args=_text(c[4], f"{what} args"),
                    where=_text(c[5], f"{what} source line"),
                )
            )
        return AuditDetails(phase, level, collectives)
    reject(f"unknown audit body {show(v[0])}")


def decode_audit(data: bytes, *, sender: int, max_bytes: int, expected_world_size: int | None = None) -> AuditEnvelope:
    """Parse and validate one rank's audit payload; ``WireFormatError`` on anything wrong,
    ``CollectiveDesyncError`` if the sender is in a compiler collective instead."""

    fail = failure("program-audit", "audit", sender, VERSIONS)
    with reading(data, max_bytes, fail) as r:
        n, obj = envelope_head(r)
        version = obj[0]
        if n == 8:
            raise out_of_step(
                f"rank {sender} is in a compiler collective ({peer_position(obj)}) while this rank "
                "audits a compiled graph",
                sender,
            )
        expect(n == 9 and r.value() == AUDIT, "audit envelope must have 9 items tagged 'audit'")
        pkg, rank, world, frame, seq, sent_at = header_in(obj, sender, expected_world_size)
        parsed = _audit_body_in(r.value())
        r.end()
    return AuditEnvelope(version, pkg, rank, world, frame, seq, sent_at, parsed)
