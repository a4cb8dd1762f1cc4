"""The msgpack wire format of a compiler-collective payload, and its validation.

A payload is one msgpack array, the *envelope*::

    [format_version, package_version, sender_rank, world_size,
     [co_name, co_filename, co_firstlineno], seq, sent_at, state]

``format_version`` always comes first so that a decoder can refuse a payload
of another version before reading anything else. ``sent_at`` is the sender's
wall-clock time (seconds since the epoch) when it entered the collective.
``state`` is ``[entries, frame_state_fresh, extras]`` where ``entries`` is a
list of ``[source_name, entry]`` and ``extras`` maps a registered field name to
its msgpack-native value. Source names are front-coded: a name may be sent as
``[k, suffix]``, meaning the first ``k`` characters of the previous entry's
name followed by ``suffix`` (``L['self']._modules['layers']._modules['3']...``
names share long prefixes).

An entry is ``[scalar, size, stride]`` optionally followed by
``excluded_sizes`` and ``excluded_scalar`` (omitted when empty). Atoms:

* an int is an observed value;
* nil is ``DYNAMIC``; false is ``UNSET``;
* a one-element list ``[d]`` (strides only) is ``InferStride(d)``.

``size`` and ``stride`` are either a marker atom or a list of atoms.

The program audit (``audit.py``) sends a second kind of envelope on the same
group, tagged ``"audit"`` at position 7 (see ``encode_audit``). Each decoder
recognises the other kind and raises ``CollectiveDesyncError`` naming the
sender: the ranks are then in different collectives, which is a desync, not
a corrupt payload.

Version rule: any change to the envelope or the entry encoding bumps
``FORMAT_VERSION``; ranks must run the same format version, and a payload of
another version is rejected with ``WireFormatError`` naming the sender and
both versions. Nothing here ever unpickles anything.
"""

from __future__ import annotations

import dataclasses
import reprlib
from typing import Any, Callable

import msgpack

from ..version import __version__
from ..errors import CollectiveDesyncError, WireFormatError
from .fingerprint import Collective
from ..state import (
    DYNAMIC,
    UNSET,
    FrameId,
    InferStride,
    LocalState,
    Marker,
    SizeEntry,
    registered_fields,
)

FORMAT_VERSION = 1

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
# A rank is never going to record more dims than this; larger is corruption.
_MAX_DIMS = 64


@dataclasses.dataclass
class Envelope:
    """A decoded payload."""

    format_version: int
    package_version: str
    rank: int
    world_size: int
    frame: FrameId
    seq: int
    sent_at: float
    state: LocalState


# ---------------------------------------------------------------- encoding


def _atom_out(a: Any) -> Any:
    if a is DYNAMIC:
        return None
    if a is UNSET:
        return False
    if isinstance(a, InferStride):
        return [a.dim]
    if type(a) is int:
        return a
    raise TypeError(f"cannot encode size atom {a!r} of type {type(a).__name__}")


def _part_out(part: Any) -> Any:
    if isinstance(part, Marker):
        return _atom_out(part)
    return [_atom_out(a) for a in part]


def _entry_out(entry: SizeEntry) -> list[Any]:
    out = [_atom_out(entry.scalar), _part_out(entry.size), _part_out(entry.stride)]
    if entry.excluded_sizes is not None or entry.excluded_scalar is not None:
        out.append(None if entry.excluded_sizes is None else list(entry.excluded_sizes))
        if entry.excluded_scalar is not None:
            out.append(entry.excluded_scalar)
    return out


_MIN_SHARED_PREFIX = 8  # below this, a plain string is as short


def _front_code(names: Any) -> list[Any]:
    out: list[Any] = []
    previous = ""
    for name in names:
        limit = min(len(previous), len(name))
        k = 0
        while k < limit and previous[k] == name[k]:
            k += 1
        out.append([k, name[k:]] if k >= _MIN_SHARED_PREFIX else name)
        previous = name
    return out


