"""What one rank tells the others in a compiler collective, as plain data.

``LocalState`` holds, per source name (``L['x']``), the automatic-dynamic entry
this rank observed during the preflight trace, in our own torch-independent
form (``SizeEntry``), plus any extra fields other components registered with
``register_field``. ``DistributedState`` is the per-compile box Dynamo carries
across restarts: the group, this rank's state and, after the exchange, every
rank's state in rank order.

The seams module converts between ``SizeEntry`` and Dynamo's
``FrameStateSizeEntry``; nothing here imports ``torch._dynamo``.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Callable
from typing import Any


class Marker(enum.Enum):
    """Dynamo's two non-integer values for a size, stride or scalar."""

    DYNAMIC = "dynamic"  # differs somewhere: make it symbolic
    UNSET = "unset"  # nothing observed yet (the identity of the merge)

    def __repr__(self) -> str:
        return f"Marker.{self.name}"


DYNAMIC = Marker.DYNAMIC
UNSET = Marker.UNSET


@dataclasses.dataclass(frozen=True)
class InferStride:
    """A stride equal to ``size[dim] * stride[dim]`` (contiguous next dim)."""

    dim: int


Atom = int | Marker
StrideAtom = int | Marker | InferStride


@dataclasses.dataclass(frozen=True)
class SizeEntry:
    """One source's observation; mirrors Dynamo's ``FrameStateSizeEntry``.

    ``size``/``stride`` are either a marker for the whole tuple or a tuple of
    per-dim atoms. ``excluded_sizes``/``excluded_scalar`` are bookkeeping that
    Dynamo does not compare but that we carry so nothing is lost on the wire.
    """

    scalar: Atom = UNSET
    size: Marker | tuple[Atom, ...] = UNSET
    stride: Marker | tuple[StrideAtom, ...] = UNSET
    excluded_sizes: tuple[int | None, ...] | None = None
    excluded_scalar: int | None = None

    def same_decision_as(self, other: SizeEntry) -> bool:
        """Equal in everything that drives a compile decision."""
        return self.scalar == other.scalar and self.size == other.size and self.stride == other.stride

    def render(self) -> str:
        def one(a: Any) -> str:
            if a is DYNAMIC:
                return "?"
            if a is UNSET:
                return "unset"
            if isinstance(a, InferStride):
                return f"S({a.dim})"
            return str(a)

        def many(t: Any) -> str:
            return one(t) if isinstance(t, Marker) else "[" + ", ".join(one(a) for a in t) + "]"

        if self.size is DYNAMIC and self.stride is DYNAMIC:
            return "dynamic scalar or tensor" if self.scalar is DYNAMIC else f"scalar {one(self.scalar)}"
        return f"tensor size={many(self.size)} stride={many(self.stride)}"


@dataclasses.dataclass(frozen=True)
class ExtraField:
    """A registered extra field of ``LocalState``.

    ``to_wire`` must return msgpack-native data (None, bool, int, float, str,
    bytes, list, dict with str keys); ``from_wire`` must validate what it is
    given and raise ``ValueError``/``TypeError`` on anything unexpected.
    """

    name: str
    default: Callable[[], Any]
    to_wire: Callable[[Any], Any]
    from_wire: Callable[[Any], Any]


_EXTRA_FIELDS: dict[str, ExtraField] = {}


def register_field(
    name: str,
    *,
    default: Callable[[], Any],
    to_wire: Callable[[Any], Any] = lambda v: v,
    from_wire: Callable[[Any], Any] = lambda v: v,
) -> ExtraField:
    """Add a serializable field to every ``LocalState`` (idempotent per name)."""
    if not name.isidentifier():
        raise ValueError(f"field name {name!r} must be an identifier")
    field = ExtraField(name, default, to_wire, from_wire)
    existing = _EXTRA_FIELDS.get(name)
    if existing is not None and existing != field:
        raise ValueError(f"LocalState field {name!r} is already registered differently")
    _EXTRA_FIELDS[name] = field
    return field


def unregister_field(name: str) -> None:
    _EXTRA_FIELDS.pop(name, None)


def registered_fields() -> dict[str, ExtraField]:
    return dict(_EXTRA_FIELDS)


@dataclasses.dataclass
class LocalState:
    """This rank's observations for one frame compile."""

    automatic_dynamic: dict[str, SizeEntry] = dataclasses.field(default_factory=dict)
    # True when this rank's automatic-dynamic frame state already agrees with
    # every entry above (nothing recorded yet, or the same static values), so
    # applying the exchange could not change any decision of this rank.
    frame_state_fresh: bool = True
    extras: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {n: f.default() for n, f in _EXTRA_FIELDS.items()}
    )

    def render(self) -> str:
        return "\n".join(f"{k}: {v.render()}" for k, v in self.automatic_dynamic.items())


@dataclasses.dataclass
class FrameId:
    """Identity of the frame being compiled, as it appears in messages."""

    name: str
    filename: str
    line: int

    def __str__(self) -> str:
        return f"{self.name} at {self.filename}:{self.line}"

    def key(self) -> tuple[str, str, int]:
        """The frame as ranks compare it: by its file's base name (the same script may live
        under different paths on different hosts, which is not a desync)."""
        return (self.name, os.path.basename(self.filename), self.line)


@dataclasses.dataclass
class DistributedState:
    """Shared across Dynamo's restarts of one frame compile.

    Dynamo constructs this as ``DistributedState(compile_pg, LocalState())``
    and checks ``all_states is None`` to know whether the exchange happened.
    """

    compile_pg: Any
    local_state: LocalState
    all_states: list[LocalState] | None = None
    # Filled in by the seams: where each recorded name lives in Dynamo's frame
    # state (code object, closure), so a skipped restart can still apply.
    origins: dict[str, Any] = dataclasses.field(default_factory=dict)
    frame: FrameId | None = None
    seq: int | None = None
    restart_skipped: bool = False
    # The input exchange before the first trace (see compiler_collective):
    # every rank's predicted entries for the frame's own arguments.
    early_states: list[LocalState] | None = None
    early_names: frozenset[str] = frozenset()

    def end(self) -> None:
        """The compile ended: let go of the compile group and of Dynamo's tracers.

        Dynamo's tracers hold this box and sit in reference cycles of their
        own (``origins`` adds one), freed only by a later garbage collection:
        the compile group kept here would keep the default group's store, and
        its port, open after ``destroy_process_group()`` until then.
        """
        self.compile_pg = None
        self.origins.clear()
