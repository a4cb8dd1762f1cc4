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

**Bounded decoding.** Every rank decodes every rank's payload, so a payload
must not be able to cost more than a small multiple of its own size. The
decoders read a payload one value at a time (``_Reader``): the version is
checked before anything else is read; the envelope's length, the entries'
shape and each size/stride's dims are checked from msgpack's headers before
their items are built; msgpack's own limits cap each string, binary, array
and map at the payload's size; everything built generically (the frame,
extras, audit bodies, reasons) is charged to a budget of estimated memory
(``DECODED_BYTES_PER_BYTE`` times the payload, plus ``DECODE_SLACK``); and
front-coded names, which can legitimately expand, share a budget of
``NAME_CHARS_PER_BYTE`` characters per payload byte. A payload over any of
them is a ``WireFormatError`` naming the sender, raised before the excess is
allocated.
"""

from __future__ import annotations

import dataclasses
import reprlib
from collections.abc import Callable
from typing import Any

import msgpack

from ..errors import CollectiveDesyncError, MalformedPayload, PayloadOutOfStep, WireFormatError
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
from ..version import __version__
from .fingerprint import Collective

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
        [
            [name_out, _entry_out(entry)]
            for name_out, entry in zip(_front_code(state.automatic_dynamic), state.automatic_dynamic.values())
        ],
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
        raise MalformedPayload(what)


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
    raise MalformedPayload(f"{what}: unexpected value {_show(v)}")


def _atom_raw(r: _Reader, what: str, *, allow_infer: bool) -> Any:
    """One atom's msgpack value: a single value, or for strides ``[d]`` (its header checked first)."""
    if allow_infer and r.array_next():
        r.array(f"{what} InferStride", 1, 1)
        return [r.scalar(f"{what} InferStride dim")]
    return r.scalar(what)


def _part_in(r: _Reader, what: str, *, allow_infer: bool) -> Any:
    if not r.array_next():
        v = r.scalar(what)
        _expect(v is None or v is False, f"{what} must be a marker or a list, got {type(v).__name__}")
        return DYNAMIC if v is None else UNSET
    n = r.array(what)
    _expect(n <= _MAX_DIMS, f"{what} has {n} dims (limit {_MAX_DIMS})")
    atoms = tuple(
        _atom_in(_atom_raw(r, f"{what}[{i}]", allow_infer=allow_infer), f"{what}[{i}]", allow_infer=allow_infer, lo=0)
        for i in range(n)
    )
    _expect(all(a is not UNSET for a in atoms), f"{what} has an unset dim")
    return atoms


def _entry_in(r: _Reader, name: str) -> SizeEntry:
    what = f"entry {name!r}"
    n = r.array(what, 3, 5)
    scalar = _atom_in(r.scalar(f"{what} scalar"), f"{what} scalar", allow_infer=False, lo=_INT64_MIN)
    size = _part_in(r, f"{what} size", allow_infer=False)
    stride = _part_in(r, f"{what} stride", allow_infer=True)
    excluded_sizes = None
    excluded_scalar = None
    if n >= 4:
        if r.array_next():
            count = r.array(f"{what} excluded_sizes", 0, _MAX_DIMS)
            excluded_sizes = tuple(
                None if s is None else _int(s, f"{what} excluded_sizes[{i}]", lo=0)
                for i, s in ((i, r.scalar(f"{what} excluded_sizes[{i}]")) for i in range(count))
            )
        else:
            _expect(r.scalar(f"{what} excluded_sizes") is None, f"{what} excluded_sizes must be a list")
    if n == 5:
        excluded_scalar = _int(r.scalar(f"{what} excluded_scalar"), f"{what} excluded_scalar")
    return SizeEntry(scalar, size, stride, excluded_sizes, excluded_scalar)


