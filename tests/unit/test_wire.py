"""The msgpack wire format of a compiler-collective payload (no processes needed).

Every rejection must be a ``WireFormatError`` that names the sending rank; the
helper ``_rejects`` checks that for every malformed-payload test below.
"""

from __future__ import annotations

import os
import pickle

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compiler_collectives  # noqa: F401  (installs the Dynamo seams used by entry_to_torch)
from compiler_collectives import __version__, dynamo
from compiler_collectives.agreements import wire
from compiler_collectives.errors import WireFormatError
from compiler_collectives.observations import (
    DYNAMIC,
    UNSET,
    FrameId,
    InferStride,
    LocalState,
    SizeEntry,
    register_field,
    registered_fields,
    unregister_field,
)

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
FRAME = FrameId("forward", "/srv/job/model.py", 123)
SENDER = 3  # the slot most tests decode from; distinct from every default value
WORLD = 4
# Envelope positions: [version, package, rank, world, frame, seq, sent_at, state].
VERSION, PACKAGE, RANK, WORLD_SIZE, FRAME_POS, SEQ, SENT_AT, STATE = range(8)


# ---------------------------------------------------------------- helpers


def _encode(
    state: LocalState,
    *,
    rank: int = SENDER,
    world_size: int = WORLD,
    frame: FrameId = FRAME,
    seq: int = 7,
    sent_at: float = 1_700_000_000.25,
) -> bytes:
    return wire.encode(state, rank=rank, world_size=world_size, frame=frame, seq=seq, sent_at=sent_at)


def _decode(data, *, sender: int = SENDER, max_bytes: int = 1 << 20, expected_world_size=WORLD) -> wire.Envelope:
    return wire.decode(data, sender=sender, max_bytes=max_bytes, expected_world_size=expected_world_size)


def _round_trip(state: LocalState) -> LocalState:
    return _decode(_encode(state)).state


def _state(**entries: SizeEntry) -> LocalState:
    return LocalState(automatic_dynamic=dict(entries), extras={})


def _one(entry: SizeEntry) -> LocalState:
    return LocalState(automatic_dynamic={"L['x']": entry}, extras={})


def _envelope(state: LocalState | None = None) -> list:
    """A valid payload as the msgpack object tree, for tests to corrupt."""
    state = _one(SizeEntry(scalar=5, size=(2, 3), stride=(3, 1))) if state is None else state
    return msgpack.unpackb(_encode(state), raw=False)


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _rejects(data, *, sender: int = SENDER, match: str | None = None, **kwargs) -> WireFormatError:
    """Assert ``data`` is rejected with a WireFormatError that names ``sender``."""
    with pytest.raises(WireFormatError) as info:
        _decode(data, sender=sender, **kwargs)
    err = info.value
    message = str(err)
    assert f"rank {sender}" in message, message
    assert err.ranks == (sender,)
    if match is not None:
        assert match in message, message
    return err


@pytest.fixture
def field_registry():
    """Register extra fields for one test; every registration is removed afterwards."""
    added: list[str] = []

    def register(name: str, **kwargs):
        added.append(name)
        return register_field(name, **kwargs)

    yield register
    for name in added:
        unregister_field(name)


@pytest.fixture(autouse=True)
def _no_leaked_registrations():
    before = set(registered_fields())
    yield
    assert set(registered_fields()) == before, "a test left an extra field registered"


# ---------------------------------------------------------------- round trips


def test_round_trip_preserves_integer_scalar_size_and_stride():
    entry = SizeEntry(scalar=-17, size=(8, 0, 4096), stride=(4096, 4096, 1))
    assert _round_trip(_one(entry)).automatic_dynamic == {"L['x']": entry}


@pytest.mark.parametrize("marker", [DYNAMIC, UNSET], ids=["dynamic", "unset"])
def test_round_trip_preserves_marker_scalars(marker):
    decoded = _round_trip(_one(SizeEntry(scalar=marker))).automatic_dynamic["L['x']"]
    assert decoded.scalar is marker


@pytest.mark.parametrize("marker", [DYNAMIC, UNSET], ids=["dynamic", "unset"])
def test_round_trip_preserves_markers_for_a_whole_size_and_stride(marker):
    decoded = _round_trip(_one(SizeEntry(scalar=UNSET, size=marker, stride=marker))).automatic_dynamic["L['x']"]
    assert decoded.size is marker
    assert decoded.stride is marker


def test_round_trip_preserves_a_whole_size_marker_next_to_a_per_dim_stride():
    entry = SizeEntry(size=DYNAMIC, stride=(DYNAMIC, 1))
    assert _round_trip(_one(entry)).automatic_dynamic["L['x']"] == entry


