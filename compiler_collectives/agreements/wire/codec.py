"""msgpack in and out for every wire format: ``pack``, the bounded ``Reader``, and the checks
and the one failure builder that the format modules share.

Nothing here ever unpickles anything, and nothing reads a peer's payload but ``Reader``.

**Bounded decoding.** Every rank decodes every rank's payload, so a payload must not be able to
cost more than a small multiple of its own size. A decoder opens the payload with ``reading``,
which refuses anything but bytes, and more bytes than the format allows, before a byte is
parsed; it then reads one value at a time. The parts whose shape a format fixes are read header
first (``Reader.array``, ``Reader.scalar``), so a list of the wrong length, or a container where
a single value belongs, is refused before anything in it is built. msgpack's own limits cap each
string, binary, array and map at the payload's size; everything built generically
(``Reader.value``: the frame, extras, audit bodies, reasons) is charged to a budget of estimated
memory (``DECODED_BYTES_PER_BYTE`` times the payload, plus ``DECODE_SLACK``); and front-coded
source names, which can legitimately expand, share a budget of ``NAME_CHARS_PER_BYTE``
characters per payload byte. A payload over any of them is refused before the excess is
allocated.

**Failures.** A check that fails (``expect``, ``reject``, or the reader itself) ends the
``reading`` block with the ``WireFormatError`` that the decoder's ``failure(...)`` builds,
naming the sender: never a KeyError, TypeError or msgpack error.
"""

from __future__ import annotations

import contextlib
import reprlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

# msgpack ships no type information (unused-ignore: for when the project's mypy config ignores it).
import msgpack  # type: ignore[import-untyped, unused-ignore]

from ...errors import MalformedPayload, WireFormatError
from ...version import __version__

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

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


def pack(value: Any) -> bytes:
    """``value`` (msgpack-native data) as msgpack: str as str, bytes as bin."""
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


# ---------------------------------------------------------------- checks


_short_repr = reprlib.Repr()
_short_repr.maxlevel = 3
_short_repr.maxstring = 80
_short_repr.maxother = 80


def show(v: Any) -> str:
    """A bounded repr of a peer's value, for messages: a plain repr() of a deeply nested value
    raises RecursionError, and of a huge one is huge."""
    return _short_repr.repr(v)


_NATIVE_LEAVES = (type(None), bool, int, float, str, bytes)


def is_native(v: Any) -> bool:
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


def expect(cond: bool, what: str) -> None:
    """Refuse the payload, saying ``what`` is wrong, unless ``cond``."""
    if not cond:
        raise MalformedPayload(what)


def reject(what: str) -> NoReturn:
    """Refuse the payload, saying ``what`` is wrong."""
    raise MalformedPayload(what)


def int_in(v: Any, what: str, *, lo: int = INT64_MIN) -> int:
    """``v``, which must be an int from ``lo`` to the int64 maximum."""
    expect(type(v) is int and lo <= v <= INT64_MAX, f"{what} must be an int in range, got {show(v)}")
    number: int = v
    return number


def version_in(version: Any, package: Callable[[], Any], what: str, speaks: int) -> int:
    """The format version, which must be ``speaks``; ``package()`` reads the sender's package
    version, only for the message."""
    expect(type(version) is int, f"format version must be an int, got {show(version)}")
    if version != speaks:
        pkg = package()
        reject(
            f"{what} version {version}{f' (package {pkg})' if type(pkg) is str else ''}, "
            "this rank speaks version "
            f"{speaks} (package {__version__}); install the same compiler_collectives "
            "version on every rank"
        )
    checked: int = version
    return checked


def sender_and_world(rank: Any, sender: int, world: Any, expected_world_size: int | None) -> None:
    """The sender rank a payload claims (it must be the rank it came from) and its world size."""
    int_in(rank, "sender rank", lo=0)
    expect(rank == sender, f"payload claims to come from rank {rank}")
    int_in(world, "world size", lo=1)
    if expected_world_size is not None:
        expect(world == expected_world_size, f"world size {world}, expected {expected_world_size}")


def versioned_list(r: Reader, version: int, what: str, items: int) -> list[Any]:
    """A payload that is a list of ``items`` values, the first being the format ``version``
    (checked before anything else is read); the whole payload, read to its end."""
    if not r.array_next():
        r.value()
        reject("payload must be a non-empty list")
    n = r.array("payload")
    expect(n > 0, "payload must be a non-empty list")
    version_in(r.scalar("format version"), lambda: None, what, version)
    expect(n == items, f"payload must have {items} items, got {n}")
    obj = [version] + [r.value() for _ in range(items - 1)]
    r.end()
    return obj


def failure(payload: str, kind: str, sender: int, versions: str) -> Callable[[str], WireFormatError]:
    """How a decoder of ``payload`` payloads names what is wrong with the one ``sender`` sent
    (``kind`` is the error's kind; ``versions`` what every rank must run alike)."""
    same = "it does" if versions.endswith("version") else "they do"

    def fail(why: str) -> WireFormatError:
        return WireFormatError(
            f"bad {payload} payload from rank {sender}: {why}. Check that every rank runs the same "
            f"{versions}; if {same}, this is a bug or a corrupted transport.",
            kind=kind,
            ranks=(sender,),
        )

    return fail


# ---------------------------------------------------------------- the reader

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