def _name_in(r: _Reader, i: int, previous: str) -> str:
    """entries[i]'s source name: a string, or ``[k, suffix]`` (charged to the name budget)."""
    if r.array_next():
        what = f"entries[{i}] front-coded name must be [k <= {len(previous)}, suffix]"
        r.array(what, 2, 2)
        k, suffix = r.scalar(what), r.scalar(what)
        _expect(type(k) is int and 0 <= k <= len(previous) and type(suffix) is str, what)
        r.charge_name(k + len(suffix))
        return previous[:k] + suffix
    name = r.scalar(f"entries[{i}] name")
    _expect(type(name) is str, f"entries[{i}] name must be a non-empty string")
    r.charge_name(len(name))
    return name


def _state_in(r: _Reader) -> LocalState:
    if not r.array_next():
        r.value()
        raise MalformedPayload("state must be [entries, fresh, extras]")
    r.array("state [entries, fresh, extras]", 3, 3)
    count = r.array("entries")
    entries: dict[str, SizeEntry] = {}
    previous = ""
    for i in range(count):
        r.array(f"entries[{i}] [name, entry]", 2, 2)
        name = _name_in(r, i, previous)
        _expect(name != "", f"entries[{i}] name must be a non-empty string")
        previous = name
        _expect(name not in entries, f"source {name!r} appears twice")
        entries[name] = _entry_in(r, name)
    fresh = r.scalar("frame_state_fresh")
    _expect(type(fresh) is bool, "frame_state_fresh must be a bool")
    raw_extras = r.value()
    _expect(type(raw_extras) is dict, "extras must be a map")
    fields = registered_fields()
    extras: dict[str, Any] = {}
    for name, raw in raw_extras.items():
        field = fields.get(name)
        _expect(field is not None, f"unknown extra field {name!r} (is the same package version on every rank?)")
        _expect(_is_native(raw), f"extra field {name!r} holds a msgpack ExtType or Timestamp")
        try:
            extras[name] = field.from_wire(raw)
        except (TypeError, ValueError) as e:
            raise MalformedPayload(f"extra field {name!r}: {e}") from None
    missing = set(fields) - set(extras)
    _expect(not missing, f"extra fields missing: {sorted(missing)}")
    return LocalState(automatic_dynamic=entries, frame_state_fresh=fresh, extras=extras)


DECODED_BYTES_PER_BYTE = 16
"""Budget for values built generically (the frame, extras, audit bodies, reasons): estimated
bytes of Python objects per payload byte, charged before each is built. An empty msgpack
array is one byte but a 56-byte list; legitimate payloads stay far below."""
NAME_CHARS_PER_BYTE = 32
"""Budget for source names, front-coded ones included, in characters per payload byte. A
front-coded name costs a few bytes however long its shared prefix, so names may legitimately
expand (long module paths share long prefixes); without a cap a 1 MiB payload built names
of 3 GB."""
DECODE_SLACK = 1 << 20  # added to both budgets: small payloads never come near them

_ARRAY_FIRST = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
_MAP_FIRST = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def _cost(v: Any) -> int:
    """Estimated bytes of a Python object built from msgpack, beyond its reference; lists and
    maps are charged on their own (singletons: nothing)."""
    t = type(v)
    if t is str:
        return 49 + len(v) if len(v) > 1 else 0
    if t is bytes:
        return 33 + len(v) if len(v) > 1 else 0
    if t is int:
        return 0 if -5 <= v <= 256 else 36
    if t is float:
        return 24
    return 0 if v is None or t is bool or t is list or t is dict else 64