def encode(
    state: LocalState,
    *,
    rank: int,
    world_size: int,
    frame: FrameId,
    seq: int,
    sent_at: float,
) -> bytes:
    """Serialize this rank's state into the versioned envelope."""
    fields = registered_fields()
    extras = {}
    for name, value in state.extras.items():
        field = fields.get(name)
        if field is None:
            raise TypeError(f"LocalState extra field {name!r} is not registered")
        extras[name] = field.to_wire(value)
    body = [
        [[name_out, _entry_out(entry)] for name_out, entry in zip(
            _front_code(state.automatic_dynamic), state.automatic_dynamic.values())],
        bool(state.frame_state_fresh),
        extras,
    ]
    envelope = [
        FORMAT_VERSION,
        __version__,
        rank,
        world_size,
        [frame.name, frame.filename, frame.line],
        seq,
        float(sent_at),
        body,
    ]
    return msgpack.packb(envelope, use_bin_type=True)


# ---------------------------------------------------------------- decoding


class _Bad(Exception):
    """Internal: a validation failure, turned into WireFormatError by decode()."""


_short_repr = reprlib.Repr()
_short_repr.maxlevel = 3
_short_repr.maxstring = 80
_short_repr.maxother = 80


def _show(v: Any) -> str:
    # Bounded repr of a peer's value for error messages: a plain repr() of a
    # deeply nested value raises RecursionError, and of a huge one is huge.
    return _short_repr.repr(v)


_NATIVE_LEAVES = (type(None), bool, int, float, str, bytes)


def _is_native(v: Any) -> bool:
    """Only msgpack's own types: no ExtType, no Timestamp (ext type -1)."""
    stack = [v]
    while stack:  # iterative: values may nest as deep as msgpack allows
        x = stack.pop()
        if type(x) is list:
            stack.extend(x)
        elif type(x) is dict:
            stack.extend(x.keys())
            stack.extend(x.values())
        elif type(x) not in _NATIVE_LEAVES:
            return False
    return True


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise _Bad(what)


def _int(v: Any, what: str, *, lo: int = _INT64_MIN) -> int:
    _expect(type(v) is int and lo <= v <= _INT64_MAX, f"{what} must be an int in range, got {_show(v)}")
    return v


def _atom_in(v: Any, what: str, *, allow_infer: bool, lo: int) -> Any:
    if v is None:
        return DYNAMIC
    if v is False:
        return UNSET
    if type(v) is int:
        return _int(v, what, lo=lo)
    if allow_infer and type(v) is list and len(v) == 1:
        return InferStride(_int(v[0], f"{what} InferStride dim", lo=0))
    raise _Bad(f"{what}: unexpected value {_show(v)}")


def _part_in(v: Any, what: str, *, allow_infer: bool) -> Any:
    if v is None:
        return DYNAMIC
    if v is False:
        return UNSET
    _expect(type(v) is list, f"{what} must be a marker or a list, got {type(v).__name__}")
    _expect(len(v) <= _MAX_DIMS, f"{what} has {len(v)} dims (limit {_MAX_DIMS})")
    atoms = tuple(
        _atom_in(a, f"{what}[{i}]", allow_infer=allow_infer, lo=0) for i, a in enumerate(v)
    )
    _expect(all(a is not UNSET for a in atoms), f"{what} has an unset dim")
    return atoms


def _entry_in(name: str, v: Any) -> SizeEntry:
    what = f"entry {name!r}"
    _expect(type(v) is list and 3 <= len(v) <= 5, f"{what} must be a list of 3 to 5 items")
    scalar = _atom_in(v[0], f"{what} scalar", allow_infer=False, lo=_INT64_MIN)
    size = _part_in(v[1], f"{what} size", allow_infer=False)
    stride = _part_in(v[2], f"{what} stride", allow_infer=True)
    excluded_sizes = None
    excluded_scalar = None
    if len(v) >= 4 and v[3] is not None:
        _expect(type(v[3]) is list and len(v[3]) <= _MAX_DIMS, f"{what} excluded_sizes must be a list")
        excluded_sizes = tuple(
            None if s is None else _int(s, f"{what} excluded_sizes[{i}]", lo=0)
            for i, s in enumerate(v[3])
        )
    if len(v) == 5:
        excluded_scalar = _int(v[4], f"{what} excluded_scalar")
    return SizeEntry(scalar, size, stride, excluded_sizes, excluded_scalar)


