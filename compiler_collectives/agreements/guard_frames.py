"""Which compiled frame a guard call is for: an id equal across ranks for the same frame.

The guard hook is not told which frame it guards, and that frame is not on
the Python stack yet. Its caller is: torch's compile wrapper (whose local
``fn`` is the compiled function), ``Module._call_impl`` (whose local
``forward_call`` is the forward being compiled), or plain Python code that
calls the compiled frame directly (a resume function after a graph break, a
nested function). The Dynamo seam names the first two, and which code objects
are Dynamo's output, through ``torch_view``.

``frame_identity`` runs on the hook's path whenever the channel checks for a
desync: each code object is classified once and cached (bounded).
``in_compiled_code`` tells whether a call comes from inside compiled code.
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch

from .. import torch_view

# Frames under torch's own directory are torch's: skipped when looking for the caller.
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


# code -> ("wrapper", local name) | ("torch", None) | ("code", (crc, use f_lasti))
_code_kinds: dict[Any, tuple[str, Any]] = {}


def forget_code_kinds() -> None:
    """A new torch view (install): code objects are classified again against its wrapper frames."""
    _code_kinds.clear()


_stable_ids: dict[Any, int] = {}


def _stable_id(code: Any) -> int:
    ident = _stable_ids.get(code)
    if ident is None:
        text = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}:{code.co_name}"
        ident = zlib.crc32(text.encode())
        if len(_stable_ids) > 4096:
            _stable_ids.clear()
        _stable_ids[code] = ident
    return ident


def _classify(code: Any) -> tuple[str, Any]:
    wrapper_locals = torch_view.view.wrapper_locals
    if code in wrapper_locals:
        kind: tuple[str, Any] = ("wrapper", wrapper_locals[code])
    elif code.co_filename.startswith(TORCH_DIR):
        kind = ("torch", None)
    else:
        # Dynamo's rewritten bytecode may differ between cache entries: leave
        # f_lasti out for it and keep only the function's identity.
        kind = ("code", (_stable_id(code), not torch_view.view.is_dynamo_output_code(code)))
    if len(_code_kinds) > 4096:
        _code_kinds.clear()
    _code_kinds[code] = kind
    return kind


def _target_code(obj: Any) -> Any:
    code = getattr(obj, "__code__", None)
    if code is None:
        code = getattr(getattr(obj, "__func__", None), "__code__", None)
    return code


def frame_identity(frame: Any) -> int:
    """A 46-bit id of the compiled frame being entered, equal across ranks for the same frame."""
    while frame is not None:
        code = frame.f_code
        kind, detail = _code_kinds.get(code) or _classify(code)
        if kind == "wrapper":
            target = _target_code(frame.f_locals.get(detail))
            if target is not None:
                return (_stable_id(target) << 14) & 0x3FFFFFFFFFFF
        elif kind == "code":
            crc, with_lasti = detail
            ident: int = ((crc << 14) + (frame.f_lasti & 0x3FFF if with_lasti else 0)) & 0x3FFFFFFFFFFF
            return ident
        frame = frame.f_back
    return 0


def in_compiled_code(frame: Any) -> bool:
    """Whether ``frame`` or a frame below it runs Dynamo's output code (a compiled frame's bytecode)."""
    depth = 0
    while frame is not None and depth < 512:
        if torch_view.view.is_dynamo_output_code(frame.f_code):
            return True
        frame = frame.f_back
        depth += 1
    return False
