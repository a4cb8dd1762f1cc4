"""Compile once's payloads: the key exchange, the result exchange and the load report of one
graph (``agreements/once.py``).

Layout (``ONCE_FORMAT_VERSION``, now 4; its own version, apart from the envelope's)::

    [ONCE_FORMAT_VERSION, "compile_once", tag, sender_rank, world_size, seq, body]

As a row of a table (``encode_row``: the offers and the load outcomes, which travel in the host
tree's table gather, ``transport.HostTree.gather_table``), the same in columns, each packed on its
own: ``[ONCE_FORMAT_VERSION, "compile_once", tag, world_size, seq]`` (the sender is the row's
rank), then each item of ``body``. Equal columns of many ranks travel once, and ``decode_rows``
decodes and checks each distinct value once: what a rank decodes grows with the distinct keys, dirs
and reasons, not with the world.

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
before anything else is read; any change to the layout bumps it. The items of ``"keys"`` and
``"loaded"`` are their dataclass's fields in order (``Offer``, ``Loaded``), each cut and checked by
its name where it has a rule of its own (``_RULES``), else by its type (``_BY_TYPE``): a new field
travels once it is declared (and the version bumped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import MalformedPayload, WireFormatError
from ..fingerprint import Collective, GraphFingerprint
from .codec import (
    expect,
    failure,
    int_in,
    pack,
    reading,
    reject,
    sender_and_world,
    show,
    values_of,
    versioned_list,
)

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


@dataclasses.dataclass(slots=True)  # slots: a first graph builds one per rank, on every rank
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


@dataclasses.dataclass(slots=True)  # slots: a miss round builds one per rank that missed, on every rank
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
    out: list[Any]
    if isinstance(body, (Offer, Loaded)):
        kind, out = _KIND[type(body)], _items(body)
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
    return pack([ONCE_FORMAT_VERSION, ONCE_TAG, kind, rank, world_size, seq, out])


def _text(v: Any, what: str, *, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    expect(type(v) is str and len(v) <= MAX_TEXT, f"{what} must be a string of at most {MAX_TEXT} characters")
    text: str = v
    return text


def _flag(v: Any, what: str) -> bool:
    expect(type(v) is bool, f"{what} must be a bool")
    flag: bool = v
    return flag


def _names(v: Any, what: str) -> list[str]:
    expect(type(v) is list and len(v) <= MAX_SWITCHES, f"{what} must be a list of at most {MAX_SWITCHES}")
    return [_text(s, f"a name in {what}") or "" for s in v]


def _key(v: Any, what: str) -> str | None:
    expect(v is None or (type(v) is str and 0 < len(v) <= 256), f"{what} must be nil or a short string")
    key: str | None = v
    return key


def _warmth(v: Any, what: str) -> int:
    expect(
        type(v) is int and (WARMTH_COLD <= v <= WARMTH_MAX_ENTRIES or v == WARMTH_FX),
        f"{what} must be an entry count or WARMTH_FX",
    )
    warmth: int = v
    return warmth


def _bounded(v: Any, what: str, most: int) -> str:
    expect(type(v) is str and len(v) <= most, f"{what} must be a string of at most {most} characters")
    text: str = v
    return text


def _outcome(v: Any, what: str) -> str:
    expect(v in LOAD_OUTCOMES, f"unknown {what} {show(v)}")
    outcome: str = v
    return outcome


Out = Callable[[Any], Any]  # a field's value as it travels (cut to its bound)
Check = Callable[[Any, str], Any]  # a peer's value of a field, checked (``what``: the field's name)

# How a field of a keys or loaded body travels, by its declared type; ``_RULES`` by its name.
_BY_TYPE: dict[str, tuple[Out, Check]] = {
    "str": (lambda v: v[:MAX_TEXT], lambda v, what: _text(v, what) or ""),
    "str | None": (_cut, lambda v, what: _text(v, what, optional=True)),
    "bool": (bool, _flag),
    "int": (int, lambda v, what: int_in(v, what)),
    "list[str]": (lambda v: list(v)[:MAX_SWITCHES], _names),
}
_RULES: dict[tuple[str, str], tuple[Out, Check]] = {
    ("Offer", "key"): (lambda v: v, _key),
    ("Offer", "max_artifact_bytes"): (int, lambda v, what: int_in(v, what, lo=1)),
    ("Offer", "graph"): (lambda v: v[:128], lambda v, what: _text(v, what) or ""),
    ("Offer", "warmth"): (int, _warmth),
    ("Offer", "build"): (lambda v: v[:MAX_BUILD], lambda v, what: _bounded(v, what, MAX_BUILD)),
    ("Loaded", "outcome"): (lambda v: v, _outcome),
}
_KIND: dict[type, str] = {Offer: "keys", Loaded: "loaded"}
_ROWS: dict[str, type[Offer] | type[Loaded]] = {"keys": Offer, "loaded": Loaded}


def _rules(cls: type[Offer] | type[Loaded]) -> tuple[tuple[str, Out, Check], ...]:
    """Per field of ``cls``, in order: its name, how it goes out, how a peer's is checked."""
    out = []
    for field in dataclasses.fields(cls):
        rule = _RULES.get((cls.__name__, field.name)) or _BY_TYPE.get(str(field.type))
        if rule is None:
            raise TypeError(f"{cls.__name__}.{field.name}: no wire rule for a field of type {field.type}")
        out.append((field.name, *rule))
    return tuple(out)