class Reader:
    """A peer's payload read one value at a time, within the limits above (see the module
    docstring); made by ``reading``, which turns each refusal into the decoder's error.

    ``array`` and ``scalar`` read the parts whose shape the format fixes, header first;
    ``value`` builds anything else, within the budget."""

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
            reject(f"it decodes to more than {DECODED_BYTES_PER_BYTE} bytes of Python objects per payload byte")

    def charge_name(self, chars: int) -> None:
        """Charge ``chars`` characters of source names to the name budget."""
        self._names_left -= chars
        if self._names_left < 0:
            reject(
                f"its source names decode to more than {NAME_CHARS_PER_BYTE} characters per "
                "payload byte (front-coded names each repeating a long prefix)"
            )

    def _next(self) -> int | None:
        at: int = self._up.tell()
        return self._data[at] if at < len(self._data) else None

    def array_next(self) -> bool:
        """Whether the next value is an array (from its first byte)."""
        return self._next() in _ARRAY_FIRST

    def container_next(self) -> bool:
        """Whether the next value is an array or a map (from its first byte)."""
        first = self._next()
        return first in _ARRAY_FIRST or first in _MAP_FIRST

    def _read(self, step: Callable[[], Any]) -> Any:
        """``step()``, one call into msgpack; whatever msgpack raises refuses the payload."""
        try:
            return step()
        except MalformedPayload:  # a budget ran out in a hook
            raise
        # msgpack documents that unpacking raises more than its own UnpackException types
        # (ValueError, TypeError, ...) and advises catching Exception; each means bad bytes.
        except Exception as e:  # noqa: BLE001
            raise MalformedPayload(f"not valid msgpack ({type(e).__name__}: {e})") from None

    def skip(self) -> None:
        """Past the next value, building nothing (its msgpack still checked)."""
        self._read(self._up.skip)

    def value(self) -> Any:
        """The next value, whatever it is, charged to the budget as it is built.

        msgpack's C decoder builds it, calling back for each list and map once built
        (with its items); no single list or map may hold more items than the budget left
        could pay for, so what is built beyond the budget is at most that budget again."""
        start: int = self._up.tell()
        self.skip()  # its extent, nothing built
        raw = self._data[start : self._up.tell()]
        longest = max(self._left // 72, 16)  # 72: the most one item of a list can cost
        v = self._read(
            lambda: msgpack.unpackb(
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
        )
        self._charge(_cost(v))
        return v

    def _list(self, items: list[Any]) -> list[Any]:
        self._charge(56 + 8 * len(items) + sum(map(_cost, items)))
        return items

    def _map(self, items: dict[Any, Any]) -> dict[Any, Any]:
        self._charge(64 + 48 * len(items) + sum(map(_cost, items.keys())) + sum(map(_cost, items.values())))
        return items

    def scalar(self, what: str) -> Any:
        """The next value, which must not be a list or map (checked before it is built)."""
        expect(not self.container_next(), f"{what}: a list or map where a single value belongs")
        return self.value()

    def array(self, what: str, lo: int = 0, hi: int | None = None) -> int:
        """The next value's length, which must be an array of lo..hi items (from its header)."""
        if not self.array_next():
            self.value()  # invalid msgpack says so; anything else is the wrong type
            reject(f"{what} must be a list")
        n: int = self._read(self._up.read_array_header)
        if hi is None:
            expect(lo <= n, f"{what} must have at least {lo} item(s)")
        else:
            expect(lo <= n <= hi, f"{what} must be a list of {lo if lo == hi else f'{lo} to {hi}'} items, got {n}")
        return n

    def end(self) -> None:
        """The payload must end here."""
        expect(
            self._up.tell() == len(self._data),
            f"not valid msgpack ({len(self._data) - self._up.tell()} bytes of extra data after the envelope)",
        )


def packed_array(items: Sequence[bytes]) -> bytes:
    """A msgpack array of ``items``, each already one packed value (``pack``'s)."""
    n = len(items)
    head = (
        bytes([0x90 | n])
        if n < 16
        else (b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big"))
    )
    return head + b"".join(items)


def values_of(packed: Sequence[bytes], fail_for: Callable[[int], Callable[[str], WireFormatError]]) -> list[Any]:
    """The value in each of ``packed`` (peers' bytes, each to be exactly one msgpack value); a
    refusal of ``packed[j]`` raises ``fail_for(j)(why)``, naming whoever sent it.

    Decoded as one array where each item re-packs to its own bytes (what ``pack`` wrote: so each
    item is exactly its bytes' one value), within the bounded reader's budget of the whole; any
    other bytes are read one by one, for an exact refusal."""
    whole = packed_array(packed)
    try:
        with reading(whole, len(whole), failure("packed", "packed", -1, "version")) as r:
            items = r.value()
            r.end()
        if type(items) is list and len(items) == len(packed) and all(map(bytes.__eq__, map(pack, items), packed)):
            return items
    except WireFormatError:
        pass
    out = []
    for j, data in enumerate(packed):
        with reading(data, len(data), fail_for(j)) as r:
            out.append(r.value())
            r.end()
    return out


@contextlib.contextmanager
def reading(
    data: Any,
    max_bytes: int,
    fail: Callable[[str], WireFormatError],
    limit: str = "COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES",
) -> Iterator[Reader]:
    """A bounded reader of a peer's bytes (never pickle), for a ``with`` block whose refusals
    raise ``fail(why)``; bytes over ``max_bytes`` (``limit`` says whose limit) are refused
    before any is parsed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise fail(f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise fail(f"{len(data)} bytes exceeds the limit of {max_bytes} ({limit})")
    try:
        yield Reader(bytes(data))
    except MalformedPayload as e:
        raise fail(str(e)) from None