def test_round_trip_preserves_dynamic_markers_per_dim():
    entry = SizeEntry(size=(DYNAMIC, 16, DYNAMIC), stride=(DYNAMIC, DYNAMIC, 1))
    decoded = _round_trip(_one(entry)).automatic_dynamic["L['x']"]
    assert decoded == entry
    assert decoded.size[0] is DYNAMIC and decoded.stride[1] is DYNAMIC


def test_an_unset_dim_is_rejected_because_dynamo_has_no_such_value():
    # Dynamo's FrameStateSizeEntry never holds auto_unset inside a size or
    # stride tuple (only for the whole tuple), so a payload carrying one is corrupt.
    data = _encode(_one(SizeEntry(size=(UNSET, 4), stride=(4, 1))))
    _rejects(data, match="unset dim")


def test_round_trip_preserves_infer_stride_markers():
    entry = SizeEntry(size=(DYNAMIC, DYNAMIC, 8), stride=(InferStride(1), InferStride(2), 1))
    decoded = _round_trip(_one(entry)).automatic_dynamic["L['x']"]
    assert decoded == entry
    assert all(isinstance(s, InferStride) for s in decoded.stride[:2])


def test_infer_stride_is_rejected_outside_strides():
    obj = _envelope()
    obj[STATE][0][0][1][1] = [[0], 3]  # InferStride's encoding inside a size
    _rejects(_pack(obj))


def test_round_trip_preserves_excluded_sizes_with_none_elements():
    entry = SizeEntry(size=(DYNAMIC, 3), stride=(3, 1), excluded_sizes=(None, 3, None, 0))
    assert _round_trip(_one(entry)).automatic_dynamic["L['x']"] == entry


def test_round_trip_preserves_excluded_scalar_without_excluded_sizes():
    entry = SizeEntry(scalar=DYNAMIC, size=DYNAMIC, stride=DYNAMIC, excluded_scalar=-1)
    decoded = _round_trip(_one(entry)).automatic_dynamic["L['x']"]
    assert decoded == entry
    assert decoded.excluded_sizes is None


def test_round_trip_preserves_excluded_sizes_and_excluded_scalar_together():
    entry = SizeEntry(size=(1, 2), stride=(2, 1), excluded_sizes=(1, None), excluded_scalar=1)
    assert _round_trip(_one(entry)).automatic_dynamic["L['x']"] == entry


def test_round_trip_preserves_empty_excluded_sizes_and_zero_dim_tensors():
    entry = SizeEntry(size=(), stride=(), excluded_sizes=())
    assert _round_trip(_one(entry)).automatic_dynamic["L['x']"] == entry


def test_round_trip_preserves_int64_extremes():
    entry = SizeEntry(scalar=INT64_MIN, size=(INT64_MAX,), stride=(INT64_MAX,), excluded_scalar=INT64_MAX)
    assert _round_trip(_one(entry)).automatic_dynamic["L['x']"] == entry


def test_round_trip_preserves_an_empty_local_state():
    decoded = _round_trip(LocalState(extras={}))
    assert decoded == LocalState(automatic_dynamic={}, frame_state_fresh=True, extras={})


def test_round_trip_preserves_frame_state_fresh_false():
    state = LocalState(automatic_dynamic={"L['x']": SizeEntry(scalar=2)}, frame_state_fresh=False, extras={})
    assert _round_trip(state).frame_state_fresh is False


def test_round_trip_preserves_source_order():
    names = [f"L['arg{i}']" for i in (5, 1, 9, 0, 3)]
    state = _state(**{name: SizeEntry(scalar=i) for i, name in enumerate(names)})
    assert list(_round_trip(state).automatic_dynamic) == names


def test_round_trip_preserves_the_envelope_fields():
    frame = FrameId("training_step", "/home/u/ünïcode/train.py", 4567)
    data = _encode(LocalState(extras={}), rank=2, world_size=5, frame=frame, seq=1234, sent_at=1_712_345_678.125)
    env = wire.decode(data, sender=2, max_bytes=1 << 20, expected_world_size=5)
    assert env.rank == 2
    assert env.world_size == 5
    assert env.frame == frame
    assert env.seq == 1234
    assert env.sent_at == 1_712_345_678.125
    assert env.package_version == __version__
    assert env.format_version == wire.FORMAT_VERSION


def test_format_version_is_the_first_item_of_the_envelope():
    assert msgpack.unpackb(_encode(LocalState(extras={})))[0] == wire.FORMAT_VERSION


def test_integer_sent_at_is_encoded_as_a_float():
    env = _decode(_encode(LocalState(extras={}), sent_at=1_700_000_000))
    assert type(env.sent_at) is float and env.sent_at == 1_700_000_000.0


def test_a_negative_scalar_is_a_valid_observation():
    assert _round_trip(_one(SizeEntry(scalar=-5))).automatic_dynamic["L['x']"].scalar == -5


def test_expected_world_size_is_optional():
    env = wire.decode(_encode(LocalState(extras={}), world_size=9), sender=SENDER, max_bytes=1 << 20)
    assert env.world_size == 9


