"""The scope's rules without a rank (issue 17): the scope variable gives each rank its stage
(consecutive or strided) and refuses a layout that cannot divide the world, and a malformed scope
verdict from the leader raises ``WireFormatError`` naming it. Pipeline stages scoped on live
ranks: ``tests/ranks/test_scope.py``.
"""

from __future__ import annotations

import msgpack
import pytest

from tests.fixtures import KeyStore


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("consecutive:2", {0: (0, 1, 2, 3), 5: (4, 5, 6, 7)}),
        ("strided:2", {0: (0, 2, 4, 6), 5: (1, 3, 5, 7)}),
        ("consecutive:4", {3: (2, 3), 6: (6, 7)}),
        ("strided:4", {3: (3, 7), 6: (2, 6)}),
    ],
)
def test_the_variable_gives_each_rank_its_stage(spec, expected):
    from compiler_collectives.transport.scope import from_setting

    for rank, ranks in expected.items():
        assert from_setting(spec, rank, 8).ranks == ranks


def test_a_variable_that_cannot_divide_the_world_is_refused():
    from compiler_collectives import ScopeError
    from compiler_collectives.transport.scope import from_setting

    with pytest.raises(ScopeError):
        from_setting("consecutive:3", 0, 8)


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


MALFORMED_VERDICTS = {
    "not msgpack": b"\xc1",
    "truncated": _pack(["setup", [0, 1]])[:-1],
    "one item": _pack(["ok"]),
    "a map": _pack({"ok": []}),
    "an unknown kind": _pack(["maybe", [1]]),
    "a kind that is not a string": _pack([1, []]),
    "ranks that are not a list": _pack(["absent", 1]),
    "a rank that is not an int": _pack(["overlap", [0, "1"]]),
    "an overlap of one rank": _pack(["overlap", [0]]),
    "an absent verdict naming no rank": _pack(["absent", []]),
    "a setup verdict naming one rank": _pack(["setup", [0]]),
    "a rank beyond the world": _pack(["absent", [7]]),
    "a rank named twice": _pack(["setup", [1, 1]]),
    "ranks in an ok verdict": _pack(["ok", [1]]),
    "extra data": _pack(["ok", []]) + b"\x00",
    "oversized": _pack(["absent", [1] * 1000]),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_VERDICTS))
def test_a_malformed_scope_verdict_raises_wire_format_error_naming_the_leader(case):
    from compiler_collectives.agreements import scope
    from compiler_collectives.errors import WireFormatError
    from compiler_collectives.transport.scope import Scope

    chosen = Scope((2, 3), "scope(test)")
    store = KeyStore(
        {
            "setup/2": _pack([1, 2, [[scope.SCOPE_ITEM, chosen.item()]]]),  # the leader's record
            f"setup/scope/{chosen.key}/verdict": MALFORMED_VERDICTS[case],
        }
    )
    with pytest.raises(WireFormatError) as caught:
        scope.agree(store, 3, 4, 5.0, chosen, {scope.SCOPE_ITEM: chosen.item()})
    assert caught.value.ranks == (2,), caught.value
    assert str(caught.value).startswith("bad scope-verdict payload from rank 2: "), caught.value