def _state_in(v: Any) -> LocalState:
    _expect(type(v) is list and len(v) == 3, "state must be [entries, fresh, extras]")
    raw_entries, fresh, raw_extras = v
    _expect(type(raw_entries) is list, "entries must be a list")
    _expect(type(fresh) is bool, "frame_state_fresh must be a bool")
    _expect(type(raw_extras) is dict, "extras must be a map")
    entries: dict[str, SizeEntry] = {}
    previous = ""
    for i, pair in enumerate(raw_entries):
        _expect(type(pair) is list and len(pair) == 2, f"entries[{i}] must be [name, entry]")
        name, raw = pair
        if type(name) is list:
            _expect(
                len(name) == 2 and type(name[0]) is int and 0 <= name[0] <= len(previous)
                and type(name[1]) is str,
                f"entries[{i}] front-coded name must be [k <= {len(previous)}, suffix]",
            )
            name = previous[: name[0]] + name[1]
        _expect(type(name) is str and name != "", f"entries[{i}] name must be a non-empty string")
        previous = name
        _expect(name not in entries, f"source {name!r} appears twice")
        entries[name] = _entry_in(name, raw)
    fields = registered_fields()
    extras: dict[str, Any] = {}
    for name, raw in raw_extras.items():
        field = fields.get(name)
        _expect(field is not None, f"unknown extra field {name!r} (is the same package version on every rank?)")
        _expect(_is_native(raw), f"extra field {name!r} holds a msgpack ExtType or Timestamp")
        try:
            extras[name] = field.from_wire(raw)
        except (TypeError, ValueError) as e:
            raise _Bad(f"extra field {name!r}: {e}") from None
    missing = set(fields) - set(extras)
    _expect(not missing, f"extra fields missing: {sorted(missing)}")
    return LocalState(automatic_dynamic=entries, frame_state_fresh=fresh, extras=extras)


def _unpack(data: Any, max_bytes: int, fail: Callable[[str], WireFormatError]) -> Any:
    """Bounded msgpack decoding of a peer's bytes (never pickle); ``fail(why)`` makes the error."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise fail(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise fail(f"{len(data)} bytes exceeds the limit of {max_bytes} (COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES)")
    try:
        return msgpack.unpackb(bytes(data), raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise fail(f"not valid msgpack ({type(e).__name__}: {e})") from None


def _version_in(obj: Any) -> int:
    """The envelope's format version, which must be ours (raises ``_Bad``)."""
    _expect(type(obj) is list and len(obj) > 0, "envelope must be a non-empty list")
    version = obj[0]
    _expect(type(version) is int, f"format version must be an int, got {_show(version)}")
    if version != FORMAT_VERSION:
        pkg = obj[1] if len(obj) > 1 and type(obj[1]) is str else "unknown"
        raise _Bad(
            f"wire format version {version} (package {pkg}), this rank speaks version "
            f"{FORMAT_VERSION} (package {__version__}); install the same compiler_collectives "
            "version on every rank"
        )
    return version


def _header_in(
    obj: list[Any], sender: int, expected_world_size: int | None
) -> tuple[str, int, int, FrameId, int, float]:
    """(package, rank, world size, frame, seq, sent_at) from the first seven items of an
    envelope, each checked (raises ``_Bad``); shared by compiler-collective and audit envelopes."""
    _, pkg, rank, world, frame, seq, sent_at = obj[:7]
    _expect(type(pkg) is str and len(pkg) < 64, "package version must be a short string")
    _int(rank, "sender rank", lo=0)
    _expect(rank == sender, f"payload claims to come from rank {rank}")
    _int(world, "world size", lo=1)
    if expected_world_size is not None:
        _expect(world == expected_world_size, f"world size {world}, expected {expected_world_size}")
    _expect(type(frame) is list and len(frame) == 3, "frame must be [co_name, file, line]")
    _expect(type(frame[0]) is str and type(frame[1]) is str, "frame name and file must be strings")
    line = _int(frame[2], "frame line", lo=0)
    _int(seq, "sequence number", lo=0)
    _expect(type(sent_at) is float, "sent_at must be a float")
    return pkg, rank, world, FrameId(frame[0], frame[1], line), seq, sent_at