def test_encoding_an_unencodable_atom_is_a_type_error():
    with pytest.raises(TypeError, match="cannot encode size atom"):
        _encode(_one(SizeEntry(scalar=3.5)))


# ---------------------------------------------------------------- extra fields


def test_registered_extra_field_round_trips_through_its_converters(field_registry):
    def from_wire(v):
        if type(v) is not list or not all(type(s) is str for s in v):
            raise TypeError("expected a list of strings")
        return frozenset(v)

    field_registry("graph_breaks", default=frozenset, to_wire=sorted, from_wire=from_wire)
    state = LocalState(automatic_dynamic={"L['x']": SizeEntry(scalar=1)})
    assert state.extras == {"graph_breaks": frozenset()}
    state.extras["graph_breaks"] = frozenset({"b.py:3", "a.py:1"})
    decoded = _round_trip(state)
    assert decoded.extras == {"graph_breaks": frozenset({"a.py:1", "b.py:3"})}
    assert decoded.automatic_dynamic == state.automatic_dynamic


def test_several_registered_extra_fields_round_trip(field_registry):
    field_registry("mode", default=lambda: "default")
    field_registry("weights", default=dict)
    state = LocalState()
    state.extras["weights"] = {"a": [1, 2.5, None, b"\x00", True]}
    assert _round_trip(state).extras == {"mode": "default", "weights": {"a": [1, 2.5, None, b"\x00", True]}}


def test_an_unknown_extra_field_from_a_peer_is_rejected(field_registry):
    field_registry("newer_field", default=lambda: 1)
    data = _encode(LocalState())  # the peer runs a version that has the field
    unregister_field("newer_field")  # this rank does not
    _rejects(data, match="unknown extra field 'newer_field'")


def test_a_missing_registered_extra_field_is_rejected(field_registry):
    data = _encode(LocalState())  # the peer does not know the field
    field_registry("newer_field", default=lambda: 1)
    _rejects(data, match="extra fields missing: ['newer_field']")


def test_an_extra_field_value_its_from_wire_refuses_is_rejected(field_registry):
    def positive(v):
        if type(v) is not int or v <= 0:
            raise ValueError(f"{v!r} is not a positive int")
        return v

    field_registry("budget", default=lambda: 1, from_wire=positive)
    obj = _envelope(LocalState())
    obj[STATE][2]["budget"] = -4
    _rejects(_pack(obj), match="extra field 'budget'")


def test_encoding_an_unregistered_extra_field_is_a_type_error():
    with pytest.raises(TypeError, match="not registered"):
        _encode(LocalState(extras={"nobody_registered_me": 1}))


def test_an_extra_field_map_with_a_non_string_key_is_rejected(field_registry):
    field_registry("f", default=lambda: 0)
    obj = _envelope(LocalState())
    obj[STATE][2] = {"f": 0, 1: 0}
    _rejects(_pack(obj))


# ---------------------------------------------------------------- malformed payloads


def _realistic_payload() -> bytes:
    return _encode(
        _state(
            **{
                "L['x']": SizeEntry(size=(DYNAMIC, 4), stride=(4, 1), excluded_sizes=(None, 4)),
                "L['n']": SizeEntry(scalar=DYNAMIC, size=DYNAMIC, stride=DYNAMIC, excluded_scalar=2),
                "L['y']": SizeEntry(size=(2, DYNAMIC), stride=(InferStride(1), 1)),
            }
        )
    )


def test_every_truncated_prefix_is_rejected_with_wire_format_error():
    data = _realistic_payload()
    assert _decode(data).rank == SENDER
    for cut in range(len(data)):
        try:
            _decode(data[:cut])
        except WireFormatError as e:
            assert f"rank {SENDER}" in str(e), (cut, str(e))
        else:
            pytest.fail(f"prefix of {cut}/{len(data)} bytes decoded")
        # any other exception type propagates and fails the test


def test_trailing_garbage_is_rejected():
    _rejects(_realistic_payload() + b"\x00", match="not valid msgpack")


def test_two_concatenated_payloads_are_rejected():
    data = _realistic_payload()
    _rejects(data + data)


def test_empty_input_is_rejected():
    _rejects(b"")


@pytest.mark.parametrize("data", ["a string", [1, 2], None, 17], ids=["str", "list", "none", "int"])
def test_input_that_is_not_bytes_is_rejected(data):
    _rejects(data, match="expected bytes")


def test_bytearray_and_memoryview_input_is_accepted():
    data = _realistic_payload()
    assert _decode(bytearray(data)) == _decode(data)
    assert _decode(memoryview(data)) == _decode(data)


@pytest.mark.parametrize(
    "envelope",
    [{"version": 1}, [], 1, "payload", None, b"\x01"],
    ids=["map", "empty-list", "int", "str", "nil", "bin"],
)
def test_an_envelope_that_is_not_a_non_empty_list_is_rejected(envelope):
    _rejects(_pack(envelope), match="envelope must be a non-empty list")


