"""Compile once's artifact on disk: what a compile left in the cache dir, and what a loading
rank checks and installs, all over a root dir (the inductor cache dir).

The serving rank ``collect``s every file of the graph's cache entries and kernel binaries with
its SHA-256 (the manifest). A loading rank checks the manifest (``manifest_problem``,
``foreign_entry``), the bytes against their digests (``split_verified``, ``check_shared``) and
installs them staged (``install``). Each function returns a ``Refusal`` saying why not, or None.
No counters and no exchanges: the protocol (``protocol.py``) counts and talks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import socket
import threading

from ..wire.once import ManifestFile, Result

_SAFE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=-]{0,255}$")


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a loading rank does not take an artifact."""

    why: str
    digest: bool = False  # a file's bytes did not match the SHA-256 its source sent


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


def collect(root: str, dirs: list[str], sources: list[str]) -> tuple[list[ManifestFile], bytes]:
    """Every file of a compile's artifact under ``root``: the files of the cache entry ``dirs``,
    and of each kernel source in ``sources`` the files that share its stem (its binaries)."""
    root = os.path.realpath(root)
    paths: list[str] = []
    for d in dirs:
        try:
            paths.extend(os.path.join(d, n) for n in sorted(os.listdir(d)) if not n.startswith("."))
        except OSError:
            continue
    for src in sources:
        d, name = os.path.split(src)
        stem = name.split(".", 1)[0]
        try:
            paths.extend(
                os.path.join(d, n)
                for n in sorted(os.listdir(d))
                if n.startswith(stem + ".") and not n.startswith(".") and not n.endswith(".lock")
            )
        except OSError:
            continue
    manifest: list[ManifestFile] = []
    chunks: list[bytes] = []
    seen: set[str] = set()
    for path in paths:
        real = os.path.realpath(path)
        rel = os.path.relpath(real, root)
        if rel in seen or rel.startswith("..") or not os.path.isfile(real):
            continue
        seen.add(rel)
        with open(real, "rb") as f:
            data = f.read()
        manifest.append(ManifestFile(rel, hashlib.sha256(data).digest(), len(data)))
        chunks.append(data)
    return manifest, b"".join(chunks)


def safe_relpath(rel: str) -> bool:
    """A path a loading rank may write under its cache dir: relative, normalized, plain names."""
    if not rel or os.path.isabs(rel) or os.path.normpath(rel) != rel:
        return False
    parts = rel.split(os.sep)
    return len(parts) <= 6 and all(_SAFE_PART.match(p) and p not in (".", "..") for p in parts)


def manifest_problem(result: Result, source: int, level: str = "aot") -> str | None:
    """Why no rank may load this artifact, whatever its bytes (None: it may, once they match)."""
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
    """A rank loads only for a key it computed itself: the artifact's entry must be under
    ``prefix`` (this rank's own entry dir, relative to its cache dir)."""
    if not any(f.relpath.startswith(prefix) for f in manifest):
        return Refusal(f"the artifact holds no entry for this rank's own key ({key})")
    top = "aotautograd" + os.sep if level == "aot" else None
    for f in manifest:
        if top is not None and f.relpath.startswith(top) and not f.relpath.startswith(prefix):
            return Refusal(f"the artifact holds an AOTAutograd entry for another key: {f.relpath}")
    return None


def unlisted_entries(root: str, prefix: str, manifest: list[ManifestFile]) -> list[str]:
    """Files under the entry dir ``prefix`` that the manifest does not list (the lookup would load them)."""
    listed = {f.relpath for f in manifest}
    try:
        names = [n for n in os.listdir(os.path.join(root, prefix)) if not n.startswith(".")]
    except OSError:
        return []
    return sorted(prefix + n for n in names if prefix + n not in listed)[:5]


def check_shared(root: str, manifest: list[ManifestFile], source: int, prefix: str) -> Refusal | None:
    """A loading rank that shares ``source``'s cache dir: the files are there, as listed."""
    extra = unlisted_entries(root, prefix, manifest)
    if extra:
        return Refusal(f"the shared cache dir holds entries for this key that rank {source} did not list: {extra}")
    for f in manifest:
        try:
            with open(os.path.join(root, f.relpath), "rb") as fh:
                data = fh.read()
        except OSError as e:
            return Refusal(f"{f.relpath} is missing from the shared cache dir ({e.strerror})")
        if hashlib.sha256(data).digest() != f.sha256:
            return Refusal(f"{f.relpath} in the shared cache dir does not match the SHA-256 rank {source} sent", True)
    return None


def split_verified(
    manifest: list[ManifestFile], data: bytes, source: int
) -> tuple[list[tuple[ManifestFile, bytes]], Refusal | None]:
    """The received bytes cut into the manifest's files, each checked against its SHA-256."""
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


def conflicts(root: str, pieces: list[tuple[ManifestFile, bytes]]) -> Refusal | None:
    """A file of the artifact that exists in this rank's cache dir with other content."""
    for f, _ in pieces:
        path = os.path.join(root, f.relpath)
        if os.path.exists(path):
            with open(path, "rb") as fh:
                if hashlib.sha256(fh.read()).digest() != f.sha256:
                    return Refusal(f"{f.relpath} exists in this rank's cache dir with other content")
    return None


def install(root: str, pieces: list[tuple[ManifestFile, bytes]]) -> Refusal | None:
    """Write every file under a hidden temporary name (torch's lookups skip those), then rename
    them all into place: on any failure nothing new is left behind. None, or why not."""
    staged: list[tuple[str, str]] = []
    try:
        for i, (f, piece) in enumerate(pieces):
            path = os.path.join(root, f.relpath)
            if os.path.exists(path):
                continue
            d = os.path.dirname(path)
            os.makedirs(d, exist_ok=True)
            tmp = os.path.join(d, f".cc-once-{os.getpid()}-{threading.get_ident()}-{i}")
            with open(tmp, "wb") as fh:
                fh.write(piece)
            staged.append((tmp, path))
    except OSError as e:
        for tmp, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return Refusal(f"could not write the artifact into this rank's cache dir: {e}")
    for tmp, path in staged:
        os.replace(tmp, path)
    return None
