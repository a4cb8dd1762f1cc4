"""Torch's internals as the seam modules use them: every one resolved from a row of the seam table.

The one way the seam modules read torch's internals:

* ``originals[name]``: torch's object of row ``name`` (a function, a class,
  a logger), bound when install resolves the required rows, or when an
  optional level is bound (``bind_level``). Before install it is empty:
  nothing here runs before install.
* ``current(name)``: the row's attribute as it is now, for values that change
  (a config flag); ``set_current`` and ``config_patch`` write one.

``patch``/``unpatch`` swap a row's replacement in and out; install uses them
for the required rows, ``bind_level`` for an optional level's.

``moments``: what our replacements of torch's reset and destroy run of ours,
the package runtime's moments, handed in at install (``wiring.wire``): the
seams may not import the layer above them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from collections.abc import Callable
from typing import Any

from . import table

# Whether our implementation is swapped into torch now.
installed = False
# Torch's own object for every seam we replaced or read, by seam name.
originals: dict[str, Any] = {}
# Optional levels looked at so far: True once bound (and patched), False when torch lacks them.
levels: dict[str, bool] = {}


@dataclasses.dataclass(frozen=True)
class Moments:
    """The runtime's moments that torch's own reset and destroy run (``runtime.py`` has them)."""

    torch_reset: Callable[[], None]  # torch.compiler.reset() (compiler_seam.wrap_reset)
    default_group_ending: Callable[[], None]  # before destroy_process_group() (c10d_seam)
    default_group_destroyed: Callable[[], None]  # after it (c10d_seam)


def _nothing() -> None:
    """No moment: nothing of ours is patched into torch before install hands the real ones in."""


moments = Moments(_nothing, _nothing, _nothing)


def original(name: str) -> Any:
    """Torch's own object that seam ``name`` replaced; KeyError before install or for an unknown name."""
    return originals[name]


def current(name: str) -> Any:
    """Row ``name``'s attribute as it is now (a config flag): read through the table, live."""
    return table.resolve(table.named(name))


def set_current(name: str, value: Any) -> None:
    """Write row ``name``'s attribute (a config flag)."""
    owner, attr = table.place(table.named(name))
    setattr(owner, attr, value)


def config_patch(name: str, value: Any) -> contextlib.AbstractContextManager[Any]:
    """Torch's own ``config.patch`` of row ``name``'s flag: ``value`` inside, the old value after."""
    owner, attr = table.place(table.named(name))
    patcher: contextlib.AbstractContextManager[Any] = owner.patch(**{attr: value})
    return patcher


def replacement(row: table.Seam, original_obj: Any) -> Any:
    """Our replacement of ``row`` (built from torch's object for a ``factory`` row)."""
    assert row.replace is not None
    module_name, name = row.replace.split(":")
    module = importlib.import_module(f"{__package__}.{module_name}")
    fn = getattr(module, name)
    return fn(original_obj) if row.factory else fn


def patch(row: table.Seam, ours: Any) -> None:
    owner, attr = table.place(row)
    setattr(owner, attr, ours)


def unpatch(row: table.Seam) -> None:
    """Put torch's own object of ``row`` back."""
    owner, attr = table.place(row)
    setattr(owner, attr, originals[row.name])


def bind_level(level: str) -> list[str] | None:
    """Bind the optional rows of ``level``, and patch those with a replacement, once every
    module they patch is imported (importing them here would cost every user of the
    eager backend about a second).

    Returns None when nothing changed (a module not imported yet, or the level
    looked at before), [] when the level was bound now, or the problems with
    its rows on this torch: the level then stays unpatched for good.
    """
    if level in levels:
        return None
    rows = table.optional_rows(level)
    if any(r.replace is not None and r.module not in sys.modules for r in rows):
        return None
    problems, degraded = table.check(rows)
    problems += degraded  # an optional level is whole or not at all
    if problems:
        levels[level] = False
        return problems
    found = {r.name: table.resolve(r) for r in rows}
    originals.update(found)
    for r in rows:
        if r.replace is not None:
            patch(r, replacement(r, found[r.name]))
    levels[level] = True
    return []


def unbind_levels() -> None:
    """Put back what ``bind_level`` patched; levels are looked at again after the next install."""
    for level, bound_now in levels.items():
        if bound_now:
            for r in table.optional_rows(level):
                if r.replace is not None:
                    unpatch(r)
    levels.clear()
