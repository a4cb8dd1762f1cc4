"""What a peer's bytes may cost to decode: memory and time bounded by the payload's size.

Each case runs in a child process, a rank of the test harness, whose address
space is capped (``RLIMIT_AS``: what it has mapped after importing the package,
plus ``HEADROOM_MIB``) and whose wall time is capped by the parent, so a decoder
that blows up fails the test (MemoryError, or killed at the deadline) instead of
taking the machine down. The child forks from the harness's forkserver: a fresh
interpreter would cost the start-up (importing torch) that no case tests.
"""

from __future__ import annotations

import json
import os
import time

import msgpack
import pytest

from compiler_collectives.agreements.wire import FORMAT_VERSION
from tests.harness import run_ranks

# Every test here decodes in a child process under a memory limit: the multi-process tier.
pytestmark = [pytest.mark.multiprocess, pytest.mark.release_independent]

HEADROOM_MIB = 256
GROWTH_MIB = 128  # what one decode may add to the child's peak resident memory
# What one decode may take, in the CPU time of the thread that decodes (the fixed decoders take
# well under 0.1 s here): the decoder's own cost, which other processes' load leaves alone. A
# decode that blocks instead would pass this and meet the parent's wall-clock deadline.
DECODE_S = 3.0
SENDER = 1
WORLD = 2
MAX_BYTES = 16 * 1024 * 1024  # the default COMPILER_COLLECTIVES_MAX_PAYLOAD_BYTES
FRAME = ["forward", "/srv/job/model.py", 12]


def _header(version: int = FORMAT_VERSION) -> list:
    return [version, "0.1.0", SENDER, WORLD, FRAME, 3, 1.5]


def _cap_address_space() -> None:
    import resource

    with open("/proc/self/statm") as fh:
        mapped = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + HEADROOM_MIB * 1024 * 1024
    # The soft limit only: the child lifts it again to report (the harness's queue starts a thread).
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def _decode_all(data: bytes) -> dict:
    """Every decoder on ``data``: each must return or raise one of our errors (not, say,
    MemoryError turned into one), within the memory and time bounds."""
    import resource

    from compiler_collectives.agreements import wire
    from compiler_collectives.errors import CollectiveDesyncError, WireFormatError

    decoders = {
        "decode": lambda: wire.decode(data, sender=SENDER, max_bytes=MAX_BYTES, expected_world_size=WORLD),
        "decode_audit": lambda: wire.decode_audit(data, sender=SENDER, max_bytes=MAX_BYTES, expected_world_size=WORLD),
        "decode_reasons": lambda: wire.decode_reasons(
            data, sender=SENDER, max_bytes=MAX_BYTES, expected_world_size=WORLD
        ),
        # The store's records and verdicts have smaller limits of their own; at the payloads'
        # limit their decoders must stay within the same bounds.
        "decode_setup": lambda: wire.decode_setup(data, sender=SENDER, max_bytes=MAX_BYTES),
        "decode_verdict": lambda: wire.decode_verdict(data, sender=SENDER, world_size=WORLD, max_bytes=MAX_BYTES),
    }
    out = {}
    for name, decode in decoders.items():
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.thread_time()
        try:
            decode()
            outcome = "decoded"
        except (WireFormatError, CollectiveDesyncError) as e:
            assert f"rank {SENDER}" in str(e) and e.ranks == (SENDER,), str(e)
            assert "MemoryError" not in str(e), str(e)
            outcome = f"{type(e).__name__}: {e}"
        out[name] = {
            "outcome": outcome,
            "seconds": time.thread_time() - start,
            "grew_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024,
        }
        assert out[name]["grew_mib"] < GROWTH_MIB and out[name]["seconds"] < DECODE_S, (name, out[name], len(data))
    return out


def capped(rank: int, world: int, case: str, arg: str) -> dict:
    """The child: under the address-space cap, decode the payload in file ``arg`` with every
    decoder (``case`` "decode") or fuzz ``arg`` examples ("fuzz")."""
    import resource

    import hypothesis  # noqa: F401

    import compiler_collectives  # noqa: F401  (imports torch: its mappings count as the baseline)

    uncapped = resource.getrlimit(resource.RLIMIT_AS)
    _cap_address_space()
    try:
        if case == "decode":
            with open(arg, "rb") as fh:
                data = fh.read()
            return _decode_all(data)
        _fuzz(int(arg))
        return {"fuzz": "ok"}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, uncapped)


def _bounded(case: str, arg: str, timeout: float = 120) -> dict:
    outcome = run_ranks(capped, 1, args=(case, arg), init=False, timeout=timeout, check=False)
    if outcome.timed_out:
        pytest.fail(f"decoding took more than {timeout:.0f}s")
    assert not outcome.errors, outcome.errors[0]
    return outcome.results[0]


def _decode_in_child(tmp_path, payload: bytes, timeout: float = 120) -> dict:
    path = tmp_path / "payload"
    path.write_bytes(payload)
    return _bounded("decode", str(path), timeout)


# ---------------------------------------------------------------- the two reported blow-ups