@pytest.mark.parametrize("length", [1, 7, 9])
def test_an_envelope_with_the_wrong_number_of_items_is_rejected(length):
    obj = _envelope()
    obj = (obj + [None, None])[:length]
    _rejects(_pack(obj))


WRONG_TYPES = [
    (VERSION, "1"),
    (VERSION, 1.0),
    (VERSION, None),
    (VERSION, True),
    (VERSION, [1]),
    (PACKAGE, 1),
    (PACKAGE, None),
    (PACKAGE, b"0.1.0"),
    (PACKAGE, "x" * 64),
    (RANK, str(SENDER)),
    (RANK, float(SENDER)),
    (RANK, None),
    (RANK, True),
    (RANK, -1),
    (WORLD_SIZE, str(WORLD)),
    (WORLD_SIZE, float(WORLD)),
    (WORLD_SIZE, 0),
    (WORLD_SIZE, None),
    (FRAME_POS, "forward"),
    (FRAME_POS, None),
    (FRAME_POS, ["forward", "model.py"]),
    (FRAME_POS, ["forward", "model.py", 1, 2]),
    (FRAME_POS, [1, "model.py", 1]),
    (FRAME_POS, ["forward", None, 1]),
    (FRAME_POS, ["forward", "model.py", "1"]),
    (FRAME_POS, ["forward", "model.py", -1]),
    (FRAME_POS, {"name": "forward"}),
    (SEQ, "7"),
    (SEQ, 7.0),
    (SEQ, None),
    (SEQ, -1),
    (SEQ, False),
    (SENT_AT, 1_700_000_000),
    (SENT_AT, "1700000000.0"),
    (SENT_AT, None),
    (STATE, None),
    (STATE, {}),
    (STATE, [[], True]),
    (STATE, [[], True, {}, None]),
    (STATE, [{}, True, {}]),
    (STATE, [[], 1, {}]),
    (STATE, [[], None, {}]),
    (STATE, [[], True, []]),
]


_POSITION_NAMES = ["version", "package", "rank", "world", "frame", "seq", "sent_at", "state"]


@pytest.mark.parametrize(
    "position,value", WRONG_TYPES, ids=[f"{_POSITION_NAMES[p]}={v!r}"[:40] for p, v in WRONG_TYPES]
)
def test_a_wrong_type_in_any_envelope_position_is_rejected(position, value):
    obj = _envelope()
    obj[position] = value
    _rejects(_pack(obj))


@pytest.mark.parametrize(
    "entries",
    [
        "L['x']",
        [["L['x']"]],
        [["L['x']", [1, None, None], "extra"]],
        [[1, [1, None, None]]],
        [["", [1, None, None]]],
        [[b"L['x']", [1, None, None]]],
        [["L['x']", None]],
        [["L['x']", [1, None]]],
        [["L['x']", [1, None, None, None, 1, 2]]],
        [["L['x']", [1, None, None, "bad", 1]]],
        [["L['x']", [1, None, None, None, None]]],
        [["L['x']", [1, None, None, None, 1.5]]],
        [["L['x']", [1.5, None, None]]],
        [["L['x']", [True, None, None]]],
        [["L['x']", [[1], None, None]]],
        [["L['x']", [1, True, None]]],
        [["L['x']", [1, "2,3", None]]],
        [["L['x']", [1, [2.0], None]]],
        [["L['x']", [1, None, [[1, 2]]]]],
        [["L['x']", [1, None, [[]]]]],
        [["L['x']", [1, None, [["0"]]]]],
        [["L['x']", [1, None, [{}]]]],
    ],
    ids=lambda e: repr(e)[:60],
)
def test_a_malformed_entry_is_rejected(entries):
    obj = _envelope()
    obj[STATE][0] = entries
    _rejects(_pack(obj))


def test_more_than_64_dims_is_rejected():
    data = _encode(_one(SizeEntry(size=(1,) * 65, stride=(1,) * 65)))
    _rejects(data, match="65 dims")


def test_64_dims_is_accepted():
    entry = SizeEntry(size=(1,) * 64, stride=(1,) * 64)
    assert _round_trip(_one(entry)).automatic_dynamic["L['x']"] == entry


def test_an_unknown_newer_format_version_names_the_sender_and_both_versions():
    obj = _envelope()
    obj[VERSION] = wire.FORMAT_VERSION + 1
    obj[PACKAGE] = "9.9.9"
    err = _rejects(_pack(obj))
    message = str(err)
    assert f"version {wire.FORMAT_VERSION + 1} (package 9.9.9)" in message
    assert f"version {wire.FORMAT_VERSION} (package {__version__})" in message


