"""The guard collective's seam: torch's guard-hook switch, and the C++ hook slot.

* ``eval_frame.guard_collectives_hook``: what
  ``torch.compiler.set_enable_guard_collectives(True)`` installs; ours is
  ``agreements.guard.hook``.
* ``distributed.get_guard_pg``: the group torch's switch asks for.
* ``torch._C._dynamo.eval_frame.set_guard_complete_hook``: the C++ slot. It
  cannot be read without swapping it out and back (a compiled call landing in
  between would skip the collective). While we are installed every write goes
  through ``set_guard_complete_hook`` here, which remembers what it wrote:
  reading the slot is then a plain attribute read.

It also finds torch's wrapper frames the guard collective names the frame
being entered by (``wrapper_locals``), and the switches every rank must hold
alike for the setup agreement (``setup_items``); ``wiring`` hands both over.
"""

from __future__ import annotations

import logging
from typing import Any

from ..agreements import compile_scope, compiler, guard
from . import bound, table

log = logging.getLogger("compiler_collectives.dynamo")

_slot: Any = None  # what we last wrote to the C++ guard-complete hook slot


@compile_scope.boundary
def get_guard_pg() -> Any:
    if compiler.distributed():
        return guard.group()
    return None


def set_guard_complete_hook(hook: Any) -> Any:
    """Write the C++ slot (every write while we are installed comes here); returns the previous hook."""
    global _slot
    previous = bound.originals["set_guard_complete_hook"](hook)
    _slot = hook
    return previous


def slot() -> Any:
    """What the C++ slot holds, as we last wrote it (a plain read: the slot is never touched)."""
    return _slot


def set_guard_hook(enabled: bool) -> bool:
    """Turn our guard collective on or off; returns whether a hook was set before."""
    return bool(bound.current("set_enable_guard_collectives")(enabled))


def wrapper_locals() -> dict[Any, str]:
    """Frames that call compiled code on the user's behalf, and the local naming the callee.

    torch.compile(fn) calls ``fn`` from ``compile_wrapper`` (a closure in
    eval_frame); a compiled module's forward is called from
    ``Module._call_impl`` as ``forward_call``. Missing ones only make the
    guard collective's frame identity coarser (it falls back to the caller);
    the seam table's reads say so at install, and here they are only skipped.
    """
    wrapper, callee = table.COMPILE_WRAPPER
    call = bound.originals.get("TorchDynamoContext.__call__")
    found: dict[Any, str] = dict.fromkeys(table.nested_code(call, wrapper, callee), callee)
    call_impl = bound.originals.get("Module._call_impl")
    if call_impl is not None and table.has_local(call_impl, table.FORWARD_CALL):
        found[call_impl.__code__] = table.FORWARD_CALL
    return found


def hook_active() -> bool:
    """Whether our guard hook is in the C++ slot. A plain read: the slot is never touched."""
    return bound.installed and _slot is guard.hook


def setup_items() -> dict[str, Any]:
    """Switches every rank must have alike, as they are now (for the setup agreement).

    The guard switch's entry replaces the ``COMPILER_COLLECTIVES_GUARDS``
    setting's: what counts is whether our hook is in the slot, however it got there.
    """
    return {
        "COMPILER_COLLECTIVES_GUARDS": hook_active(),
        "TORCH_COMPILER_COLLECTIVES": bool(bound.current("enable_compiler_collectives")),
        "torch._dynamo.config.automatic_dynamic_shapes": bool(bound.current("automatic_dynamic_shapes")),
    }


# The hook torch.compiler.set_enable_guard_collectives(True) installs: ours.
guard_hook = guard.hook