def _front_coded_chain(target_bytes: int) -> bytes:
    """Entries whose names each repeat the whole previous name plus one character: a few
    bytes each on the wire, quadratic in characters once decoded."""
    entries = [["L['x']", [None, None, None]]]
    k = len(entries[0][0])
    per_entry = len(msgpack.packb([[1 << 20, "y"], [None, None, None]]))  # k past 65535 takes 5 bytes
    for _ in range(target_bytes // per_entry):
        entries.append([[k, "y"], [None, None, None]])
        k += 1
    return msgpack.packb(_header() + [[entries, True, {}]], use_bin_type=True)


def test_a_1_mib_payload_of_front_coded_names_is_refused_within_the_memory_and_time_bounds(tmp_path):
    payload = _front_coded_chain(1 << 20)
    assert len(payload) <= (1 << 20) + 64
    result = _decode_in_child(tmp_path, payload)["decode"]
    print(result)
    assert result["outcome"].startswith(
        "WireFormatError: bad compiler-collective payload from rank 1: its source "
        "names decode to more than 32 characters per payload byte"
    ), result


def _empty_arrays(where: str) -> bytes:
    """16 MiB of empty msgpack arrays (one byte each) where a decoder meets them."""
    count = MAX_BYTES - 64
    bomb = b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count  # array32 of `count` empty arrays
    marker = msgpack.packb("BOMB")
    if where == "envelope":
        return bomb
    if where == "entries":
        template = _header() + [["BOMB", True, {}]]
    elif where == "frame":
        template = [FORMAT_VERSION, "0.1.0", SENDER, WORLD, "BOMB", 3, 1.5, [[], True, {}]]
    elif where == "audit-body":
        template = _header() + ["audit", "BOMB"]
    elif where == "setup-items":
        template = [1, SENDER, "BOMB"]
    elif where == "setup-value":
        template = [1, SENDER, [["torch version", "BOMB"]]]
    elif where == "verdict":
        template = ["absent", "BOMB"]
    else:  # recompile reasons
        template = [1, "recompile_reasons", SENDER, WORLD, 5, True, "BOMB"]
    packed = msgpack.packb(template, use_bin_type=True)
    assert packed.count(marker) == 1
    return packed.replace(marker, bomb)[:MAX_BYTES]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "where", ["envelope", "entries", "frame", "audit-body", "reasons", "setup-items", "setup-value", "verdict"]
)
def test_16_mib_of_empty_arrays_is_refused_within_the_memory_and_time_bounds(tmp_path, where):
    results = _decode_in_child(tmp_path, _empty_arrays(where), timeout=200)
    meant = {
        "entries": ["decode"],
        "frame": ["decode"],
        "audit-body": ["decode_audit"],
        "reasons": ["decode_reasons"],
        "setup-items": ["decode_setup"],
        "setup-value": ["decode_setup"],
        "verdict": ["decode_verdict"],
    }.get(where, list(results))
    for name in meant:
        assert results[name]["outcome"].startswith("WireFormatError"), (name, results[name])
    print(results)  # every decoder, the others too, kept within the bounds (checked in the child)


# ---------------------------------------------------------------- fuzz


def _fuzz(examples: int) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=8),
        st.binary(max_size=8),
    )
    trees = st.recursive(
        leaves,
        lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=4), inner, max_size=4)),
        max_leaves=40,
    )
    # Shapes that cost far more decoded than on the wire.
    many = st.one_of(st.integers(0, 1000), st.integers(100_000, 400_000))  # small, and past any budget
    empties = st.builds(lambda n, kind: [[] if kind else {}] * n, many, st.booleans())

    def chain(n: int, suffix: str) -> list:
        out, k = [["L['x']", [None, None, None]]], 6
        for _ in range(n):
            out.append([[k, suffix], [None, None, None]])
            k += len(suffix)
        return out

    chains = st.builds(
        chain, st.one_of(st.integers(0, 1000), st.integers(40_000, 60_000)), st.text(min_size=1, max_size=3)
    )
    values = st.one_of(trees, empties, chains)
    envelopes = st.sampled_from(
        [
            _header() + [[[], True, {}]],
            _header() + ["audit", ["summary", "forward", None, [], None]],
            [1, "recompile_reasons", SENDER, WORLD, 5, True, ["why"]],
            [1, SENDER, [["torch version", "2.13.0"], ["COMPILER_COLLECTIVES_GUARDS", True], ["n", 4096]]],
            ["setup", [0, SENDER]],
        ]
    )

    def place(envelope: list, path: list[int], value) -> list:
        envelope = json.loads(json.dumps(envelope))
        node = envelope
        for step in path[:-1]:
            if type(node) is not list or not node:
                break
            node = node[step % len(node)]
        if type(node) is list and node:
            node[path[-1] % len(node)] = value
        else:
            envelope[path[-1] % len(envelope)] = value
        return envelope

    @settings(
        max_examples=examples, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(envelopes, st.lists(st.integers(0, 10), min_size=1, max_size=4), values, st.booleans(), st.integers(0, 40))
    def check(envelope, path, value, as_entries, cut):
        # Anywhere, or as the entries list, where front-coded names are read.
        obj = _header() + [[value, True, {}]] if as_entries else place(envelope, path, value)
        data = msgpack.packb(obj, use_bin_type=True)
        for payload in (data, data[: len(data) - cut]):
            _decode_all(payload)

    check()


@pytest.mark.timeout(600)
@pytest.mark.whole_machine(
    "100 fuzzed payloads under a 256 MiB address-space cap: beside other tests it ran out of the cap "
    "(a MemoryError), which it never does alone"
)
def test_fuzzed_payloads_decode_or_raise_wire_format_error_within_the_memory_and_time_bounds():
    assert _bounded("fuzz", "100", timeout=540) == {"fuzz": "ok"}