def test_the_format_version_is_checked_before_the_rest_of_a_newer_envelope():
    newer = [wire.FORMAT_VERSION + 1, "2.0.0", {"a": "completely different layout"}]
    err = _rejects(_pack(newer))
    assert f"version {wire.FORMAT_VERSION + 1}" in str(err)
    assert "8 items" not in str(err)


def test_an_older_format_version_is_rejected():
    obj = _envelope()
    obj[VERSION] = 0
    _rejects(_pack(obj), match="wire format version 0")


def test_a_payload_claiming_another_sender_rank_is_rejected():
    data = _encode(LocalState(extras={}), rank=1)
    err = _rejects(data, sender=SENDER, match="claims to come from rank 1")
    assert err.ranks == (SENDER,)


def test_a_world_size_mismatch_is_rejected():
    data = _encode(LocalState(extras={}), world_size=WORLD + 1)
    _rejects(data, match=f"world size {WORLD + 1}, expected {WORLD}")


def test_an_oversized_payload_is_rejected_before_parsing(monkeypatch):
    data = _realistic_payload()

    def must_not_parse(*args, **kwargs):
        raise AssertionError("decode parsed a payload over max_bytes")

    monkeypatch.setattr(msgpack, "unpackb", must_not_parse)
    _rejects(data, max_bytes=len(data) - 1, match=f"{len(data)} bytes exceeds the limit of {len(data) - 1}")


def test_a_payload_of_exactly_max_bytes_is_accepted():
    data = _realistic_payload()
    assert _decode(data, max_bytes=len(data)).rank == SENDER


def test_duplicate_source_names_are_rejected():
    obj = _envelope()
    entry = obj[STATE][0][0]
    obj[STATE][0] = [entry, ["L['y']", [1, None, None]], entry]
    _rejects(_pack(obj), match="source \"L['x']\" appears twice")


NEGATIVE = [
    ("size dim", lambda e: e.__setitem__(1, [2, -3])),
    ("stride dim", lambda e: e.__setitem__(2, [-3, 1])),
    ("infer stride dim", lambda e: e.__setitem__(2, [[-1], 1])),
    ("excluded size", lambda e: e.append([None, -2])),
]


@pytest.mark.parametrize("corrupt", [c for _, c in NEGATIVE], ids=[n for n, _ in NEGATIVE])
def test_negative_sizes_are_rejected(corrupt):
    obj = _envelope()
    corrupt(obj[STATE][0][0][1])
    _rejects(_pack(obj))


def _set_path(obj, path, value):
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


ENTRY = (STATE, 0, 0, 1)  # path of the first entry in the envelope tree
OUT_OF_RANGE = [
    ("scalar", ENTRY + (0,), INT64_MAX + 1),
    ("scalar uint64 max", ENTRY + (0,), 2**64 - 1),
    ("size dim", ENTRY + (1, 0), INT64_MAX + 1),
    ("stride dim", ENTRY + (2, 0), 2**64 - 1),
    ("rank", (RANK,), INT64_MAX + 1),
    ("world size", (WORLD_SIZE,), INT64_MAX + 1),
    ("seq", (SEQ,), INT64_MAX + 1),
    ("frame line", (FRAME_POS, 2), 2**64 - 1),
    ("format version", (VERSION,), 2**64 - 1),
]


@pytest.mark.parametrize("path,value", [(p, v) for _, p, v in OUT_OF_RANGE], ids=[n for n, _, _ in OUT_OF_RANGE])
def test_ints_out_of_int64_range_are_rejected(path, value):
    obj = _envelope()
    _set_path(obj, path, value)
    _rejects(_pack(obj))


@pytest.mark.parametrize("value", [INT64_MAX + 1, 2**64 - 1], ids=["int64max+1", "uint64max"])
def test_excluded_scalar_out_of_int64_range_is_rejected(value):
    obj = _envelope()
    obj[STATE][0][0][1][3:] = [None, value]
    _rejects(_pack(obj))


def test_invalid_utf8_in_a_string_is_rejected():
    data = _encode(_one(SizeEntry(scalar=1)))
    assert data.count(b"L['x']") == 1
    _rejects(data.replace(b"L['x']", b"L['\xff']"), match="not valid msgpack")


def test_a_deeply_nested_value_is_rejected_with_wire_format_error():
    # As deep as msgpack itself accepts (its limit counts the envelope's own
    # levels), as the scalar of an entry: too deep for Python's repr(), which
    # error messages use, yet the rejection must still be a WireFormatError.
    obj = _envelope()
    marker = 987654321
    obj[STATE][0][0][1][0] = marker
    template = _pack(obj)
    for depth in range(1100, 900, -1):
        data = template.replace(_pack(marker), b"\x91" * depth + b"\x01")
        try:
            msgpack.unpackb(data)
        except ValueError:
            continue
        break
    assert depth > 1000, depth
    _rejects(data)


def test_a_map_with_a_non_string_key_is_rejected():
    obj = _envelope()
    obj[STATE][2] = {1: "x"}
    _rejects(_pack(obj), match="not valid msgpack")


