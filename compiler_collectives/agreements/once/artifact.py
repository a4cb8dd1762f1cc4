"""Compile once's artifact on disk: what a compile left in the cache dir, and what a loading
rank checks and installs, all over a root dir (the inductor cache dir).

The serving rank ``collect``s every file of the graph's cache entries and kernel files with its
SHA-256 (the manifest). A loading rank trusts what torch's own lookup would trust and refuses only
what the threat model needs (docs/design.md, "compile once"):

1. it refuses bytes that do not match their digest (``split_verified``, ``check_shared``), a path
   outside the cache layout (``safe_relpath``), a manifest without an entry (``manifest_problem``)
   and an entry for another key (``foreign_entry``); the driver refuses oversize artifacts;
2. a kernel binary that exists with other bytes beside its own source is an equivalent build,
   kept as it is (``kernel_sources``, ``equivalent_build``);
3. entries of the key that the manifest does not list are no reason to refuse
   (``unlisted_entries`` names them);
4. any other existing file with other content is torn or stale: replaced by the verified bytes;
5. the install is staged: all or nothing (``install``).

Each check returns a ``Refusal`` saying why not; a load that goes ahead returns ``Accepted``.
No counters and no exchanges: the driver (``driver.py``) counts, logs and talks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import socket
import stat
import threading

from ..wire.once import ManifestFile, Result

log = logging.getLogger("compiler_collectives.once")

_SAFE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=-]{0,255}$")

# What inductor builds from a kernel source (``<stem>.main.cpp`` -> ``<stem>.main.so``, ``.o``
# when linked in two steps) and the GPU backends' binaries. Such a file embeds the absolute path
# of the dir it was built in, so two equal builds in two dirs differ byte for byte.
BINARY_SUFFIXES = frozenset({".so", ".o", ".obj", ".pyd", ".dll", ".dylib", ".cubin", ".fatbin", ".hsaco", ".spv"})
SOURCE_SUFFIXES = frozenset({".cpp", ".cc", ".cxx", ".c", ".cu", ".hip"})

# What a file of the artifact is in this rank's dir (``_found``).
_ABSENT, _SAME, _OTHER, _NOT_A_FILE = "absent", "same", "other", "not a file"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a loading rank does not take an artifact."""

    why: str
    digest: bool = False  # a file's bytes did not match the SHA-256 its source sent


@dataclasses.dataclass(frozen=True)
class Accepted:
    """What a loading rank did to take an artifact: how many files it wrote new, which existing
    files it replaced (their bytes differed: torn or stale) and which kernel binaries it kept
    (an equivalent build of the same source was there already)."""

    written: int = 0
    replaced: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()


