"""Compile once's payloads: the key exchange, the result exchange and the load report of one
graph (``agreements/once.py``).

Layout (``ONCE_FORMAT_VERSION``, now 4; its own version, apart from the envelope's)::

    [ONCE_FORMAT_VERSION, "compile_once", tag, sender_rank, world_size, seq, body]

``tag`` and ``body``:

* ``"keys"``: ``[key, why, holds, dir, switches, max_artifact_bytes, graph, warmth, build]``: this rank's cache
  key (AOTAutograd's, or the FX graph cache's at the fallback level; nil when the graph is not
  cacheable here, ``why`` then says why), whether its cache holds an entry for it, the identity
  of its cache dir (ranks with equal identities share the dir), the names of torch's
  compile-time collectives switched on, the largest artifact it accepts, and a digest of the
  graph handed to AOTAutograd (ranks whose graphs are equal compile the same FX graphs), and how
  warm its cache is for a compile of this key: ``WARMTH_FX`` when its FX graph cache holds every
  inductor compile this key took the last time it ran here, else how many FX graph entries its
  cache dir holds (up to ``WARMTH_MAX_ENTRIES``: the fuller dir likely holds kernels this graph
  needs), 0 when cold; and its build fingerprint (``once.build``: the CPU and compiler it builds
  kernels for and with; ranks whose fingerprints differ never share an artifact);
* ``"result"``: ``[status, failure, manifest, fingerprints, chunk_bytes, chunks]``: ``status`` is
  ``"none"`` (this rank compiled nothing for another), ``"ok"`` or ``"failed"`` (``failure``:
  "ExcType: message"); ``manifest``: ``[[relpath, sha256, size], ...]``, every file of the
  artifact relative to the cache dir, with its SHA-256 (32 bytes); ``fingerprints``: the program
  audit's graphs of the compile, ``[[level, [[op, group, reduce_op, [tensor, ...], args, where],
  ...], graph_hash, nodes], ...]``; ``chunks``: the SHA-256 of each ``chunk_bytes`` piece of the
  artifact's bytes (its files in manifest order), which a forwarding rank checks before it passes
  a piece on (``chunk_bytes`` 0 and no chunks when the manifest is empty);
* ``"loaded"``: ``[outcome, why]``: ``"none"``, ``"hit"``, ``"miss"`` (the entry's guards failed
  this rank's hints) or ``"refused"`` (``why`` says what did not match).

Texts are cut by the sender and bounded by the decoder. The version comes first and is checked
before anything else is read; any change to the layout bumps it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..fingerprint import Collective, GraphFingerprint
from .codec import expect, failure, int_in, pack, reading, sender_and_world, show, versioned_list

ONCE_FORMAT_VERSION = 4
ONCE_TAG = "compile_once"
ONCE_KINDS = ("keys", "result", "loaded")
RESULT_STATUSES = ("none", "ok", "failed")
LOAD_OUTCOMES = ("none", "hit", "miss", "refused")
MAX_TEXT = 4096
MAX_FILES = 100_000
MAX_SWITCHES = 16
MAX_BUILD = 256
MIN_CHUNK_BYTES = 4096
MAX_CHUNKS = 1 << 20
WARMTH_COLD = 0
WARMTH_MAX_ENTRIES = 1 << 20
WARMTH_FX = 1 << 30


@dataclasses.dataclass
class Offer:
    """One rank's part of the key exchange."""

    key: str | None
    why: str | None
    holds: bool
    dir: str
    switches: list[str]
    max_artifact_bytes: int
    graph: str = ""
    warmth: int = 0  # how fast this rank would compile the key without its entry (see the layout)
    build: str = ""  # the build fingerprint (``once.build``): what its kernels are built for and with


@dataclasses.dataclass
class ManifestFile:
    relpath: str
    sha256: bytes
    size: int