# ------------------------------------------------------------ ExtType and Timestamp


EXT = msgpack.ExtType(42, b"\x00\x01")
TIMESTAMP = msgpack.Timestamp(1_700_000_000, 0)  # msgpack's built-in ext type -1

EXT_PATHS = [
    ("version", (VERSION,)),
    ("package", (PACKAGE,)),
    ("rank", (RANK,)),
    ("world size", (WORLD_SIZE,)),
    ("frame", (FRAME_POS,)),
    ("frame name", (FRAME_POS, 0)),
    ("frame line", (FRAME_POS, 2)),
    ("seq", (SEQ,)),
    ("sent_at", (SENT_AT,)),
    ("state", (STATE,)),
    ("entries", (STATE, 0)),
    ("entry pair", (STATE, 0, 0)),
    ("source name", (STATE, 0, 0, 0)),
    ("entry", ENTRY),
    ("scalar", ENTRY + (0,)),
    ("size", ENTRY + (1,)),
    ("size dim", ENTRY + (1, 0)),
    ("stride", ENTRY + (2,)),
    ("stride dim", ENTRY + (2, 1)),
    ("frame_state_fresh", (STATE, 1)),
    ("extras", (STATE, 2)),
    ("extra field value", (STATE, 2, "note")),
    ("inside an extra field value", (STATE, 2, "note", 1)),
    ("inside a map in an extra field value", (STATE, 2, "note", 2, "k")),
]


@pytest.mark.parametrize("ext", [EXT, TIMESTAMP], ids=["ext42", "timestamp"])
@pytest.mark.parametrize("path", [p for _, p in EXT_PATHS], ids=[n for n, _ in EXT_PATHS])
def test_a_msgpack_ext_type_anywhere_is_rejected(field_registry, path, ext):
    # "note" has the most permissive possible from_wire (the identity): the
    # wire layer itself must refuse non-native values.
    field_registry("note", default=lambda: ["a", 0, {"k": "v"}])
    obj = _envelope(LocalState(automatic_dynamic={"L['x']": SizeEntry(scalar=5, size=(2, 3), stride=(3, 1))}))
    _set_path(obj, path, ext)
    _rejects(_pack(obj))


@pytest.mark.parametrize("ext", [EXT, TIMESTAMP], ids=["ext42", "timestamp"])
def test_a_payload_that_is_just_an_ext_type_is_rejected(ext):
    _rejects(_pack(ext))


# ---------------------------------------------------------------- pickle


class _RunsShellWhenUnpickled:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_a_pickle_crafted_to_run_code_is_rejected_and_runs_nothing(tmp_path, protocol):
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_RunsShellWhenUnpickled(str(marker)), protocol=protocol)
    _rejects(payload)
    assert not marker.exists(), "decoding a payload executed code"
    # Control: the payload really is live when unpickled.
    pickle.loads(payload)
    assert marker.exists()


# ---------------------------------------------------------------- size


def _realistic_model_state() -> LocalState:
    """~30 tensors of a transformer-ish module with long source names."""
    entries: dict[str, SizeEntry] = {}
    for layer in range(5):
        prefix = f"L['self']._modules['layers']._modules['{layer}']"
        entries[f"{prefix}._parameters['weight']"] = SizeEntry(size=(4096, 4096), stride=(4096, 1))
        entries[f"{prefix}._parameters['bias']"] = SizeEntry(size=(4096,), stride=(1,))
        entries[f"{prefix}._modules['norm']._parameters['weight']"] = SizeEntry(size=(4096,), stride=(1,))
        entries[f"{prefix}._modules['attn']._modules['qkv']._parameters['weight']"] = SizeEntry(
            size=(12288, 4096), stride=(4096, 1)
        )
        entries[f"{prefix}._modules['attn']._buffers['rope_cache']"] = SizeEntry(
            size=(DYNAMIC, 64), stride=(64, 1), excluded_sizes=(None, 64)
        )
        entries[f"{prefix}._modules['attn']._buffers['kv_cache']"] = SizeEntry(
            size=(8, DYNAMIC, 32, 128), stride=(DYNAMIC, InferStride(2), 128, 1)
        )
    entries["L['input_ids']"] = SizeEntry(size=(DYNAMIC, DYNAMIC), stride=(DYNAMIC, 1))
    entries["L['seq_len']"] = SizeEntry(scalar=DYNAMIC, size=DYNAMIC, stride=DYNAMIC, excluded_scalar=1)
    return LocalState(automatic_dynamic=entries, frame_state_fresh=False, extras={})


def test_encoded_size_is_smaller_than_pickle_of_the_torch_frame_state():
    state = _realistic_model_state()
    assert len(state.automatic_dynamic) == 32
    ours = len(_encode(state))
    torch_state = {name: dynamo.entry_to_torch(e) for name, e in state.automatic_dynamic.items()}
    theirs = len(pickle.dumps(torch_state, protocol=pickle.HIGHEST_PROTOCOL))
    assert ours < theirs, (ours, theirs)


