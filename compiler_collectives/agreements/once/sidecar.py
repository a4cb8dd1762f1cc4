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


FX_VERSION = 1


def _fx_path(root: str, key: str) -> str:
    return os.path.join(root, "compiler_collectives", "fx", key)


def write_fx_keys(root: str, key: str | None, fx_keys: list[str]) -> None:
    """Keep the FX graph cache keys the compile of AOTAutograd key ``key`` took."""
    if key is None or not fx_keys:
        return
    where = _fx_path(root, key)
    try:
        os.makedirs(os.path.dirname(where), exist_ok=True)
        tmp = f"{where}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(pack([FX_VERSION, list(fx_keys)]))
        os.replace(tmp, where)
    except OSError as e:
        log.debug("compile once: could not keep the FX graph keys at %s: %s", where, e)


def read_fx_keys(root: str, key: str | None, rank: int) -> list[str]:
    """The FX graph cache keys kept for ``key``; [] when none (or the file is damaged)."""
    if key is None:
        return []
    where = _fx_path(root, key)
    try:
        with open(where, "rb") as f:
            data = f.read()
    except OSError:
        return []
    fail = failure("compile-once FX key file", "compile_once", rank, "compiler_collectives version")
    try:
        with reading(data, config.settings.max_payload_bytes, fail) as r:
            obj: Any = r.value()
            r.end()
        if type(obj) is not list or len(obj) != 2 or obj[0] != FX_VERSION or type(obj[1]) is not list:
            return []
        return [k for k in obj[1] if type(k) is str and 0 < len(k) <= 256 and os.sep not in k and k not in (".", "..")]
    except Exception as e:  # noqa: BLE001 - a damaged file only costs the preference
        log.debug("compile once: ignoring %s: %s", where, e)
        return []
