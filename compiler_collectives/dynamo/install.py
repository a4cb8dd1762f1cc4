"""Install and uninstall: check every row of the seam table, then swap our implementation in.

``install()`` is transactional: every required row is resolved and its
fragile reads checked first (``check_seams``), and every problem is reported
in one ``UnsupportedTorchError``; only then is torch patched and the layers
wired together (``wiring.wire``), and a failure on the way puts back what was
already replaced. Its one caller is the package's composition root
(``runtime.install``), which hands it the moments the seams run. ``uninstall()`` puts torch's originals back (tests, and
autoload's clean-up after a failure).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from .. import config
from ..agreements import guard
from ..errors import UnsupportedTorchError
from . import bound, guard_seam, table, wiring

log = logging.getLogger("compiler_collectives.dynamo")

# The torch releases this package supports, [from, to) as (major, minor),
# matching pyproject's requirement; CI runs the suite on each of TESTED_TORCH.
SUPPORTED_TORCH = ((2, 13), (2, 16))
TESTED_TORCH = ("2.13.0", "2.14.1", "2.15.0")


def supported_range() -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TORCH
    return f"torch {lo_major}.{lo_minor} to {hi_major}.{hi_minor - 1} (tested: {', '.join(TESTED_TORCH)})"


def version_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed torch) is a release in ``SUPPORTED_TORCH``.

    Only major.minor counts: 2.16.0a0 nightlies are 2.16, outside the range.
    """
    m = re.match(r"(\d+)\.(\d+)", str(torch.__version__ if version is None else version))
    if m is None:
        return False
    release = (int(m.group(1)), int(m.group(2)))
    return SUPPORTED_TORCH[0] <= release < SUPPORTED_TORCH[1]


def missing_seams() -> list[str]:
    """Every problem with the required rows of the seam table on the installed torch, one line each."""
    return table.problems(table.required_rows())


def check_seams() -> list[str]:
    """Raise ``UnsupportedTorchError`` naming every problem; returns the degradations (warnings)."""
    problems, degraded = table.check(table.required_rows())
    fix = f"It supports {supported_range()}; install one of those, e.g. torch=={TESTED_TORCH[-1]}."
    if problems:
        raise UnsupportedTorchError(
            f"compiler_collectives cannot hook into torch {torch.__version__}: {len(problems)} Dynamo "
            f"seam(s) missing or changed: {'; '.join(problems)}. Nothing was patched. {fix}"
        )
    if not version_supported():
        raise UnsupportedTorchError(
            f"compiler_collectives does not support torch {torch.__version__}: the Dynamo "
            f"internals it replaces are only known to match in the supported releases. {fix}"
        )
    return degraded


def _resolve_required() -> dict[str, Any]:
    """Torch's object of every required row; a missing one whose reads all only degrade is left out."""
    found: dict[str, Any] = {}
    for row in table.required_rows():
        try:
            found[row.name] = table.resolve(row)
        except (ImportError, AttributeError):
            if not (row.reads and all(read.degrades for read in row.reads)):
                raise
    return found


def install(moments: bound.Moments) -> None:
    """Swap our implementation in and wire the layers together (idempotent); ``moments`` are
    what our replacements of torch's reset and destroy run (the package runtime's)."""
    if bound.installed:
        return
    degraded = check_seams()
    try:
        originals = _resolve_required()
        replacements = {row.name: bound.replacement(row, originals[row.name]) for row in table.patched_rows()}
    except Exception as e:
        raise UnsupportedTorchError(
            f"compiler_collectives cannot hook into torch {torch.__version__}: reading its Dynamo "
            f"internals failed ({type(e).__name__}: {e}). Nothing was patched. It supports "
            f"{supported_range()}; install one of those."
        ) from e
    for line in degraded:
        log.warning("torch %s: %s", torch.__version__, line)
    done: list[table.Seam] = []
    try:
        bound.originals.update(originals)
        for row in table.patched_rows():
            bound.patch(row, replacements[row.name])
            done.append(row)
        wiring.wire(moments)
        # If torch's own guard hook is active (set_enable_guard_collectives was
        # called before we were imported), keep guard collectives on, but ours.
        # The one read of the slot that has to swap it: at install, before any
        # compiled call of ours can run.
        previous = originals["set_guard_complete_hook"](None)
        if previous is originals["guard_collectives_hook"] or config.settings.guards:
            guard_seam.set_guard_complete_hook(guard.hook)
        else:
            guard_seam.set_guard_complete_hook(previous)
    except BaseException:
        wiring.unwire()
        bound.unbind_levels()
        for row in reversed(done):
            bound.unpatch(row)
        raise
    bound.installed = True
    log.debug("installed into torch %s", torch.__version__)


def uninstall() -> None:
    """Restore torch's originals, the C++ hook slot included (tests)."""
    if not bound.installed:
        return
    current = guard_seam.slot()
    wiring.unwire()
    bound.unbind_levels()
    for row in reversed(table.patched_rows()):
        bound.unpatch(row)
    if current is guard.hook:
        bound.originals["set_guard_complete_hook"](bound.originals["guard_collectives_hook"])
    bound.installed = False


def installed() -> bool:
    return bound.installed