def test_the_realistic_model_state_round_trips():
    state = _realistic_model_state()
    decoded = _round_trip(state)
    assert decoded == state
    assert list(decoded.automatic_dynamic) == list(state.automatic_dynamic)


# ---------------------------------------------------------------- property tests

_any_int64 = st.integers(INT64_MIN, INT64_MAX)
_dim = st.one_of(st.integers(0, 2**16), st.integers(0, INT64_MAX), st.just(DYNAMIC))
_stride_dim = st.one_of(_dim, st.builds(InferStride, st.integers(0, 63)))
_whole = st.sampled_from([DYNAMIC, UNSET])
size_entries = st.builds(
    SizeEntry,
    scalar=st.one_of(_any_int64, _whole),
    size=st.one_of(_whole, st.lists(_dim, max_size=6).map(tuple)),
    stride=st.one_of(_whole, st.lists(_stride_dim, max_size=6).map(tuple)),
    excluded_sizes=st.one_of(
        st.none(), st.lists(st.one_of(st.none(), st.integers(0, INT64_MAX)), max_size=6).map(tuple)
    ),
    excluded_scalar=st.one_of(st.none(), _any_int64),
)
local_states = st.builds(
    LocalState,
    automatic_dynamic=st.dictionaries(st.text(min_size=1, max_size=60), size_entries, max_size=6),
    frame_state_fresh=st.booleans(),
    extras=st.just({}),
)


@settings(max_examples=200, deadline=None)
@given(
    state=local_states,
    world=st.integers(1, 4096),
    data=st.data(),
    seq=st.integers(0, INT64_MAX),
    sent_at=st.floats(allow_nan=False),
    name=st.text(max_size=40),
    filename=st.text(max_size=80),
    line=st.integers(0, INT64_MAX),
)
def test_random_local_states_round_trip_exactly(state, world, data, seq, sent_at, name, filename, line):
    rank = data.draw(st.integers(0, world - 1), label="rank")
    frame = FrameId(name, filename, line)
    payload = wire.encode(state, rank=rank, world_size=world, frame=frame, seq=seq, sent_at=sent_at)
    env = wire.decode(payload, sender=rank, max_bytes=len(payload), expected_world_size=world)
    assert env.state == state
    assert list(env.state.automatic_dynamic) == list(state.automatic_dynamic)
    assert (env.rank, env.world_size, env.frame, env.seq, env.sent_at) == (rank, world, frame, seq, sent_at)


def _decodes_or_wire_format_error(data: bytes, sender: int) -> None:
    try:
        env = wire.decode(data, sender=sender, max_bytes=1 << 20)
    except WireFormatError as e:
        assert f"rank {sender}" in str(e)
        assert e.ranks == (sender,)
    else:
        assert isinstance(env, wire.Envelope)
        assert env.rank == sender
        assert isinstance(env.state, LocalState)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=512), sender=st.integers(0, 7))
def test_random_bytes_decode_or_raise_wire_format_error(data, sender):
    _decodes_or_wire_format_error(data, sender)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(
        st.tuples(st.integers(0, 10_000), st.integers(0, 255), st.sampled_from("rid")), min_size=1, max_size=6
    )
)
def test_mutated_valid_payloads_decode_or_raise_wire_format_error(edits):
    # Random bytes rarely parse as msgpack at all; single-byte edits of a valid
    # payload reach the validation of every field.
    data = bytearray(_realistic_payload())
    for pos, byte, op in edits:
        pos %= len(data) + 1
        if op == "r" and pos < len(data):
            data[pos] = byte
        elif op == "i":
            data.insert(pos, byte)
        elif op == "d" and pos < len(data):
            del data[pos]
    _decodes_or_wire_format_error(bytes(data), SENDER)


_msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(INT64_MIN, 2**64 - 1),
        st.floats(),
        st.text(max_size=10),
        st.binary(max_size=10),
        st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=5), children, max_size=4),
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(path_index=st.integers(0, len(EXT_PATHS) - 1), value=_msgpack_values)
def test_any_msgpack_value_in_any_position_decodes_or_raises_wire_format_error(path_index, value):
    register_field("note", default=lambda: ["a", 0, {"k": "v"}])
    try:
        obj = _envelope(LocalState(automatic_dynamic={"L['x']": SizeEntry(scalar=5, size=(2, 3), stride=(3, 1))}))
        _set_path(obj, EXT_PATHS[path_index][1], value)
        _decodes_or_wire_format_error(_pack(obj), SENDER)
    finally:
        unregister_field("note")


# ---------------------------------------------------------------- front-coded names

_LONG_NAMES = [f"L['self']._modules['layers']._modules['{i}']._parameters['weight']" for i in range(12)]


