"""Compile once's audit sidecar: the program audit's fingerprints of a cached compile, kept
beside its cache entry (``<cache dir>/compiler_collectives/audit/<key>``), so that a rank whose
cache is warm can serve them with the entry, and a rank that loaded one audits it as its own.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ... import config
from ..fingerprint import GraphFingerprint
from ..wire.codec import failure, pack, reading
from ..wire.once import fingerprint_in, fingerprint_out

log = logging.getLogger("compiler_collectives.once")

SIDECAR_VERSION = 1


def path(root: str, key: str | None) -> str | None:
    if key is None:
        return None
    return os.path.join(root, "compiler_collectives", "audit", key)


def write(root: str, key: str | None, fingerprints: list[GraphFingerprint]) -> None:
    """Keep the fingerprints with the cache entry, so that this rank can serve them when warm."""
    where = path(root, key)
    if where is None or not fingerprints:
        return
    try:
        os.makedirs(os.path.dirname(where), exist_ok=True)
        tmp = f"{where}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(pack([SIDECAR_VERSION, [fingerprint_out(g) for g in fingerprints]]))
        os.replace(tmp, where)
    except OSError as e:
        log.debug("compile once: could not keep the audit's fingerprints at %s: %s", where, e)


def read(root: str, key: str | None, rank: int) -> list[GraphFingerprint]:
    """The fingerprints kept for ``key``; [] when there are none or the file is damaged."""
    where = path(root, key)
    if where is None:
        return []
    try:
        with open(where, "rb") as f:
            data = f.read()
    except OSError:
        return []
    fail = failure("compile-once fingerprint file", "compile_once", rank, "compiler_collectives version")
    try:
        with reading(data, config.settings.max_payload_bytes, fail) as r:
            obj: Any = r.value()
            r.end()
        if type(obj) is not list or len(obj) != 2 or obj[0] != SIDECAR_VERSION or type(obj[1]) is not list:
            return []
        return [fingerprint_in(g) for g in obj[1]]
    except Exception as e:  # noqa: BLE001 - a damaged file only costs the audit's comparison
        log.debug("compile once: ignoring %s: %s", where, e)
        return []