@dataclasses.dataclass
class Result:
    """One rank's part of the result exchange."""

    status: str
    failure: str | None
    manifest: list[ManifestFile]
    fingerprints: list[GraphFingerprint]
    chunk_bytes: int = 0
    chunks: list[bytes] = dataclasses.field(default_factory=list)

    def total(self) -> int:
        """The artifact's bytes: its files, in manifest order."""
        return sum(f.size for f in self.manifest)


@dataclasses.dataclass
class Loaded:
    outcome: str
    why: str | None


@dataclasses.dataclass
class OnceEnvelope:
    rank: int
    world_size: int
    seq: int
    kind: str
    body: Offer | Result | Loaded


def _cut(text: str | None) -> str | None:
    return None if text is None else text[:MAX_TEXT]


def fingerprint_out(g: GraphFingerprint) -> list[Any]:
    return [
        g.level,
        [[c.op, c.group, c.reduce_op, list(c.tensors), c.args, c.where[:MAX_TEXT]] for c in g.collectives],
        g.graph_hash,
        g.nodes,
    ]


def encode_once(*, rank: int, world_size: int, seq: int, body: Offer | Result | Loaded) -> bytes:
    """Serialize one rank's part of a compile-once exchange."""
    if isinstance(body, Offer):
        kind = "keys"
        out: list[Any] = [
            body.key,
            _cut(body.why),
            bool(body.holds),
            body.dir[:MAX_TEXT],
            list(body.switches)[:MAX_SWITCHES],
            int(body.max_artifact_bytes),
            body.graph[:128],
            int(body.warmth),
            body.build[:MAX_BUILD],
        ]
    elif isinstance(body, Result):
        kind = "result"
        out = [
            body.status,
            _cut(body.failure),
            [[f.relpath, f.sha256, f.size] for f in body.manifest],
            [fingerprint_out(g) for g in body.fingerprints],
            int(body.chunk_bytes),
            list(body.chunks),
        ]
    else:
        kind = "loaded"
        out = [body.outcome, _cut(body.why)]
    return pack([ONCE_FORMAT_VERSION, ONCE_TAG, kind, rank, world_size, seq, out])