def test_names_sharing_long_prefixes_are_front_coded_and_round_trip_in_order():
    state = LocalState(
        automatic_dynamic={n: SizeEntry(scalar=DYNAMIC, size=(64, 64), stride=(64, 1)) for n in _LONG_NAMES},
        extras={},
    )
    raw_entries = _envelope(state)[7][0]
    assert raw_entries[0][0] == _LONG_NAMES[0]  # the first name is sent whole
    assert all(type(pair[0]) is list for pair in raw_entries[1:])
    assert list(_round_trip(state).automatic_dynamic) == _LONG_NAMES
    plain = sum(len(n) for n in _LONG_NAMES)
    assert len(_encode(state)) < plain  # the whole payload, entries included, beats the bare names


def test_a_front_coded_name_reaching_past_the_previous_name_is_rejected():
    env = _envelope(_state(**{"a": SizeEntry(scalar=1, size=DYNAMIC, stride=DYNAMIC)}))
    env[7][0].append([[5, "bc"], [2, None, None]])  # previous name "a" has 1 character
    _rejects(_pack(env), match="front-coded name")


def test_a_front_coded_first_name_must_be_empty_prefixed():
    env = _envelope()
    env[7][0][0][0] = [1, "x"]
    _rejects(_pack(env), match="front-coded name")


# ------------------------------------------------ recompile-reason payloads


def _reasons(*, rank: int = SENDER, seq: int = 5, missed: bool = True, reasons=("0/0: tensor 'x' size mismatch",)):
    return wire.encode_reasons(rank=rank, world_size=WORLD, seq=seq, missed=missed, reasons=list(reasons))


def _decode_reasons(data: bytes, *, sender: int = SENDER) -> wire.ReasonsEnvelope:
    return wire.decode_reasons(data, sender=sender, max_bytes=1 << 20, expected_world_size=WORLD)


def _rejects_reasons(data: bytes, match: str | None = None) -> None:
    with pytest.raises(WireFormatError, match=match) as info:
        _decode_reasons(data)
    assert f"from rank {SENDER}" in str(info.value)
    assert info.value.ranks == (SENDER,)


def test_recompile_reasons_round_trip():
    got = _decode_reasons(_reasons(reasons=["a", "b\nc"]))
    assert (got.rank, got.world_size, got.seq, got.missed, got.reasons) == (SENDER, WORLD, 5, True, ["a", "b\nc"])


def test_a_rank_that_hit_sends_no_reasons_and_one_that_claims_both_is_rejected():
    assert _decode_reasons(_reasons(missed=False, reasons=())).reasons == []
    bad = msgpack.packb([wire.REASONS_FORMAT_VERSION, wire.REASONS_TAG, SENDER, WORLD, 5, False, ["x"]])
    _rejects_reasons(bad, "hit sent reasons")


def test_the_sender_cuts_reasons_to_the_limits_the_receiver_enforces():
    long = "x" * (wire.MAX_REASON_CHARS + 10)
    got = _decode_reasons(_reasons(reasons=[long] * (wire.MAX_REASONS + 3)))
    assert len(got.reasons) == wire.MAX_REASONS and all(len(r) == wire.MAX_REASON_CHARS for r in got.reasons)
    bad = msgpack.packb([wire.REASONS_FORMAT_VERSION, wire.REASONS_TAG, SENDER, WORLD, 5, True, [long]])
    _rejects_reasons(bad, "at most")


def test_a_recompile_reason_payload_of_another_version_names_both_versions():
    bad = msgpack.packb([wire.REASONS_FORMAT_VERSION + 1, wire.REASONS_TAG, SENDER, WORLD, 5, True, []])
    _rejects_reasons(bad, f"version {wire.REASONS_FORMAT_VERSION + 1}.*speaks version {wire.REASONS_FORMAT_VERSION}")


@pytest.mark.parametrize(
    "position, value",
    [
        (1, "compiler_collective"),
        (2, SENDER + 1),
        (3, WORLD + 1),
        (4, -1),
        (5, 1),
        (6, "reason"),
        (6, [b"bytes"]),
    ],
)
def test_a_wrong_value_in_any_recompile_reason_position_is_rejected(position, value):
    items = [wire.REASONS_FORMAT_VERSION, wire.REASONS_TAG, SENDER, WORLD, 5, True, ["r"]]
    items[position] = value
    _rejects_reasons(msgpack.packb(items, use_bin_type=True))


def test_every_truncated_recompile_reason_payload_is_rejected():
    data = _reasons()
    for n in range(len(data)):
        _rejects_reasons(data[:n])


def test_a_msgpack_ext_type_in_the_reasons_is_rejected():
    items = [wire.REASONS_FORMAT_VERSION, wire.REASONS_TAG, SENDER, WORLD, 5, True, [msgpack.ExtType(1, b"x")]]
    _rejects_reasons(msgpack.packb(items))
