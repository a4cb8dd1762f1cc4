"""The program audit's seams: every graph Dynamo hands to a backend, and what AOTAutograd and inductor derive from it.

* ``OutputGraph.call_user_compiler`` (required): the Dynamo graph, and the
  backend call that ``agreements.audit`` wraps in a record.
* ``backends.common.aot_module_simplified`` with
  ``SerializableAOTDispatchCompiler`` (optional, "aot"): AOTAutograd's
  forward, inference and backward compilers, wrapped so each graph is
  fingerprinted.
* ``compile_fx._recursive_post_grad_passes`` (optional, "inductor"):
  inductor's post-grad graphs.
* ``torch._functorch.config.force_non_lazy_backward_lowering`` (required):
  set around an audited AOTAutograd compile, so that its backward is lowered
  with its forward.

The optional levels are patched when an audited compile first finds their
modules imported (importing them at install would add about a second to
``import compiler_collectives`` for users of the eager backend). Their rows
in the seam table, reads included, are checked then; on a torch without them
the audit covers fewer levels and logs so once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import config
from ..agreements import audit, compiler, entry, fingerprint
from . import bound, guard_seam, table, tooling
from .compiler_seam import frame_of

log = logging.getLogger("compiler_collectives.dynamo")

_backends: dict[str, bool] = {}  # "aot"/"inductor" -> patched (False: seam missing)
_post_grad = threading.local()  # depth: post-grad passes recurse into subgraphs through our wrapper


def missing_backend_seams() -> list[str]:
    """Problems with the optional audit seams on the installed torch (imports the backend modules)."""
    return table.problems(table.optional_rows())


def _applies(output_graph: Any) -> bool:
    if not (config.settings.audit and torch._dynamo.config.enable_compiler_collectives):
        return False
    if getattr(output_graph, "export", False) or not compiler.distributed():
        return False
    from torch._guards import CompileContext

    # A backend call outside a frame compile (a specialization compiled at run
    # time) happens on whichever ranks take that path: no exchange there.
    if CompileContext.try_get() is None:
        return False
    return torch.distributed.get_world_size() > 1


def call_user_compiler(self: Any, gm: Any, example_inputs: Any) -> Any:
    original = bound.originals["call_user_compiler"]
    if not _applies(self):
        return original(self, gm, example_inputs)
    ensure_backend_seams()
    code = getattr(getattr(self, "root_tx", None), "f_code", None)
    frame = frame_of(code) if code is not None else frame_of_unknown()
    compiled, program = audit.audit_graph_program(
        frame, gm, lambda: original(self, gm, example_inputs), graph_break=graph_break_site(self)
    )
    if code is None:
        return compiled
    # Entry agreement: the program of the cache entry this graph belongs to,
    # checked before the entry runs (agreements/entry.py).
    from torch._guards import CompileContext
    from torch.fx._lazy_graph_module import _LazyGraphModule

    # Dynamo compiles a lazy GraphModule's code right after this returns, which it
    # recognises only on the unwrapped object: do it here, as it would.
    lazy = compiled if isinstance(compiled, _LazyGraphModule) else getattr(compiled, "__self__", None)
    if isinstance(lazy, _LazyGraphModule) and (
        lazy is compiled or getattr(compiled, "__name__", "") == "_lazy_forward"
    ):
        _LazyGraphModule.force_recompile(lazy)
        if lazy is not compiled:
            compiled = lazy.forward
    ctx = CompileContext.try_get()
    return entry.wrap(
        compiled,
        code,
        frame,
        str(ctx.compile_id),
        ctx.attempt,
        entry.GraphProgram(program),
        check=config.settings.entry_check and guard_seam.hook_active(),
    )


def graph_break_site(output_graph: Any) -> str | None:
    """Where this graph's trace broke the frame ("file.py:18 (reason)"), None if it runs to the end.

    ``OutputGraph.compile_subgraph`` records why it compiles (seam table rows
    ``compile_subgraph`` and ``GraphCompileReason``); the user frame is the last of its stack.
    """
    reason = getattr(output_graph, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    stack = getattr(reason, "user_stack", None) or []
    where = f"{os.path.basename(stack[-1].filename)}:{stack[-1].lineno}" if stack else "?"
    text = str(getattr(reason, "reason", "")).strip().splitlines()
    return f"{where} ({text[0][:200]})" if text else where


def frame_of_unknown() -> Any:
    from ..state import FrameId

    return FrameId("<unknown>", "<unknown>", 0)


def _patch_backend(level: str, module_name: str) -> Any:
    """The module if every row of ``level`` resolves and reads as expected, else None (logged once)."""
    module = sys.modules.get(module_name)
    if module is None:
        return None
    problems = table.problems(table.optional_rows(level))
    if problems:
        _backends[level] = False
        log.warning(
            "program audit: torch %s lacks %s; the %s graphs are not audited",
            torch.__version__,
            "; ".join(problems),
            level,
        )
        return None
    _backends[level] = True
    return module


def ensure_backend_seams() -> None:
    if len(_backends) == 2:
        return
    if "aot" not in _backends:
        common = _patch_backend("aot", "torch._dynamo.backends.common")
        if common is not None:
            from torch._functorch.aot_autograd import SerializableAOTDispatchCompiler

            bound.originals["aot_module_simplified"] = common.aot_module_simplified
            bound.originals["SerializableAOTDispatchCompiler"] = SerializableAOTDispatchCompiler
            common.aot_module_simplified = aot_module_simplified
    if "inductor" not in _backends:
        compile_fx = _patch_backend("inductor", "torch._inductor.compile_fx")
        if compile_fx is not None:
            bound.originals["recursive_post_grad_passes"] = compile_fx._recursive_post_grad_passes
            compile_fx._recursive_post_grad_passes = post_grad_passes


def aot_module_simplified(mod: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
    original = bound.originals["aot_module_simplified"]
    scope = audit.aot_scope() if not rest else None
    if scope is None:
        return original(mod, args, *rest, **kwargs)
    ensure_backend_seams()  # inductor's backend imports compile_fx only once called
    for key, stage in (("fw_compiler", "forward"), ("inference_compiler", "inference"), ("bw_compiler", "backward")):
        if kwargs.get(key) is not None:
            kwargs[key] = _audited_aot_compiler(kwargs[key], scope, stage)
    # Lower the backward with the forward: its program is then part of this
    # compile's one exchange, on every rank, and of the cache entry's program
    # (agreements/entry.py). Lowered lazily, it would compile at its first
    # backward only on the ranks that run it, maybe in another entry.
    with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        return original(mod, args, **kwargs)


def _audited_aot_compiler(compiler_fn: Any, scope: Any, stage: str) -> Any:
    serializable = bound.originals["SerializableAOTDispatchCompiler"]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def audited_compiler(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
            return audit.aot_compile(scope, stage, gm, lambda: fn(gm, example_inputs, *args, **kwargs))

        return audited_compiler

    # Keep inductor's compiler serializable: AOTAutograd's cache only serves those.
    if isinstance(compiler_fn, serializable):
        return serializable(compiler_fn.output_code_ty, wrap(compiler_fn.compiler_fn))
    return wrap(compiler_fn)


def post_grad_passes(gm: Any, *args: Any, **kwargs: Any) -> Any:
    depth = getattr(_post_grad, "depth", 0)
    _post_grad.depth = depth + 1
    try:
        result = bound.originals["recursive_post_grad_passes"](gm, *args, **kwargs)
    finally:
        _post_grad.depth = depth
    if depth == 0:  # subgraphs are walked as part of their parent
        audit.inductor_graph(gm)
    return result


def group_text(group_name: Any) -> str:
    """A functional collective's group as its member ranks (names are per-process bookkeeping)."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group, get_process_group_ranks

        return f"ranks {list(get_process_group_ranks(_resolve_process_group(group_name)))}"
    except Exception:  # noqa: BLE001 - an unknown name still compares by name
        return f"group {group_name!r}"


def install() -> None:
    fingerprint.set_group_resolver(group_text)
    audit.set_artifact_sink(tooling.emit_artifact)


def uninstall() -> None:
    if _backends.get("aot"):
        import torch._dynamo.backends.common as common

        common.aot_module_simplified = bound.originals["aot_module_simplified"]
    if _backends.get("inductor"):
        import torch._inductor.compile_fx as compile_fx

        compile_fx._recursive_post_grad_passes = bound.originals["recursive_post_grad_passes"]
    _backends.clear()
    fingerprint.set_group_resolver(None)
    audit.set_artifact_sink(None)
