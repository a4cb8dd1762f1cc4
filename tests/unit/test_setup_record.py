"""The setup record without a rank (issue 11): it holds every must-match setting and the versions,
a malformed record is refused by validation, naming its sender, and the setup check names an
unreadable record as a difference of its sender's, not a crash. Ranks that disagree about the
setup: ``tests/ranks/test_setup_agreement.py``.
"""

from __future__ import annotations

import msgpack
import pytest
import torch

from tests.fixtures import KeyStore


def test_the_setup_record_holds_every_must_match_setting_and_the_versions():
    import compiler_collectives
    from compiler_collectives import config
    from compiler_collectives.agreements import setup as setup_agreement

    record = setup_agreement.local_record({"transport protocol version": 2})
    for row in config.MUST_MATCH:
        assert row.env in record, row.env
    for row in config.SETTINGS_TABLE:
        if not row.must_match:
            assert row.env not in record, row.env
    assert record["compiler_collectives version"] == compiler_collectives.__version__
    assert record["torch version"] == torch.__version__
    assert record["transport protocol version"] == 2
    # The switches, as they are now (the seams register them).
    assert "TORCH_COMPILER_COLLECTIVES" in record
    assert "torch._dynamo.config.automatic_dynamic_shapes" in record


@pytest.mark.parametrize(
    "data",
    [
        b"\x80\x04K\x01.",  # a pickle
        b"\xc1",  # not msgpack
        b"\x93\x01\x00\x91\x92\x01\x02",  # an item named by an int
    ],
)
def test_a_malformed_setup_record_is_refused_by_validation(data):
    from compiler_collectives.agreements import wire
    from compiler_collectives.errors import WireFormatError

    with pytest.raises(WireFormatError):
        wire.decode_setup(data, sender=0)


MALFORMED_RECORDS = {
    "not msgpack": b"\xc1",
    "truncated": msgpack.packb([1, 3, [["torch version", "2.13.0"]]], use_bin_type=True)[:-3],
    "an item named by an int": msgpack.packb([1, 3, [[1, 2]]], use_bin_type=True),
    "a list as a value": msgpack.packb([1, 3, [["torch version", [2, 13]]]], use_bin_type=True),
    "an item named twice": msgpack.packb([1, 3, [["a", 1], ["a", 2]]], use_bin_type=True),
    "another sender": msgpack.packb([1, 2, []], use_bin_type=True),
    "a map": msgpack.packb({"format": 1}, use_bin_type=True),
    "extra data": msgpack.packb([1, 3, []], use_bin_type=True) + b"\x00",
    "too many items": msgpack.packb([1, 3, [[f"i{i}", i] for i in range(600)]], use_bin_type=True),
    "oversized": msgpack.packb([1, 3, [["x", "y" * 500]] * 200], use_bin_type=True),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_RECORDS))
def test_a_malformed_setup_record_raises_wire_format_error_naming_its_sender_and_the_check_names_it(case):
    from compiler_collectives.agreements import setup as setup_agreement
    from compiler_collectives.agreements import wire
    from compiler_collectives.errors import SetupMismatchError, WireFormatError

    data = MALFORMED_RECORDS[case]
    with pytest.raises(WireFormatError) as caught:
        wire.decode_setup(data, sender=3)
    assert caught.value.ranks == (3,), caught.value
    assert str(caught.value).startswith("bad setup-record payload from rank 3: "), caught.value
    # The setup check on rank 0 (rank 3 posted the record and counted itself as differing):
    # the unreadable record is a difference, named with its sender, not a crash.
    store = KeyStore(
        {
            "setup/1": msgpack.packb([1, 1, []], use_bin_type=True),
            "setup/2": msgpack.packb([1, 2, []], use_bin_type=True),
            "setup/3": data,
            "setup/arrived": b"3",
            "setup/mismatches": b"1",
            "setup/mismatch/1": b"3",
        }
    )
    with pytest.raises(SetupMismatchError) as mismatch:
        setup_agreement.agree(store, 0, 4, 5.0, {})
    assert mismatch.value.ranks == (3,)
    message = str(mismatch.value)
    assert "readable setup record: rank 0 (and every rank not named here): <not sent>; rank 3: " in message, message
    assert "no (bad setup-record payload from rank 3: " in message, message
