"""Compile once's sidecars, kept in the cache dir beside torch's entries:

* the program audit's fingerprints of a cached compile (``<cache dir>/compiler_collectives/
  audit/<key>``), so that a rank whose cache is warm can serve them with the entry, and a rank
  that loaded one audits it as its own;
* the FX graph cache keys an AOTAutograd key's compile took (``.../fx/<key>``), so that where no
  rank holds the AOTAutograd entry, a rank whose FX graph cache still holds those compiles is the
  one that compiles (``WARMTH_FX``).
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


FX_VERSION = 1


def path(root: str, key: str | None, kind: str = "audit") -> str | None:
    """Where the sidecar of ``kind`` ("audit" or "fx") for ``key`` lives under cache dir ``root``."""
    if key is None:
        return None
    return os.path.join(root, "compiler_collectives", kind, key)


def _write(where: str | None, version: int, items: list[Any], what: str) -> None:
    """``[version, items]`` at ``where``, atomically; a failure only costs what it would have kept."""
    if where is None or not items:
        return
    try:
        os.makedirs(os.path.dirname(where), exist_ok=True)
        tmp = f"{where}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(pack([version, items]))
        os.replace(tmp, where)
    except OSError as e:
        log.debug("compile once: could not keep %s at %s: %s", what, where, e)


def _read(where: str | None, version: int, rank: int, what: str) -> list[Any]:
    """The items of a sidecar written by ``_write``; [] when absent, of another version or damaged."""
    if where is None:
        return []
    try:
        with open(where, "rb") as f:
            data = f.read()
    except OSError:
        return []
    fail = failure(f"compile-once {what} file", "compile_once", rank, "compiler_collectives version")
    try:
        with reading(data, config.settings.max_payload_bytes, fail) as r:
            obj: Any = r.value()
            r.end()
    except Exception as e:  # noqa: BLE001 - a damaged file only costs what it kept
        log.debug("compile once: ignoring %s: %s", where, e)
        return []
    if type(obj) is not list or len(obj) != 2 or obj[0] != version or type(obj[1]) is not list:
        return []
    items: list[Any] = obj[1]
    return items


def write(root: str, key: str | None, fingerprints: list[GraphFingerprint]) -> None:
    """Keep the fingerprints with the cache entry, so that this rank can serve them when warm."""
    _write(path(root, key), SIDECAR_VERSION, [fingerprint_out(g) for g in fingerprints], "the audit's fingerprints")


def read(root: str, key: str | None, rank: int) -> list[GraphFingerprint]:
    """The fingerprints kept for ``key``; [] when there are none or the file is damaged."""
    try:
        return [fingerprint_in(g) for g in _read(path(root, key), SIDECAR_VERSION, rank, "fingerprint")]
    except Exception as e:  # noqa: BLE001 - a damaged file only costs the audit's comparison
        log.debug("compile once: ignoring the fingerprints kept for %s: %s", key, e)
        return []


def write_fx_keys(root: str, key: str | None, fx_keys: list[str]) -> None:
    """Keep the FX graph cache keys the compile of AOTAutograd key ``key`` took."""
    _write(path(root, key, "fx"), FX_VERSION, list(fx_keys), "the FX graph keys")


def read_fx_keys(root: str, key: str | None, rank: int) -> list[str]:
    """The FX graph cache keys kept for ``key``; [] when none (or the file is damaged)."""
    items = _read(path(root, key, "fx"), FX_VERSION, rank, "FX key")
    return [k for k in items if type(k) is str and 0 < len(k) <= 256 and os.sep not in k and k not in (".", "..")]