def decode(data: bytes, *, sender: int, max_bytes: int, expected_world_size: int | None = None) -> Envelope:
    """Parse and validate one rank's payload; raise ``WireFormatError`` on anything wrong.

    ``sender`` is the rank whose slot the bytes arrived in (the transport knows
    it; the payload's own claim is checked against it).
    """

    def fail(why: str) -> WireFormatError:
        return WireFormatError(
            f"bad compiler-collective payload from rank {sender}: {why}. "
            "Check that every rank runs the same compiler_collectives and torch "
            "versions; if they do, this is a bug or a corrupted transport.",
            kind="compiler",
            ranks=(sender,),
        )

    obj = _unpack(data, max_bytes, fail)
    try:
        version = _version_in(obj)
        if len(obj) == 9 and obj[7] == AUDIT:
            raise _OutOfStep(
                f"rank {sender} sent a program-audit payload ({_peer_position(obj)}) while this "
                "rank runs a compiler collective"
            )
        _expect(len(obj) == 8, f"envelope must have 8 items, got {len(obj)}")
        pkg, rank, world, frame, seq, sent_at = _header_in(obj, sender, expected_world_size)
        local_state = _state_in(obj[7])
    except _Bad as e:
        raise fail(str(e)) from None
    except _OutOfStep as e:
        raise _desync(str(e), sender) from None
    return Envelope(
        format_version=version,
        package_version=pkg,
        rank=rank,
        world_size=world,
        frame=frame,
        seq=seq,
        sent_at=sent_at,
        state=local_state,
    )


# ---------------------------------------------------------------- program audit
#
# [format_version, package_version, sender_rank, world_size,
#  [co_name, co_filename, co_firstlineno], seq, sent_at, "audit", body]
#
# body is one of
#   ["summary", phase, failure, levels, pending_backwards]
#       failure: nil, or "ExcType: message" when this rank's compile raised
#       levels: [[level, graphs, collectives, collectives_digest, graph_digest], ...]
#       pending_backwards: [bool, ...], one per AOTAutograd training graph
#   ["details", phase, level, [[op, group, reduce_op, [tensor, ...], args, where], ...]]
# Digests are 8-byte binaries. Only "details" carries text from the graphs,
# and only after the summaries disagreed.

AUDIT = "audit"
AUDIT_PHASES = ("forward", "backward")
_MAX_LEVELS = 32
_MAX_TEXT = 4096
_MAX_ITEMS = 1_000_000


class _OutOfStep(Exception):
    """Internal: the peer sent the other kind of envelope."""


def _desync(why: str, sender: int) -> CollectiveDesyncError:
    return CollectiveDesyncError(
        f"{why}: the ranks are out of step (one finished compiling a graph while the other "
        "started compiling another frame). Compiler collectives need every rank to compile the "
        "same frames in the same order; look for rank-dependent control flow around compiled calls.",
        ranks=(sender,),
    )


def _peer_position(obj: list[Any]) -> str:
    frame = obj[4] if type(obj[4]) is list and len(obj[4]) == 3 else None
    where = f"frame {_show(frame[0])} at {_show(frame[1])}:{_show(frame[2])}" if frame else "unknown frame"
    return f"#{_show(obj[5])}, {where}"


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
    pending_backwards: list[bool]


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
            [bool(p) for p in body.pending_backwards],
        ]
    else:
        out = [
            "details",
            body.phase,
            body.level,
            [[_clip(c.op), _clip(c.group), _clip(c.reduce_op), [_clip(t) for t in c.tensors],
              _clip(c.args), _clip(c.where)] for c in body.collectives],
        ]
    envelope = [
        FORMAT_VERSION, __version__, rank, world_size,
        [frame.name, frame.filename, frame.line], seq, float(sent_at), AUDIT, out,
    ]
    return msgpack.packb(envelope, use_bin_type=True)


