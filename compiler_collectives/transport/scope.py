"""Scope: which ranks make their agreements together (the ranks that run the same program).

In pipeline parallelism only the ranks of one stage (its data- and
tensor-parallel ranks) run the same program; ranks of different stages compile
different code at different times. ``compiler_collectives.scope(group)`` (or
``COMPILER_COLLECTIVES_SCOPE``) names those ranks. This module only says which
ranks a scope holds and where the choice came from; our groups (``groups``)
then span those ranks, and the agreements layer checks at the first
rendezvous that every rank of the job agrees (``agreements/scope.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

from .. import config
from ..errors import ScopeError


@dataclasses.dataclass(frozen=True)
class Scope:
    """The global ranks (sorted) that run the same program as this rank, and where that came from."""

    ranks: tuple[int, ...]
    source: str

    @property
    def key(self) -> str:
        """Equal on every rank that names the same ranks; names store keys of this scope."""
        text = ",".join(map(str, self.ranks))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def render(self) -> str:
        return render_ranks(self.ranks)

    def item(self) -> str:
        """This scope as the setup record shows it (short; the key makes it exact)."""
        return f"ranks {self.render()} #{self.key} (from {self.source})"[:500]


def render_ranks(ranks: tuple[int, ...]) -> str:
    """[0, 1, 2, 3] as "[0..3]", [0, 4, 8] as "[0, 4, 8]", long strided lists cut short."""
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}..{ranks[-1]}]"
    if len(ranks) > 8:
        step = ranks[1] - ranks[0]
        if ranks == tuple(range(ranks[0], ranks[-1] + 1, step)):
            return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] (every {step}th, {len(ranks)} ranks)"
        return "[" + ", ".join(map(str, ranks[:6])) + f", ... {len(ranks)} ranks]"
    return "[" + ", ".join(map(str, ranks)) + "]"


# (whether scope() chose under the current default group, the scope or None for the world).
_explicit: tuple[bool, Scope | None] = (False, None)


def from_group(group: Any, rank: int, world: int) -> Scope | None:
    """The scope ``group`` (a ProcessGroup, a 1-D DeviceMesh or None) gives this rank; raises ``ScopeError``."""
    chosen = None if group is None else Scope(ranks_of(group, rank), f"scope({_describe_group(group)})")
    if chosen is not None and len(chosen.ranks) == world:
        return None  # every rank: the same as no scope
    return chosen


def choose(chosen: Scope | None) -> None:
    """Remember an explicit choice (``scope()``) for the current default group (``groups``
    has noticed it): it lasts as long as that group, across ``reset()``."""
    global _explicit
    _explicit = (True, chosen)


def forget_choice() -> None:
    global _explicit
    _explicit = (False, None)


def effective(rank: int, world: int) -> Scope | None:
    """The scope this rank's agreements use now: ``scope()``'s choice, else the setting, else None."""
    if _explicit[0]:
        return _explicit[1]
    return from_setting(config.settings.scope, rank, world)


def from_setting(spec: str, rank: int, world: int) -> Scope | None:
    """The scope ``COMPILER_COLLECTIVES_SCOPE`` gives this rank (None for the whole world)."""
    if not spec:
        return None
    layout, _, stages_text = spec.partition(":")
    stages = int(stages_text)
    if world % stages:
        raise ScopeError(
            f"COMPILER_COLLECTIVES_SCOPE={spec} on rank {rank}: {world} ranks cannot form {stages} "
            "stages of equal size; set the number of pipeline stages, or call "
            "compiler_collectives.scope(stage_group) instead",
            kind="scope",
            rank=rank,
        )
    if layout == "consecutive":
        size = world // stages
        first = rank // size * size
        ranks = tuple(range(first, first + size))
    else:
        ranks = tuple(range(rank % stages, world, stages))
    if len(ranks) == world:
        return None
    return Scope(ranks, f"COMPILER_COLLECTIVES_SCOPE={spec}")


def ranks_of(group: Any, rank: int) -> tuple[int, ...]:
    import torch.distributed as dist

    mesh_type = _device_mesh_type()
    if mesh_type is not None and isinstance(group, mesh_type):
        if group.ndim != 1:
            names = getattr(group, "mesh_dim_names", None) or ()
            raise ScopeError(
                f"compiler_collectives.scope() on rank {rank}: the DeviceMesh has {group.ndim} dims"
                f"{' ' + str(tuple(names)) if names else ''}; pass the 1-D mesh of the ranks that run "
                'the same program, e.g. mesh["dp"], or a flattened sub-mesh such as '
                'mesh["dp", "tp"]._flatten()',
                kind="scope",
                rank=rank,
            )
        ranks = tuple(sorted(int(r) for r in group.mesh.flatten().tolist()))
    elif group is dist.GroupMember.NON_GROUP_MEMBER or not isinstance(group, dist.ProcessGroup):
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ScopeError(
                f"compiler_collectives.scope() on rank {rank}: the group does not contain this rank "
                "(new_group returns a placeholder to ranks outside the group); pass each rank the "
                "group of its own stage",
                kind="scope",
                rank=rank,
            )
        raise ScopeError(
            f"compiler_collectives.scope() on rank {rank}: expected a ProcessGroup, a 1-D DeviceMesh "
            f"or None, got {type(group).__name__}",
            kind="scope",
            rank=rank,
        )
    else:
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
    if rank not in ranks:
        raise ScopeError(
            f"compiler_collectives.scope() on rank {rank}: the group {render_ranks(ranks)} does not "
            "contain this rank; pass each rank the group of its own stage",
            kind="scope",
            rank=rank,
            ranks=ranks,
        )
    return ranks


def _device_mesh_type() -> type[DeviceMesh] | None:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        return None
    return DeviceMesh


def _describe_group(group: Any) -> str:
    mesh_type = _device_mesh_type()
    if mesh_type is not None and isinstance(group, mesh_type):
        names = getattr(group, "mesh_dim_names", None)
        return f"DeviceMesh {names[0]!r}" if names else "DeviceMesh"
    return "ProcessGroup"