class _Reader:
    """A peer's payload read one value at a time, within the limits above (raises ``MalformedPayload``).

    The parts whose shape the format fixes are read header first (``array``, ``scalar``),
    so a list of the wrong length or a container where a single value belongs is refused
    before anything in it is built; ``value`` builds anything else, within the budget."""

    __slots__ = ("_data", "_left", "_names_left", "_up")

    def __init__(self, data: bytes) -> None:
        n = len(data)
        self._data = data
        self._left = DECODED_BYTES_PER_BYTE * n + DECODE_SLACK
        self._names_left = NAME_CHARS_PER_BYTE * n + DECODE_SLACK
        # No item can be longer than the payload, nor a map hold more pairs than half of it.
        self._up = msgpack.Unpacker(
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_buffer_size=max(n, 1),
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=n,
        )
        self._up.feed(data)

    def _charge(self, cost: int) -> None:
        self._left -= cost
        if self._left < 0:
            raise MalformedPayload(
                f"it decodes to more than {DECODED_BYTES_PER_BYTE} bytes of Python objects per payload byte"
            )

    def charge_name(self, chars: int) -> None:
        self._names_left -= chars
        if self._names_left < 0:
            raise MalformedPayload(
                f"its source names decode to more than {NAME_CHARS_PER_BYTE} characters per "
                "payload byte (front-coded names each repeating a long prefix)"
            )

    def _next(self) -> int | None:
        at = self._up.tell()
        return self._data[at] if at < len(self._data) else None

    def array_next(self) -> bool:
        return self._next() in _ARRAY_FIRST

    def container_next(self) -> bool:
        first = self._next()
        return first in _ARRAY_FIRST or first in _MAP_FIRST

    def _read(self, step: Callable[[], Any]) -> Any:
        try:
            return step()
        except Exception as e:  # msgpack raises several unrelated types
            raise MalformedPayload(f"not valid msgpack ({type(e).__name__}: {e})") from None

    def value(self) -> Any:
        """The next value, whatever it is, charged to the budget as it is built.

        msgpack's C decoder builds it, calling back for each list and map once built
        (with its items); no single list or map may hold more items than the budget left
        could pay for, so what is built beyond the budget is at most that budget again."""
        start = self._up.tell()
        self._read(self._up.skip)  # its extent, nothing built
        raw = self._data[start : self._up.tell()]
        longest = max(self._left // 72, 16)  # 72: the most one item of a list can cost
        try:
            v = msgpack.unpackb(
                raw,
                raw=False,
                use_list=True,
                strict_map_key=True,
                max_str_len=len(raw),
                max_bin_len=len(raw),
                max_ext_len=len(raw),
                max_array_len=min(len(raw), longest),
                max_map_len=min(len(raw) // 2, longest),
                list_hook=self._list,
                object_hook=self._map,
            )
        except MalformedPayload:
            raise
        except Exception as e:  # msgpack raises several unrelated types
            raise MalformedPayload(f"not valid msgpack ({type(e).__name__}: {e})") from None
        self._charge(_cost(v))
        return v

    def _list(self, items: list) -> list:
        self._charge(56 + 8 * len(items) + sum(map(_cost, items)))
        return items

    def _map(self, items: dict) -> dict:
        self._charge(64 + 48 * len(items) + sum(map(_cost, items.keys())) + sum(map(_cost, items.values())))
        return items

    def scalar(self, what: str) -> Any:
        """The next value, which must not be a list or map (checked before it is built)."""
        _expect(not self.container_next(), f"{what}: a list or map where a single value belongs")
        return self.value()

    def array(self, what: str, lo: int = 0, hi: int | None = None) -> int:
        """The next value's length, which must be an array of lo..hi items (from its header)."""
        if not self.array_next():
            self.value()  # invalid msgpack says so; anything else is the wrong type
            raise MalformedPayload(f"{what} must be a list")
        n = self._read(self._up.read_array_header)
        if hi is None:
            _expect(lo <= n, f"{what} must have at least {lo} item(s)")
        else:
            _expect(lo <= n <= hi, f"{what} must be a list of {lo if lo == hi else f'{lo} to {hi}'} items, got {n}")
        return n

    def end(self) -> None:
        _expect(
            self._up.tell() == len(self._data),
            f"not valid msgpack ({len(self._data) - self._up.tell()} bytes of extra data after the envelope)",
        )


def _reader(data: Any, max_bytes: int, fail: Callable[[str], WireFormatError]) -> _Reader:
    """A bounded reader of a peer's bytes (never pickle); ``fail(why)`` makes the error."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise fail(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise fail(f"{len(data)} bytes exceeds the limit of {max_bytes} (COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES)")
    return _Reader(bytes(data))


def _envelope_head(r: _Reader, versions: str, *, speaks: int) -> tuple[int, list[Any]]:
    """(envelope length, [version, package, rank, world, frame, seq, sent_at]), the version
    checked before any other item is read (raises ``MalformedPayload``)."""
    if not r.array_next():
        r.value()
        raise MalformedPayload("envelope must be a non-empty list")
    n = r.array("envelope")
    _expect(n > 0, "envelope must be a non-empty list")
    version = r.scalar("format version")
    _version_in(version, lambda: r.value() if n > 1 else None, versions, speaks)
    _expect(n <= 9, f"envelope must have 8 or 9 items, got {n}")
    head = [version] + [r.value() for _ in range(1, min(n, 7))]
    return n, head


def _version_in(
    version: Any, package: Callable[[], Any], what: str = "wire format", speaks: int = FORMAT_VERSION
) -> int:
    """The format version, which must be ours (raises ``MalformedPayload``); ``package()`` reads the
    sender's package version, only for the message."""
    _expect(type(version) is int, f"format version must be an int, got {_show(version)}")
    if version != speaks:
        pkg = package()
        raise MalformedPayload(
            f"{what} version {version}{f' (package {pkg})' if type(pkg) is str else ''}, "
            "this rank speaks version "
            f"{speaks} (package {__version__}); install the same compiler_collectives "
            "version on every rank"
        )
    return version


def _header_in(
    obj: list[Any], sender: int, expected_world_size: int | None
) -> tuple[str, int, int, FrameId, int, float]:
    """(package, rank, world size, frame, seq, sent_at) from the first seven items of an
    envelope, each checked (raises ``MalformedPayload``); shared by compiler-collective and audit envelopes."""
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


def _failure(payload: str, kind: str, sender: int, versions: str) -> Callable[[str], WireFormatError]:
    """How a decoder of ``payload`` payloads names what is wrong with the one ``sender`` sent."""
    same = "it does" if versions.endswith("version") else "they do"

    def fail(why: str) -> WireFormatError:
        return WireFormatError(
            f"bad {payload} payload from rank {sender}: {why}. Check that every rank runs the same "
            f"{versions}; if {same}, this is a bug or a corrupted transport.",
            kind=kind,
            ranks=(sender,),
        )

    return fail


def decode(data: bytes, *, sender: int, max_bytes: int, expected_world_size: int | None = None) -> Envelope:
    """Parse and validate one rank's payload; raise ``WireFormatError`` on anything wrong.

    ``sender`` is the rank whose slot the bytes arrived in (the transport knows
    it; the payload's own claim is checked against it).
    """

    fail = _failure("compiler-collective", "compiler", sender, "compiler_collectives and torch versions")
    r = _reader(data, max_bytes, fail)
    try:
        n, obj = _envelope_head(r, "wire format", speaks=FORMAT_VERSION)
        version = obj[0]
        if n == 9 and r.value() == AUDIT:
            raise PayloadOutOfStep(
                f"rank {sender} sent a program-audit payload ({_peer_position(obj)}) while this "
                "rank runs a compiler collective"
            )
        _expect(n == 8, f"envelope must have 8 items, got {n}")
        pkg, rank, world, frame, seq, sent_at = _header_in(obj, sender, expected_world_size)
        local_state = _state_in(r)
        r.end()
    except MalformedPayload as e:
        raise fail(str(e)) from None
    except PayloadOutOfStep as e:
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
    envelope = [
        FORMAT_VERSION,
        __version__,
        rank,
        world_size,
        [frame.name, frame.filename, frame.line],
        seq,
        float(sent_at),
        AUDIT,
        out,
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
        _expect(
            type(raw_levels) is list and len(raw_levels) <= _MAX_LEVELS,
            f"audit levels must be a list of at most {_MAX_LEVELS}",
        )
        levels = []
        seen: set[str] = set()
        for i, lv in enumerate(raw_levels):
            _expect(type(lv) is list and len(lv) == 5, f"audit level {i} must have 5 items")
            name = _text(lv[0], f"audit level {i} name")
            _expect(name not in seen, f"audit level {name!r} appears twice")
            seen.add(name)
            levels.append(
                AuditLevel(
                    name,
                    _int(lv[1], f"audit level {name!r} graph count", lo=0),
                    _int(lv[2], f"audit level {name!r} collective count", lo=0),
                    _digest(lv[3], f"audit level {name!r} collectives digest"),
                    _digest(lv[4], f"audit level {name!r} graph digest"),
                )
            )
        _expect(
            type(raw_pending) is list and len(raw_pending) <= _MAX_ITEMS and all(type(p) is bool for p in raw_pending),
            "audit pending backwards must be a list of bools",
        )
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
    raise MalformedPayload(f"unknown audit body {_show(v[0])}")


def decode_audit(data: bytes, *, sender: int, max_bytes: int, expected_world_size: int | None = None) -> AuditEnvelope:
    """Parse and validate one rank's audit payload; ``WireFormatError`` on anything wrong,
    ``CollectiveDesyncError`` if the sender is in a compiler collective instead."""

    fail = _failure("program-audit", "audit", sender, "compiler_collectives and torch versions")
    r = _reader(data, max_bytes, fail)
    try:
        n, obj = _envelope_head(r, "wire format", speaks=FORMAT_VERSION)
        version = obj[0]
        if n == 8:
            raise PayloadOutOfStep(
                f"rank {sender} is in a compiler collective ({_peer_position(obj)}) while this rank "
                "audits a compiled graph"
            )
        _expect(n == 9 and r.value() == AUDIT, "audit envelope must have 9 items tagged 'audit'")
        pkg, rank, world, frame, seq, sent_at = _header_in(obj, sender, expected_world_size)
        parsed = _audit_body_in(r.value())
        r.end()
    except MalformedPayload as e:
        raise fail(str(e)) from None
    except PayloadOutOfStep as e:
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

    fail = _failure("recompile-reason", "guard", sender, "compiler_collectives version")
    r = _reader(data, max_bytes, fail)
    try:
        if not r.array_next():
            r.value()
            raise MalformedPayload("payload must be a non-empty list")
        n = r.array("payload")
        _expect(n > 0, "payload must be a non-empty list")
        _version_in(r.scalar("format version"), lambda: None, "recompile-reason format", REASONS_FORMAT_VERSION)
        _expect(n == 7, f"payload must have 7 items, got {n}")
        obj = [REASONS_FORMAT_VERSION] + [r.value() for _ in range(6)]
        r.end()
        _, tag, rank, world, seq, missed, reasons = obj
        _expect(tag == REASONS_TAG, f"payload tag {_show(tag)}, expected {REASONS_TAG!r}")
        _int(rank, "sender rank", lo=0)
        _expect(rank == sender, f"payload claims to come from rank {rank}")
        _int(world, "world size", lo=1)
        if expected_world_size is not None:
            _expect(world == expected_world_size, f"world size {world}, expected {expected_world_size}")
        _int(seq, "guard sequence number", lo=0)
        _expect(type(missed) is bool, "missed must be a bool")
        _expect(
            type(reasons) is list and len(reasons) <= MAX_REASONS, f"reasons must be a list of at most {MAX_REASONS}"
        )
        for i, reason in enumerate(reasons):
            _expect(
                type(reason) is str and len(reason) <= MAX_REASON_CHARS,
                f"reasons[{i}] must be a string of at most {MAX_REASON_CHARS} characters",
            )
        _expect(missed or not reasons, "a rank that hit sent reasons")
    except MalformedPayload as e:
        raise fail(str(e)) from None
    return ReasonsEnvelope(rank=rank, world_size=world, seq=seq, missed=missed, reasons=reasons)