def _text(v: Any, what: str) -> str:
    _expect(type(v) is str and len(v) <= _MAX_TEXT, f"{what} must be a string of at most {_MAX_TEXT} characters")
    return v


def _digest(v: Any, what: str) -> bytes:
    _expect(type(v) is bytes and len(v) == 8, f"{what} must be 8 bytes")
    return v


def _audit_body_in(v: Any) -> AuditSummary | AuditDetails:
    _expect(type(v) is list and len(v) in (4, 5), "audit body must be a list of 4 or 5 items")
    _expect(v[1] in AUDIT_PHASES, f"audit phase must be one of {AUDIT_PHASES}, got {_show(v[1])}")
    if v[0] == "summary" and len(v) == 5:
        _, phase, failure, raw_levels, raw_pending = v
        _expect(failure is None or type(failure) is str, "audit failure must be nil or a string")
        _expect(type(raw_levels) is list and len(raw_levels) <= _MAX_LEVELS,
                f"audit levels must be a list of at most {_MAX_LEVELS}")
        levels = []
        seen: set[str] = set()
        for i, lv in enumerate(raw_levels):
            _expect(type(lv) is list and len(lv) == 5, f"audit level {i} must have 5 items")
            name = _text(lv[0], f"audit level {i} name")
            _expect(name not in seen, f"audit level {name!r} appears twice")
            seen.add(name)
            levels.append(AuditLevel(
                name,
                _int(lv[1], f"audit level {name!r} graph count", lo=0),
                _int(lv[2], f"audit level {name!r} collective count", lo=0),
                _digest(lv[3], f"audit level {name!r} collectives digest"),
                _digest(lv[4], f"audit level {name!r} graph digest"),
            ))
        _expect(type(raw_pending) is list and len(raw_pending) <= _MAX_ITEMS
                and all(type(p) is bool for p in raw_pending), "audit pending backwards must be a list of bools")
        return AuditSummary(phase, None if failure is None else _text(failure, "audit failure"), levels, raw_pending)
    if v[0] == "details" and len(v) == 4:
        _, phase, level, raw = v
        _text(level, "audit details level")
        _expect(type(raw) is list and len(raw) <= _MAX_ITEMS, "audit collectives must be a list")
        collectives = []
        for i, c in enumerate(raw):
            what = f"audit collective {i}"
            _expect(type(c) is list and len(c) == 6, f"{what} must have 6 items")
            _expect(type(c[3]) is list and len(c[3]) <= _MAX_ITEMS, f"{what} tensors must be a list")
            collectives.append(Collective(
                op=_text(c[0], f"{what} op"),
                group=_text(c[1], f"{what} group"),
                reduce_op=_text(c[2], f"{what} reduce op"),
                tensors=tuple(_text(t, f"{what} tensor") for t in c[3]),
                args=_text(c[4], f"{what} args"),
                where=_text(c[5], f"{what} source line"),
            ))
        return AuditDetails(phase, level, collectives)
    raise _Bad(f"unknown audit body {_show(v[0])}")