def dir_identity(root: str) -> str:
    """Ranks with the same identity share the cache dir: host (boot id), device and inode."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            host = f.read().strip()
    except OSError:
        host = socket.gethostname()
    try:
        st = os.stat(root)
        return f"{host}:{st.st_dev}:{st.st_ino}"
    except OSError:
        return f"{host}:{os.path.realpath(root)}"


def holds(entry_dir: str) -> bool:
    """Whether a cache entry dir holds an entry (its guards are not evaluated)."""
    try:
        return any(not n.startswith(".") for n in os.listdir(entry_dir))
    except OSError:
        return False


def _listed_name(name: str) -> bool:
    # Hidden names are our staging and torch's own temporary files (``write_atomic``): half
    # written by definition. Lock files belong to the process that holds them.
    return not name.startswith(".") and not name.endswith(".lock")


def _stem(name: str) -> str:
    return name.split(".", 1)[0]


def count_entries(cache_dir: str, cap: int) -> int:
    """How many keys a two-level cache dir (``fxgraph/<bucket>/<key>``) holds, up to ``cap``."""
    count = 0
    try:
        buckets = [b for b in os.listdir(cache_dir) if not b.startswith(".")]
    except OSError:
        return 0
    for bucket in buckets:
        try:
            count += sum(1 for k in os.listdir(os.path.join(cache_dir, bucket)) if not k.startswith("."))
        except OSError:
            continue
        if count >= cap:
            return cap
    return count


def collect(root: str, dirs: list[str], sources: list[str]) -> tuple[list[ManifestFile], bytes]:
    """Every file of a compile's artifact under ``root``: the files of the cache entry ``dirs``,
    and of each kernel source in ``sources`` the files that share its stem (its binaries).
    Hidden and lock files, and files outside ``root``, are not part of it; a file that vanishes
    while it is read is left out (the loader then compiles what it held)."""
    root = os.path.realpath(root)
    paths: list[str] = []
    for d in dirs:
        try:
            paths.extend(os.path.join(d, n) for n in sorted(os.listdir(d)) if _listed_name(n))
        except OSError:
            continue
    for src in sources:
        d, name = os.path.split(src)
        stem = _stem(name)
        try:
            paths.extend(
                os.path.join(d, n) for n in sorted(os.listdir(d)) if n.startswith(stem + ".") and _listed_name(n)
            )
        except OSError:
            continue
    manifest: list[ManifestFile] = []
    chunks: list[bytes] = []
    seen: set[str] = set()
    for path in paths:
        real = os.path.realpath(path)
        rel = os.path.relpath(real, root)
        if rel in seen or rel == os.pardir or rel.startswith(os.pardir + os.sep) or not os.path.isfile(real):
            continue
        try:
            with open(real, "rb") as f:
                data = f.read()
        except OSError as e:
            log.debug("compile once: %s left out of the artifact: %s", rel, e)
            continue
        seen.add(rel)
        manifest.append(ManifestFile(rel, hashlib.sha256(data).digest(), len(data)))
        chunks.append(data)
    return manifest, b"".join(chunks)


def safe_relpath(rel: str) -> bool:
    """Rule 1: a path a loading rank may write under its cache dir: relative, normalized, plain
    names, at most 6 deep."""
    if not rel or os.path.isabs(rel) or os.path.normpath(rel) != rel:
        return False
    parts = rel.split(os.sep)
    return len(parts) <= 6 and all(_SAFE_PART.match(p) and p not in (".", "..") for p in parts)


def manifest_problem(result: Result, source: int, level: str = "aot") -> str | None:
    """Rule 1: why no rank may load this artifact, whatever its bytes (None: it may, once they
    match): no artifact, a path outside the layout, no cache entry."""
    if result.status != "ok":
        return f"rank {source} has no artifact ({result.status})"
    for f in result.manifest:
        if not safe_relpath(f.relpath):
            return f"rank {source} named a file outside the cache layout: {f.relpath!r}"
    entry, cache = ("aotautograd", "AOTAutograd") if level == "aot" else ("fxgraph", "FX graph")
    if not any(f.relpath.startswith(entry + os.sep) for f in result.manifest):
        return f"rank {source} saved no {cache} cache entry for this graph (its cache bypassed it)"
    return None


def foreign_entry(manifest: list[ManifestFile], prefix: str, key: str | None, level: str) -> Refusal | None:
    """Rule 1: a rank loads only for a key it computed itself: the artifact's entry must be under
    ``prefix`` (this rank's own entry dir, relative to its cache dir)."""
    if not any(f.relpath.startswith(prefix) for f in manifest):
        return Refusal(f"the artifact holds no entry for this rank's own key ({key})")
    top = "aotautograd" + os.sep if level == "aot" else None
    for f in manifest:
        if top is not None and f.relpath.startswith(top) and not f.relpath.startswith(prefix):
            return Refusal(f"the artifact holds an AOTAutograd entry for another key: {f.relpath}")
    return None


def unlisted_entries(root: str, prefix: str, manifest: list[ManifestFile]) -> list[str]:
    """Rule 3: files under the entry dir ``prefix`` that the manifest does not list (at most 5).
    Not a reason to refuse: AOTAutograd names an entry by a hash of its pickle, which differs
    between processes, and its lookup tries each entry's guards just as for ours; but with them
    the lookup may hit an entry other than the listed one."""
    listed = {f.relpath for f in manifest}
    try:
        names = [n for n in os.listdir(os.path.join(root, prefix)) if _listed_name(n)]
    except OSError:
        return []
    return sorted(prefix + n for n in names if prefix + n not in listed)[:5]


def _found(path: str, f: ManifestFile) -> str:
    """What ``path`` holds, against the listed ``f``: nothing, its bytes, other bytes (a file we
    cannot read counts as other bytes), or something that is not a regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return _OTHER if os.path.islink(path) else _ABSENT  # a dangling link is replaced
    except NotADirectoryError:
        return _ABSENT  # a file where one of its dirs should be: writing it fails, refused then
    except OSError:
        return _OTHER
    if not stat.S_ISREG(st.st_mode):
        return _NOT_A_FILE
    if st.st_size != f.size:
        return _OTHER
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return _OTHER
    return _SAME if digest.digest() == f.sha256 else _OTHER


def kernel_sources(relpath: str, manifest: list[ManifestFile]) -> list[ManifestFile]:
    """Rule 2's kernel binary: ``relpath`` ends in a binary suffix (``BINARY_SUFFIXES``) and the
    manifest lists, in the same dir, sources (``SOURCE_SUFFIXES``) with the same stem; those
    sources. Empty: ``relpath`` is not a kernel binary."""
    d, name = os.path.split(relpath)
    if os.path.splitext(name)[1] not in BINARY_SUFFIXES:
        return []
    stem = _stem(name)
    return [
        f
        for f in manifest
        if os.path.dirname(f.relpath) == d
        and _stem(os.path.basename(f.relpath)) == stem
        and os.path.splitext(f.relpath)[1] in SOURCE_SUFFIXES
    ]


def equivalent_build(root: str, relpath: str, manifest: list[ManifestFile]) -> bool:
    """Rule 2: the file at ``relpath`` under ``root`` is an equivalent build of the listed one:
    it is a kernel binary (``kernel_sources``) and each of its listed sources sits beside it with
    the listed digest. Inductor names a kernel by a hash of its source and build command and
    builds it only when the binary is absent, so torch's lookup, and a local compile alike, load
    that very file: refusing it, or replacing it under a process that has it mapped, gains
    nothing. (A binary torn by a crashed build is as broken for a local compile: not ours to
    judge.)"""
    sources = kernel_sources(relpath, manifest)
    return bool(sources) and all(_found(os.path.join(root, s.relpath), s) == _SAME for s in sources)


def check_shared(root: str, manifest: list[ManifestFile], source: int) -> Accepted | Refusal:
    """A loading rank that shares ``source``'s cache dir: each listed file is there with its
    digest (rule 1: other bytes are a digest refusal, a missing file a refusal), except that a
    kernel binary beside its listed sources is kept whatever its bytes (rule 2: torch loads that
    file for this graph either way). Unlisted entries are fine (rule 3). Nothing is written."""
    kept: list[str] = []
    for f in manifest:
        path = os.path.join(root, f.relpath)
        found = _found(path, f)
        if found == _SAME:
            continue
        if found in (_ABSENT, _NOT_A_FILE):
            return Refusal(
                f"{f.relpath} is missing from the shared cache dir" + (" (not a file)" if found == _NOT_A_FILE else "")
            )
        if equivalent_build(root, f.relpath, manifest):
            kept.append(f.relpath)
            continue
        return Refusal(f"{f.relpath} in the shared cache dir does not match the SHA-256 rank {source} sent", True)
    if kept:
        log.debug("compile once: kernel binaries kept as built beside their sources: %s", kept)
    return Accepted(kept=tuple(kept))


def split_verified(
    manifest: list[ManifestFile], data: bytes, source: int
) -> tuple[list[tuple[ManifestFile, bytes]], Refusal | None]:
    """Rule 1: the received bytes cut into the manifest's files, each checked against its SHA-256."""
    pieces: list[tuple[ManifestFile, bytes]] = []
    offset = 0
    for f in manifest:
        piece = data[offset : offset + f.size]
        offset += f.size
        if hashlib.sha256(piece).digest() != f.sha256:
            return [], Refusal(
                f"{f.relpath} does not match the SHA-256 rank {source} sent over the job's gloo group", True
            )
        pieces.append((f, piece))
    return pieces, None


def _rename_order(relpath: str) -> int:
    # Kernels first, then FX graph entries, then the AOTAutograd entry that names them: a rename
    # that fails midway never leaves an entry whose files are missing.
    top = relpath.split(os.sep, 1)[0]
    return {"fxgraph": 1, "aotautograd": 2}.get(top, 0)


def _make_dirs(d: str, created: list[str]) -> None:
    """``os.makedirs``, noting the dirs it made (outermost first) so a failure can remove them."""
    missing: list[str] = []
    p = d
    while p and not os.path.isdir(p) and os.path.dirname(p) != p:
        missing.append(p)
        p = os.path.dirname(p)
    os.makedirs(d, exist_ok=True)
    created.extend(reversed(missing))


def install(root: str, pieces: list[tuple[ManifestFile, bytes]]) -> Accepted | Refusal:
    """Put verified files (``split_verified``) in place under ``root``.

    A file there with the same bytes is left as it is; a kernel binary with other bytes beside
    its listed sources is kept (rule 2, ``equivalent_build``); any other file with other bytes is
    torn or stale and is replaced (rule 4). Rule 5: every file is first written under a hidden
    name in its own dir (torch's lookups skip those), then each is renamed over its place
    (``os.replace``: atomic; a process that has the old file open keeps it). A write that fails
    removes what it staged and the dirs it made: nothing new is left behind; a rename that fails
    (unexpected after staging in the same dir) removes the files it added, while files already
    replaced keep their verified bytes."""
    manifest = [f for f, _ in pieces]
    for f in manifest:
        if not safe_relpath(f.relpath):
            return Refusal(f"the artifact names a file outside the cache layout: {f.relpath!r}")
    todo: list[tuple[ManifestFile, bytes, str, bool]] = []  # file, bytes, path, whether it is new
    replaced: list[str] = []
    kept: list[str] = []
    for f, piece in pieces:
        path = os.path.join(root, f.relpath)
        found = _found(path, f)
        if found == _SAME:
            continue
        if found == _NOT_A_FILE:
            return Refusal(f"could not write the artifact into this rank's cache dir: {f.relpath} is not a file")
        if found == _OTHER:
            if equivalent_build(root, f.relpath, manifest):
                kept.append(f.relpath)
                continue
            replaced.append(f.relpath)
        todo.append((f, piece, path, found == _ABSENT))
    todo.sort(key=lambda t: _rename_order(t[0].relpath))
    staged: list[tuple[str, str, bool]] = []
    created: list[str] = []
    try:
        for i, (_, piece, path, new) in enumerate(todo):
            d = os.path.dirname(path)
            _make_dirs(d, created)
            tmp = os.path.join(d, f".cc-once-{os.getpid()}-{threading.get_ident()}-{i}")
            staged.append((tmp, path, new))
            with open(tmp, "wb") as fh:
                fh.write(piece)
    except OSError as e:
        _undo(staged, [], created)
        return Refusal(f"could not write the artifact into this rank's cache dir: {e}")
    done: list[tuple[str, str, bool]] = []
    for n, (tmp, path, new) in enumerate(staged):
        try:
            os.replace(tmp, path)
        except OSError as e:
            _undo(staged[n:], [p for _, p, was_new in done if was_new], [])
            return Refusal(f"could not move the artifact into place in this rank's cache dir: {e}")
        done.append((tmp, path, new))
    if kept:
        log.debug("compile once: kernel binaries kept as built beside their sources: %s", kept)
    if replaced:
        log.debug("compile once: torn or stale files replaced by the verified bytes: %s", replaced)
    return Accepted(sum(1 for *_, new in todo if new), tuple(replaced), tuple(kept))


def _undo(staged: list[tuple[str, str, bool]], added: list[str], created: list[str]) -> None:
    for path in [tmp for tmp, _, _ in staged] + added:
        with contextlib.suppress(OSError):
            os.unlink(path)
    for d in reversed(created):  # innermost first; only those still empty go
        with contextlib.suppress(OSError):
            os.rmdir(d)
