"""Entry agreement's registry of a frame's cache entries (unit tier: no process is started).

The registry mirrors Dynamo's cache for one code object, and every rank keeps
the same one because every rank compiles together: it must stay bounded the
way Dynamo's cache is, number entries for good, and never let ``mixed`` move
except at a compile.
"""

from __future__ import annotations

from compiler_collectives.agreements import entry, entry_program
from compiler_collectives.agreements.fingerprint import Collective
from compiler_collectives.observations import FrameId

FRAME = FrameId("step", "/job/train.py", 10)


def _code() -> object:
    def step() -> None:  # a code object of its own for each test
        pass

    return step.__code__


def _all_reduce(op: str = "_c10d_functional.all_reduce.default", shape: str = "float32[8, 4]") -> Collective:
    return Collective(op, "ranks [0, 1]", "sum", (shape,), "", "train.py:12")


def _compile(
    code: object, levels: list[tuple[str, list[Collective]]], *, limit: int = 8, resumes: tuple[str, ...] = ()
) -> None:
    token = entry.compile_started(code)
    if levels:
        program = entry_program.GraphProgram([(level, b"", cs) for level, cs in levels])
        entry.wrap(lambda: None, code, FRAME, "0/0", 0, program, check=False)
    entry.compile_finished(code, FRAME, token, True, limit=limit, resumes=resumes)


def _entries(code: object) -> list[dict]:
    return entry.frames()[str(FRAME)]


def test_the_registry_keeps_at_most_dynamos_limit_and_never_reuses_a_number():
    code = _code()
    for _ in range(30):
        _compile(code, [("dynamo", [])], limit=4)
    assert [e["index"] for e in _entries(code)] == [26, 27, 28, 29]
    entry.reset()


def test_a_frame_stays_mixed_after_its_differing_entries_leave_the_registry():
    code = _code()
    _compile(code, [("dynamo", [_all_reduce()])], limit=2)
    _compile(code, [("dynamo", [])], limit=2)
    assert _entries(code)[-1]["mixed"]
    for _ in range(5):
        _compile(code, [("dynamo", [])], limit=2)
    assert all(e["mixed"] for e in _entries(code))  # entry #0 may still run on some rank
    entry.reset()


def test_which_levels_exist_never_makes_two_entries_differ():
    code = _code()
    _compile(code, [("dynamo", []), ("aot_forward", [])])  # a lazy backward: no backward level
    _compile(code, [("dynamo", []), ("aot_forward", []), ("aot_backward", [])])
    _compile(code, [])  # an entry without a graph
    _compile(code, [("dynamo", [])])  # every level loaded from a cache on every rank
    assert not any(e["mixed"] for e in _entries(code))
    entry.reset()


def test_an_entry_read_at_a_shallower_level_compares_by_the_collective_it_runs():
    code = _code()
    _compile(
        code, [("dynamo", [_all_reduce()]), ("inductor_forward", [_all_reduce("_c10d_functional.all_reduce_.default")])]
    )
    _compile(code, [("dynamo", [_all_reduce(shape="float32[s0, 4]")])])  # loaded from a cache everywhere
    assert not any(e["mixed"] for e in _entries(code))
    entry.reset()


def test_entries_that_differ_in_their_graph_breaks_have_different_keys_and_the_same_program():
    code = _code()
    _compile(code, [("dynamo", [])], resumes=("__resume_at_80",))
    _compile(code, [("dynamo", [])])
    first, second = _entries(code)
    assert first["program"] != second["program"] and second["mixed"]
    entry.reset()


def test_a_reset_forgets_every_frame():
    code = _code()
    _compile(code, [("dynamo", [_all_reduce()])])
    _compile(code, [("dynamo", [])])
    assert entry.mixed_codes() == [code]
    entry.reset()
    assert entry.frames() == {} and entry.mixed_codes() == []
