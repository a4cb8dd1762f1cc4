"""The compiler collective's payload: one rank's observations at a frame's first trace.

The envelope (``envelope.py``, format version ``FORMAT_VERSION``, now 2) ends in ``state``::

    [format_version, package_version, sender_rank, world_size,
     [co_name, co_filename, co_firstlineno], seq, sent_at, state]

``state`` is ``[entries, frame_state_fresh, extras]`` where ``entries`` is a list of
``[source_name, entry]`` and ``extras`` maps a registered field name to its msgpack-native
value. Source names are front-coded: a name may be sent as ``[k, suffix]``, meaning the first
``k`` characters of the previous entry's name followed by ``suffix``
(``L['self']._modules['layers']._modules['3']...`` names share long prefixes).

An entry is ``[scalar, size, stride]`` optionally followed by ``excluded_sizes`` and
``excluded_scalar`` (omitted when empty). Atoms:

* an int is an observed value;
* nil is ``DYNAMIC``; false is ``UNSET``;
* a one-element list ``[d]`` (strides only) is ``InferStride(d)``.

``size`` and ``stride`` are either a marker atom or a list of atoms. Any change to the state or
the entry encoding bumps ``FORMAT_VERSION``. Decoding is bounded (``codec.py``): the entries'
shape and each size/stride's dims are checked from msgpack's headers before their items are
built, and source names are charged to the name budget.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...observations import (
    DYNAMIC,
    UNSET,
    FrameId,
    InferStride,
    LocalState,
    Marker,
    SizeEntry,
    registered_fields,
)
from .codec import INT64_MIN, Reader, expect, failure, int_in, is_native, pack, reading, reject, show
from .envelope import AUDIT, VERSIONS, envelope_head, header_in, header_out, out_of_step, peer_position

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
    return pack(header_out(rank=rank, world_size=world_size, frame=frame, seq=seq, sent_at=sent_at) + [body])


# ---------------------------------------------------------------- decoding


def _atom_in(v: Any, what: str, *, allow_infer: bool, lo: int) -> Any:
    if v is None:
        return DYNAMIC
    if v is False:
        return UNSET
    if type(v) is int:
        return int_in(v, what, lo=lo)
    if allow_infer and type(v) is list and len(v) == 1:
        return InferStride(int_in(v[0], f"{what} InferStride dim", lo=0))
    reject(f"{what}: unexpected value {show(v)}")


def _atom_raw(r: Reader, what: str, *, allow_infer: bool) -> Any:
    """One atom's msgpack value: a single value, or for strides ``[d]`` (its header checked first)."""
    if allow_infer and r.array_next():
        r.array(f"{what} InferStride", 1, 1)
        return [r.scalar(f"{what} InferStride dim")]
    return r.scalar(what)


def _part_in(r: Reader, what: str, *, allow_infer: bool) -> Any:
    if not r.array_next():
        v = r.scalar(what)
        expect(v is None or v is False, f"{what} must be a marker or a list, got {type(v).__name__}")
        return DYNAMIC if v is None else UNSET
    n = r.array(what)
    expect(n <= _MAX_DIMS, f"{what} has {n} dims (limit {_MAX_DIMS})")
    atoms = tuple(
        _atom_in(_atom_raw(r, f"{what}[{i}]", allow_infer=allow_infer), f"{what}[{i}]", allow_infer=allow_infer, lo=0)
        for i in range(n)
    )
    expect(all(a is not UNSET for a in atoms), f"{what} has an unset dim")
    return atoms


