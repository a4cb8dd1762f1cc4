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

It also tells the guard collective how to name the frame being entered
(torch's wrapper frames, ``frame_sources``) and how to see whether torch's
profiler is on, and registers the switches every rank must hold alike with
the setup agreement.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..agreements import compiler, guard, setup
from . import bound

log = logging.getLogger("compiler_collectives.dynamo")

_slot: Any = None  # what we last wrote to the C++ guard-complete hook slot


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
    return bool(torch.compiler.set_enable_guard_collectives(enabled))


def wrapper_locals() -> dict[Any, str]:
    """Frames that call compiled code on the user's behalf, and the local naming the callee.

    torch.compile(fn) calls ``fn`` from ``compile_wrapper`` (a closure in
    eval_frame); a compiled module's forward is called from
    ``Module._call_impl`` as ``forward_call``. Missing ones only make the
    guard collective's frame identity coarser (it falls back to the caller);
    the seam table's reads say so at install.
    """
    import torch._dynamo.eval_frame as eval_frame

    found: dict[Any, str] = {}
    # The seam table's reads warn at install when these are gone; here a
    # missing one is only skipped.
    call = getattr(eval_frame._TorchDynamoContext.__call__, "__code__", None)
    pending = [] if call is None else [call]
    while pending:
        code = pending.pop()
        for const in code.co_consts:
            if isinstance(const, type(code)):
                if const.co_name == "compile_wrapper" and "fn" in const.co_freevars:
                    found[const] = "fn"
                pending.append(const)
    call_impl = torch.nn.Module._call_impl.__code__
    if "forward_call" in call_impl.co_varnames + call_impl.co_cellvars:
        found[call_impl] = "forward_call"
    return found


def connect(orig_code_map: Any) -> None:
    """At install: tell the guard collective how to name frames and see the profiler."""
    import torch.autograd.profiler as profiler

    guard.set_frame_sources(wrapper_locals(), lambda code: code in orig_code_map)
    if isinstance(getattr(profiler, "_is_profiler_enabled", None), bool):
        guard.set_profiler_probe(lambda: profiler._is_profiler_enabled)


def hook_active() -> bool:
    """Whether our guard hook is in the C++ slot. A plain read: the slot is never touched."""
    return bound.installed and _slot is guard.hook


def setup_items() -> dict[str, Any]:
    """Switches every rank must have alike, as they are now (for the setup agreement).

    The guard switch's entry replaces the ``COMPILER_COLLECTIVES_GUARDS``
    setting's: what counts is whether our hook is in the slot, however it got there.
    """
    dynamo_config = torch._dynamo.config
    return {
        "COMPILER_COLLECTIVES_GUARDS": hook_active(),
        "TORCH_COMPILER_COLLECTIVES": bool(dynamo_config.enable_compiler_collectives),
        "torch._dynamo.config.automatic_dynamic_shapes": bool(dynamo_config.automatic_dynamic_shapes),
    }


setup.register_source(setup_items)


# The hook torch.compiler.set_enable_guard_collectives(True) installs: ours.
guard_hook = guard.hook