def decode_audit(
    data: bytes, *, sender: int, max_bytes: int, expected_world_size: int | None = None
) -> AuditEnvelope:
    """Parse and validate one rank's audit payload; ``WireFormatError`` on anything wrong,
    ``CollectiveDesyncError`` if the sender is in a compiler collective instead."""

    def fail(why: str) -> WireFormatError:
        return WireFormatError(
            f"bad program-audit payload from rank {sender}: {why}. Check that every rank runs "
            "the same compiler_collectives and torch versions; if they do, this is a bug or a "
            "corrupted transport.",
            kind="audit",
            ranks=(sender,),
        )

    obj = _unpack(data, max_bytes, fail)
    try:
        version = _version_in(obj)
        if len(obj) == 8:
            raise _OutOfStep(
                f"rank {sender} is in a compiler collective ({_peer_position(obj)}) while this rank "
                "audits a compiled graph"
            )
        _expect(len(obj) == 9 and obj[7] == AUDIT, "audit envelope must have 9 items tagged 'audit'")
        pkg, rank, world, frame, seq, sent_at = _header_in(obj, sender, expected_world_size)
        parsed = _audit_body_in(obj[8])
    except _Bad as e:
        raise fail(str(e)) from None
    except _OutOfStep as e:
        raise _desync(str(e), sender) from None
    return AuditEnvelope(version, pkg, rank, world, frame, seq, sent_at, parsed)


# ------------------------------------------------ recompile-reason payloads
#
# After the guard collective agreed on a miss, each rank sends why it missed
# (nothing if it hit), on the slow path only:
#
#     [REASONS_FORMAT_VERSION, "recompile_reasons", sender_rank, world_size,
#      guard_seq, missed, [reason, ...]]
#
# Reasons are Dynamo's guard-failure texts, cut to MAX_REASON_CHARS each and
# MAX_REASONS in all by the sender; the decoder enforces both.

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
    kept = [r[:MAX_REASON_CHARS] for r in reasons[:MAX_REASONS]]
    return msgpack.packb(
        [REASONS_FORMAT_VERSION, REASONS_TAG, rank, world_size, seq, bool(missed), kept],
        use_bin_type=True,
    )


def decode_reasons(
    data: bytes, *, sender: int, max_bytes: int, expected_world_size: int | None = None
) -> ReasonsEnvelope:
    """Parse and validate one rank's recompile reasons; raise ``WireFormatError`` naming the sender."""

    def fail(why: str) -> WireFormatError:
        return WireFormatError(
            f"bad recompile-reason payload from rank {sender}: {why}. Check that every rank "
            "runs the same compiler_collectives version; if it does, this is a bug or a "
            "corrupted transport.",
            kind="guard",
            ranks=(sender,),
        )

    obj = _unpack(data, max_bytes, fail)
    try:
        _expect(type(obj) is list and len(obj) > 0, "payload must be a non-empty list")
        version = obj[0]
        _expect(type(version) is int, f"format version must be an int, got {_show(version)}")
        _expect(
            version == REASONS_FORMAT_VERSION,
            f"recompile-reason format version {version}, this rank speaks version "
            f"{REASONS_FORMAT_VERSION} (package {__version__}); install the same "
            "compiler_collectives version on every rank",
        )
        _expect(len(obj) == 7, f"payload must have 7 items, got {len(obj)}")
        _, tag, rank, world, seq, missed, reasons = obj
        _expect(tag == REASONS_TAG, f"payload tag {_show(tag)}, expected {REASONS_TAG!r}")
        _int(rank, "sender rank", lo=0)
        _expect(rank == sender, f"payload claims to come from rank {rank}")
        _int(world, "world size", lo=1)
        if expected_world_size is not None:
            _expect(world == expected_world_size, f"world size {world}, expected {expected_world_size}")
        _int(seq, "guard sequence number", lo=0)
        _expect(type(missed) is bool, "missed must be a bool")
        _expect(type(reasons) is list and len(reasons) <= MAX_REASONS,
                f"reasons must be a list of at most {MAX_REASONS}")
        for i, reason in enumerate(reasons):
            _expect(type(reason) is str and len(reason) <= MAX_REASON_CHARS,
                    f"reasons[{i}] must be a string of at most {MAX_REASON_CHARS} characters")
        _expect(missed or not reasons, "a rank that hit sent reasons")
    except _Bad as e:
        raise fail(str(e)) from None
    return ReasonsEnvelope(rank=rank, world_size=world, seq=seq, missed=missed, reasons=reasons)