_FIELDS = {Offer: _rules(Offer), Loaded: _rules(Loaded)}  # a field without a rule fails at import


def _items(body: Offer | Loaded) -> list[Any]:
    return [out(getattr(body, name)) for name, out, _ in _FIELDS[type(body)]]


def row_columns(kind: str) -> int:
    """The columns of a row of ``kind`` (``"keys"``, ``"loaded"``): the head, then a field each."""
    return 1 + len(_FIELDS[_ROWS[kind]])


def _head(kind: str, world_size: int, seq: int) -> bytes:
    return pack([ONCE_FORMAT_VERSION, ONCE_TAG, kind, world_size, seq])


def encode_row(*, world_size: int, seq: int, body: Offer | Loaded) -> list[bytes]:
    """One rank's offer or load outcome as a row of a table: the head, then each field packed."""
    return [_head(_KIND[type(body)], world_size, seq), *map(pack, _items(body))]


def decode_rows(
    columns: Sequence[tuple[Sequence[bytes], Sequence[int]]],
    senders: Sequence[int],
    *,
    kind: str,
    seq: int,
    world_size: int,
) -> list[Offer | Loaded]:
    """Each row's body from a table of rows (``encode_row``'s): per column its distinct values and
    each row's index into them; ``senders``: each row's rank, for errors. Each distinct value is
    decoded and checked once; ``WireFormatError`` names a rank that sent a bad one. The bodies of
    rows with equal fields share those values' objects: read them, never change them."""
    cls = _ROWS[kind]
    codecs = _FIELDS[cls]
    if len(columns) != 1 + len(codecs):
        raise ValueError(f"{len(columns)} columns for rows of {1 + len(codecs)}")

    def fail_for(index: Sequence[int]) -> Callable[[int], Callable[[str], WireFormatError]]:
        def fail(j: int) -> Callable[[str], WireFormatError]:  # names the first rank that sent value j
            return failure(
                "compile-once", "compile_once", senders[list(index).index(j)], "compiler_collectives version"
            )

        return fail

    heads, index = columns[0]
    for j, data in enumerate(heads):
        if data != _head(kind, world_size, seq):  # read as a payload is: the version first
            with reading(data, len(data), fail_for(index)(j)) as r:
                _, tag, got, world, number = versioned_list(r, ONCE_FORMAT_VERSION, "compile-once format", 5)
                expect(tag == ONCE_TAG, f"not a compile-once row (tag {show(tag)})")
                expect(got == kind, f"a {show(got)} row in an exchange of {kind}")
                expect(world == world_size, f"world size {show(world)}, expected {world_size}")
                expect(number == seq, f"a row of graph #{show(number)} in the exchange of #{seq}")
                reject("a row head packed otherwise than this rank packs it")
    fields: list[list[Any]] = []
    for (name, _, check), (packed, index) in zip(codecs, columns[1:]):
        fail = fail_for(index)
        checked = []
        for j, value in enumerate(values_of(packed, fail)):
            try:
                checked.append(check(value, name))
            except MalformedPayload as e:
                raise fail(j)(str(e)) from None
        fields.append(checked * len(senders) if len(checked) == 1 else list(map(checked.__getitem__, index)))
    return list(map(cls, *fields))


def _body(cls: type[Offer] | type[Loaded], body: Any) -> Offer | Loaded:
    codecs = _FIELDS[cls]
    expect(type(body) is list and len(body) == len(codecs), f"a {_KIND[cls]} body must have {len(codecs)} items")
    return cls(*(check(v, name) for (name, _, check), v in zip(codecs, body)))


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
        parsed = _result(body) if kind == "result" else _body(Offer if kind == "keys" else Loaded, body)
        return OnceEnvelope(rank, world, seq, kind, parsed)
    raise AssertionError("unreachable: reading() raises on every failure")