def _entry_in(r: Reader, name: str) -> SizeEntry:
    what = f"entry {name!r}"
    n = r.array(what, 3, 5)
    scalar = _atom_in(r.scalar(f"{what} scalar"), f"{what} scalar", allow_infer=False, lo=INT64_MIN)
    size = _part_in(r, f"{what} size", allow_infer=False)
    stride = _part_in(r, f"{what} stride", allow_infer=True)
    excluded_sizes = None
    excluded_scalar = None
    if n >= 4:
        if r.array_next():
            count = r.array(f"{what} excluded_sizes", 0, _MAX_DIMS)
            excluded_sizes = tuple(
                None if s is None else int_in(s, f"{what} excluded_sizes[{i}]", lo=0)
                for i, s in ((i, r.scalar(f"{what} excluded_sizes[{i}]")) for i in range(count))
            )
        else:
            expect(r.scalar(f"{what} excluded_sizes") is None, f"{what} excluded_sizes must be a list")
    if n == 5:
        excluded_scalar = int_in(r.scalar(f"{what} excluded_scalar"), f"{what} excluded_scalar")
    return SizeEntry(scalar, size, stride, excluded_sizes, excluded_scalar)


def _name_in(r: Reader, i: int, previous: str) -> str:
    """entries[i]'s source name: a string, or ``[k, suffix]`` (charged to the name budget)."""
    if r.array_next():
        what = f"entries[{i}] front-coded name must be [k <= {len(previous)}, suffix]"
        r.array(what, 2, 2)
        k, suffix = r.scalar(what), r.scalar(what)
        expect(type(k) is int and 0 <= k <= len(previous) and type(suffix) is str, what)
        r.charge_name(k + len(suffix))
        expanded: str = previous[:k] + suffix
        return expanded
    name: str = r.scalar(f"entries[{i}] name")
    expect(type(name) is str, f"entries[{i}] name must be a non-empty string")
    r.charge_name(len(name))
    return name


def _state_in(r: Reader) -> LocalState:
    if not r.array_next():
        r.value()
        reject("state must be [entries, fresh, extras]")
    r.array("state [entries, fresh, extras]", 3, 3)
    count = r.array("entries")
    entries: dict[str, SizeEntry] = {}
    previous = ""
    for i in range(count):
        r.array(f"entries[{i}] [name, entry]", 2, 2)
        name = _name_in(r, i, previous)
        expect(name != "", f"entries[{i}] name must be a non-empty string")
        previous = name
        expect(name not in entries, f"source {name!r} appears twice")
        entries[name] = _entry_in(r, name)
    fresh = r.scalar("frame_state_fresh")
    expect(type(fresh) is bool, "frame_state_fresh must be a bool")
    raw_extras = r.value()
    expect(type(raw_extras) is dict, "extras must be a map")
    fields = registered_fields()
    extras: dict[str, Any] = {}
    for name, raw in raw_extras.items():
        field = fields.get(name)
        if field is None:
            reject(f"unknown extra field {name!r} (is the same package version on every rank?)")
        expect(is_native(raw), f"extra field {name!r} holds a msgpack ExtType or Timestamp")
        try:
            extras[name] = field.from_wire(raw)
        except (TypeError, ValueError) as e:
            reject(f"extra field {name!r}: {e}")
    missing = set(fields) - set(extras)
    expect(not missing, f"extra fields missing: {sorted(missing)}")
    return LocalState(automatic_dynamic=entries, frame_state_fresh=fresh, extras=extras)


def decode(data: bytes, *, sender: int, max_bytes: int, expected_world_size: int | None = None) -> Envelope:
    """Parse and validate one rank's payload; raise ``WireFormatError`` on anything wrong.

    ``sender`` is the rank whose slot the bytes arrived in (the transport knows
    it; the payload's own claim is checked against it).
    """

    fail = failure("compiler-collective", "compiler", sender, VERSIONS)
    with reading(data, max_bytes, fail) as r:
        n, obj = envelope_head(r)
        version = obj[0]
        if n == 9 and r.value() == AUDIT:
            raise out_of_step(
                f"rank {sender} sent a program-audit payload ({peer_position(obj)}) while this "
                "rank runs a compiler collective",
                sender,
            )
        expect(n == 8, f"envelope must have 8 items, got {n}")
        pkg, rank, world, frame, seq, sent_at = header_in(obj, sender, expected_world_size)
        local_state = _state_in(r)
        r.end()
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
