"""The setup record: what each rank posts on the c10d store at a generation's first rendezvous
(``setup/<rank>``), for the setup check (``agreements/setup.py``) to compare.

Layout (``SETUP_FORMAT``, now 1)::

    [SETUP_FORMAT, sender_rank, [[item, value], ...]]

An item is the name messages show (``"torch version"``, an environment variable's name, ...),
a string of at most ``MAX_TEXT`` characters, named once; a value is nil, a bool, an int, a
float or a string of at most ``MAX_TEXT`` characters. A record holds at most ``MAX_ITEMS``
items and ``MAX_SETUP_BYTES`` bytes.

Version rule: ``SETUP_FORMAT`` comes first and any change to the layout bumps it. Unlike a
payload's, another format is not an error here: ``decode_setup`` returns that format and no
items, and the setup check names "setup record format" as the difference, with each rank's
format, so ranks of different releases are told what differs instead of failing to read each
other. A malformed record is a ``WireFormatError`` naming the sender (the setup check shows it
as that rank's "readable setup record" item).
"""

from __future__ import annotations

from typing import Any

from .codec import expect, failure, int_in, pack, reading, show

SETUP_FORMAT = 1
MAX_SETUP_BYTES = 64 * 1024
MAX_ITEMS = 512
MAX_TEXT = 512

SetupRecord = tuple[int, dict[str, Any]]
"""A decoded record: (format, items by name); no items when the format is not ours."""

_VALUE_TYPES = (type(None), bool, int, float, str)


def encode_setup(rank: int, record: dict[str, Any]) -> bytes:
    """This rank's record (``record``: item name -> value) as it goes on the store."""
    return pack([SETUP_FORMAT, rank, [[k, v] for k, v in record.items()]])


def decode_setup(data: bytes, *, sender: int, max_bytes: int = MAX_SETUP_BYTES) -> SetupRecord:
    """(format, items) of the record ``sender`` posted; raise ``WireFormatError`` naming the sender
    on anything malformed. A record of another format gives that format and no items."""
    fail = failure("setup-record", "setup", sender, "compiler_collectives version")
    with reading(data, max_bytes, fail, limit="a setup record's") as r:
        n = r.array("record [format, rank, items]", 1)
        version = r.scalar("setup record format")
        expect(type(version) is int, f"setup record format must be an int, got {show(version)}")
        if version != SETUP_FORMAT:
            for _ in range(n - 1):
                r.skip()  # another release's layout: only its format is compared
            r.end()
            return version, {}
        expect(n == 3, f"record must be [format, rank, items], got {n} items")
        rank = int_in(r.scalar("sender rank"), "sender rank", lo=0)
        expect(rank == sender, f"record claims to come from rank {rank}")
        count = r.array("items", 0, MAX_ITEMS)
        items: dict[str, Any] = {}
        for i in range(count):
            r.array(f"items[{i}] [name, value]", 2, 2)
            name = r.scalar(f"items[{i}] name")
            expect(
                type(name) is str and len(name) <= MAX_TEXT,
                f"items[{i}] name must be a string of at most {MAX_TEXT} characters, got {show(name)}",
            )
            expect(name not in items, f"item {name!r} appears twice")
            value = r.scalar(f"item {name!r}")
            expect(
                type(value) in _VALUE_TYPES and not (type(value) is str and len(value) > MAX_TEXT),
                f"item {name!r} must be nil, a bool, an int, a float or a string of at most {MAX_TEXT} "
                f"characters, got {type(value).__name__}",
            )
            items[name] = value
        r.end()
    return version, items
