"""The program audit's pieces that need no rank (issue 13): the fingerprint of one graph (its
collectives, its hash, the user's source line) and the audit's wire format (a summary and its
details round trip, a malformed summary is rejected naming its sender, an audit payload meeting a
compiler payload is a desync). Ranks whose programs differ: ``tests/ranks/test_audit.py``.
"""

from __future__ import annotations

import pytest
import torch

# ---------------------------------------------------------------- the fingerprint of one graph


def _two_symbolic_inputs() -> tuple:
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda a, b: a.sum() + b.sum(), tracing_mode="symbolic")(torch.ones(5), torch.ones(7))
    return tuple(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder")


def _graph_reducing_second_input(first, second, *, device=None, scale=2):
    import torch.distributed._functional_collectives

    g = torch.fx.Graph()
    a = g.placeholder("a")
    a.meta["val"] = first
    b = g.placeholder("b")
    b.meta["val"] = second
    ones = g.call_function(torch.ones, (3,), {"device": device})
    scaled = g.call_function(torch.mul, (b, scale))
    scaled.meta["val"] = second
    reduced = g.call_function(torch.ops._c10d_functional.all_reduce.default, (scaled, "sum", "0"))
    reduced.meta["val"] = second
    waited = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
    g.output((waited, ones, a))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_symbols_are_named_in_order_of_first_use_so_differently_named_symbols_compare_equal():
    from compiler_collectives.agreements.fingerprint import fingerprint

    u, v = _two_symbolic_inputs()  # raw symbols, e.g. s75 and s57
    one = fingerprint(_graph_reducing_second_input(u, v), "aot_forward")
    other = fingerprint(_graph_reducing_second_input(v, u), "aot_forward")  # the raw names swapped
    assert [c.key() for c in one.collectives] == [c.key() for c in other.collectives]
    (c,) = one.collectives  # the wait is not a collective: it moves no data
    assert (c.op, c.reduce_op, c.tensors) == ("_c10d_functional.all_reduce.default", "sum", ("float32[s1]",))
    assert one.graph_hash == other.graph_hash


def test_a_device_index_is_left_out_of_the_graph_hash_but_a_constant_is_not():
    from compiler_collectives.agreements.fingerprint import fingerprint

    u, v = _two_symbolic_inputs()
    on = lambda **kw: fingerprint(_graph_reducing_second_input(u, v, **kw), "dynamo").graph_hash  # noqa: E731
    assert on(device=torch.device("cuda", 0)) == on(device=torch.device("cuda", 1))
    assert on(scale=2) != on(scale=3)


def test_the_source_line_is_the_innermost_frame_outside_torch():
    from compiler_collectives.agreements.fingerprint import user_line

    torch_file = torch.__file__.replace("__init__.py", "distributed/_functional_collectives.py")
    trace = (
        '  File "/job/train.py", line 20, in step\n    y = funcol.all_reduce(x, "sum", group)\n'
        "        ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        f'  File "{torch_file}", line 179, in all_reduce\n    tensor = torch.ops._c10d_functional.all_reduce(\n'
    )
    assert user_line(trace) == '/job/train.py:20 in step: y = funcol.all_reduce(x, "sum", group)'
    assert user_line(None) == ""


# ---------------------------------------------------------------- the audit's wire format


def _summary(**overrides):
    from compiler_collectives.agreements import wire

    body = wire.AuditSummary(
        phase="forward",
        failure=None,
        levels=[wire.AuditLevel("dynamo", 1, 2, b"\x01" * 8, b"\x02" * 8)],
        graph_break="train.py:18 (print)",
    )
    for key, value in overrides.items():
        setattr(body, key, value)
    return body


def _audit_bytes(body, rank=1):
    from compiler_collectives.agreements import wire
    from compiler_collectives.observations import FrameId

    return wire.encode_audit(body, rank=rank, world_size=2, frame=FrameId("f", "/a/b.py", 3), seq=4, sent_at=1.5)


def test_audit_summaries_and_details_round_trip():
    from compiler_collectives.agreements import wire
    from compiler_collectives.agreements.fingerprint import Collective

    summary = _summary()
    env = wire.decode_audit(_audit_bytes(summary), sender=1, max_bytes=1 << 20, expected_world_size=2)
    assert env.body == summary and env.seq == 4 and env.frame.name == "f"
    c = Collective("_c10d_functional.all_reduce.default", "ranks [0, 1]", "sum", ("float32[s0]",), "", "b.py:9 in f")
    details = wire.AuditDetails("backward", "aot_backward", [c])
    assert wire.decode_audit(_audit_bytes(details), sender=1, max_bytes=1 << 20).body == details


def test_an_audit_payload_and_a_compiler_payload_meeting_in_one_all_gather_are_a_desync_not_corruption():
    import compiler_collectives as cc
    from compiler_collectives.agreements import wire
    from compiler_collectives.observations import FrameId, LocalState

    compiler = wire.encode(LocalState(), rank=1, world_size=2, frame=FrameId("g", "/a/c.py", 7), seq=9, sent_at=2.0)
    with pytest.raises(cc.CollectiveDesyncError, match=r"rank 1 is in a compiler collective \(#9, frame 'g'"):
        wire.decode_audit(compiler, sender=1, max_bytes=1 << 20)
    with pytest.raises(cc.CollectiveDesyncError, match=r"rank 1 sent a program-audit payload \(#4, frame 'f'"):
        wire.decode(_audit_bytes(_summary()), sender=1, max_bytes=1 << 20)


def _set(path, value):
    def edit(envelope):
        target = envelope
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


# Positions in the envelope: [..., 7: "audit", 8: ["summary", phase, failure, levels, graph_break]].
@pytest.mark.parametrize(
    "edit, why",
    [
        (_set((8, 1), "sideways"), "audit phase must be one of"),
        (_set((8, 3, 0, 3), b"\x01"), "audit level 'dynamo' collectives digest must be 8 bytes"),
        (_set((8, 3, 0, 1), -1), "audit level 'dynamo' graph count must be an int in range"),
        (_set((8, 4), [1]), "audit graph break must be a string"),
        (_set((8, 0), "verdict"), "unknown audit body 'verdict'"),
    ],
)
def test_a_malformed_audit_summary_is_rejected_naming_the_sender(edit, why):
    import msgpack

    import compiler_collectives as cc
    from compiler_collectives.agreements import wire

    envelope = msgpack.unpackb(_audit_bytes(_summary()))
    edit(envelope)
    with pytest.raises(cc.WireFormatError, match=f"bad program-audit payload from rank 1: {why}"):
        wire.decode_audit(msgpack.packb(envelope, use_bin_type=True), sender=1, max_bytes=1 << 20)
