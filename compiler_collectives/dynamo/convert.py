"""Conversion between our ``SizeEntry`` and Dynamo's ``FrameStateSizeEntry``.

Our observation types (``compiler_collectives.observations``) are plain
Python and travel as msgpack; Dynamo's live in ``torch._dynamo.pgo``. The
markers map one to one: ``auto_dynamic`` <-> ``DYNAMIC``, ``auto_unset`` <-> ``UNSET``,
``InferStride`` <-> ``InferStride``.
"""

from __future__ import annotations

from typing import Any

from ..observations import DYNAMIC, UNSET, InferStride, Marker, SizeEntry
from . import bound


def _atom_from_torch(a: Any) -> Any:
    pgo = bound.originals
    if a is pgo["auto_dynamic"]:
        return DYNAMIC
    if a is pgo["auto_unset"]:
        return UNSET
    if isinstance(a, pgo["InferStride"]):
        return InferStride(a.dim)
    return int(a)


def _part_from_torch(p: Any) -> Any:
    if isinstance(p, tuple):
        return tuple(_atom_from_torch(a) for a in p)
    return _atom_from_torch(p)


def entry_from_torch(e: Any) -> SizeEntry:
    return SizeEntry(
        scalar=_atom_from_torch(e.scalar),
        size=_part_from_torch(e.size),
        stride=_part_from_torch(e.stride),
        excluded_sizes=None if e.excluded_sizes is None else tuple(e.excluded_sizes),
        excluded_scalar=e.excluded_scalar,
    )


def _atom_to_torch(a: Any) -> Any:
    pgo = bound.originals
    if a is DYNAMIC:
        return pgo["auto_dynamic"]
    if a is UNSET:
        return pgo["auto_unset"]
    if isinstance(a, InferStride):
        return pgo["InferStride"](a.dim)
    return a


def _part_to_torch(p: Any) -> Any:
    if isinstance(p, Marker):
        return _atom_to_torch(p)
    return tuple(_atom_to_torch(a) for a in p)


def entry_to_torch(e: SizeEntry) -> Any:
    return bound.originals["FrameStateSizeEntry"](
        scalar=_atom_to_torch(e.scalar),
        size=_part_to_torch(e.size),
        stride=_part_to_torch(e.stride),
        excluded_sizes=e.excluded_sizes,
        excluded_scalar=e.excluded_scalar,
    )