def _text(v: Any, what: str, *, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    expect(type(v) is str and len(v) <= MAX_TEXT, f"{what} must be a string of at most {MAX_TEXT} characters")
    text: str = v
    return text


def _offer(body: Any) -> Offer:
    expect(type(body) is list and len(body) == 9, "a keys body must have 9 items")
    key, why, holds, cache_dir, switches, max_bytes, graph, warmth, build = body
    expect(
        type(build) is str and len(build) <= MAX_BUILD, f"the build must be a string of at most {MAX_BUILD} characters"
    )
    expect(key is None or (type(key) is str and 0 < len(key) <= 256), "the cache key must be nil or a short string")
    expect(type(holds) is bool, "holds must be a bool")
    expect(
        type(warmth) is int and (WARMTH_COLD <= warmth <= WARMTH_MAX_ENTRIES or warmth == WARMTH_FX),
        "warmth must be an entry count or WARMTH_FX",
    )
    expect(type(switches) is list and len(switches) <= MAX_SWITCHES, "switches must be a short list")
    names = [_text(s, "a switch name") or "" for s in switches]
    return Offer(
        key,
        _text(why, "why", optional=True),
        holds,
        _text(cache_dir, "the cache dir identity") or "",
        names,
        int_in(max_bytes, "max artifact bytes", lo=1),
        _text(graph, "graph digest") or "",
        warmth,
        build,
    )


def _collective(item: Any) -> Collective:
    expect(type(item) is list and len(item) == 6, "a collective must have 6 items")
    op, group, reduce_op, tensors, args, where = item
    expect(type(tensors) is list, "a collective's tensors must be a list")
    return Collective(
        _text(op, "op") or "",
        _text(group, "group") or "",
        _text(reduce_op, "reduce op") or "",
        tuple(_text(t, "tensor") or "" for t in tensors),
        _text(args, "args") or "",
        _text(where, "where") or "",
    )


def fingerprint_in(item: Any) -> GraphFingerprint:
    expect(type(item) is list and len(item) == 4, "a fingerprint must have 4 items")
    level, collectives, graph_hash, nodes = item
    expect(
        level in ("aot_forward", "aot_backward", "inductor_forward", "inductor_backward"),
        f"unknown level {show(level)}",
    )
    expect(type(collectives) is list, "collectives must be a list")
    expect(type(graph_hash) is bytes and len(graph_hash) <= 64, "graph hash must be a short binary")
    return GraphFingerprint(level, [_collective(c) for c in collectives], graph_hash, int_in(nodes, "nodes", lo=0))


def _result(body: Any) -> Result:
    expect(type(body) is list and len(body) == 6, "a result body must have 6 items")
    status, fail_text, manifest, fingerprints, chunk_bytes, chunks = body
    expect(status in RESULT_STATUSES, f"unknown result status {show(status)}")
    expect(type(manifest) is list and len(manifest) <= MAX_FILES, "the manifest must be a list")
    files = []
    for item in manifest:
        expect(type(item) is list and len(item) == 3, "a manifest line must have 3 items")
        relpath, sha, size = item
        expect(type(sha) is bytes and len(sha) == 32, "a file's SHA-256 must be 32 bytes")
        files.append(ManifestFile(_text(relpath, "a relative path") or "", sha, int_in(size, "file size", lo=0)))
    expect(type(fingerprints) is list, "fingerprints must be a list")
    total = sum(f.size for f in files)
    expect(type(chunks) is list and len(chunks) <= MAX_CHUNKS, f"chunks must be a list of at most {MAX_CHUNKS}")
    if total == 0:
        expect(chunk_bytes == 0 and not chunks, "an empty artifact has no chunks")
    else:
        int_in(chunk_bytes, "chunk bytes", lo=MIN_CHUNK_BYTES)
        expect(len(chunks) == -(-total // chunk_bytes), "the chunk digests must cover the artifact's bytes")
    for digest in chunks:
        expect(type(digest) is bytes and len(digest) == 32, "a chunk's SHA-256 must be 32 bytes")
    return Result(
        status,
        _text(fail_text, "failure", optional=True),
        files,
        [fingerprint_in(g) for g in fingerprints],
        chunk_bytes,
        chunks,
    )


def _loaded(body: Any) -> Loaded:
    expect(type(body) is list and len(body) == 2, "a loaded body must have 2 items")
    outcome, why = body
    expect(outcome in LOAD_OUTCOMES, f"unknown load outcome {show(outcome)}")
    return Loaded(outcome, _text(why, "why", optional=True))


def decode_once(data: bytes, *, sender: int, max_bytes: int, expected_world_size: int | None = None) -> OnceEnvelope:
    """Parse and validate one rank's part of a compile-once exchange; ``WireFormatError`` names the sender."""
    fail = failure("compile-once", "compile_once", sender, "compiler_collectives version")
    with reading(data, max_bytes, fail) as r:
        _, tag, kind, rank, world, seq, body = versioned_list(r, ONCE_FORMAT_VERSION, "compile-once format", 7)
        expect(tag == ONCE_TAG, f"not a compile-once payload (tag {show(tag)})")
        expect(kind in ONCE_KINDS, f"unknown compile-once message {show(kind)}")
        sender_and_world(rank, sender, world, expected_world_size)
        int_in(seq, "sequence number", lo=0)
        parsed: Offer | Result | Loaded
        if kind == "keys":
            parsed = _offer(body)
        elif kind == "result":
            parsed = _result(body)
        else:
            parsed = _loaded(body)
        return OnceEnvelope(rank, world, seq, kind, parsed)
    raise AssertionError("unreachable: reading() raises on every failure")
