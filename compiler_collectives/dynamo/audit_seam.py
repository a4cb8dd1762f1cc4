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
  with its forward (``once_seam.aot_compile``, which also brackets the
  compile for compile once and keeps the cache key the user's own).

The optional levels are patched through the seam table (``bound.bind_level``)
when an audited compile first finds their modules imported (importing them at
install would add about a second to ``import compiler_collectives`` for users
of the eager backend). Their rows, reads included, are checked then; on a
torch without them the audit covers fewer levels and logs so once. The same
holds for ``_resolve_process_group`` ("audit-groups"), which names a
functional collective's group by its ranks (``group_text``).

Every seam here that torch calls leaves our code through ``compile_scope.boundary``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from .. import config
from ..agreements import audit, compile_scope, compiler, entry, entry_program
from . import bound, guard_seam, once_seam, table
from .compiler_seam import frame_of

log = logging.getLogger("compiler_collectives.dynamo")


def missing_backend_seams() -> list[str]:
    """Problems with the optional audit seams on the installed torch (imports the backend modules)."""
    return table.problems(table.optional_rows())


def _applies(output_graph: Any) -> bool:
    if not ((config.settings.audit or config.settings.compile_once) and bound.current("enable_compiler_collectives")):
        return False
    if getattr(output_graph, "export", False) or not compiler.distributed():
        return False
    # A backend call outside a frame compile (a specialization compiled at run
    # time) happens on whichever ranks take that path: no exchange there.
    if bound.originals["CompileContext"].try_get() is None:
        return False
    return torch.distributed.get_world_size() > 1


@compile_scope.boundary
def call_user_compiler(self: Any, gm: Any, example_inputs: Any) -> Any:
    original = bound.originals["call_user_compiler"]
    if not _applies(self):
        return original(self, gm, example_inputs)
    ensure_backend_seams()
    code = getattr(getattr(self, "root_tx", None), "f_code", None)
    frame = frame_of(code) if code is not None else frame_of_unknown()
    once_seam.set_frame(frame)
    try:
        if not config.settings.audit:
            return original(self, gm, example_inputs)  # compile once only: it brackets the aot compiles
        compiled, program = audit.audit_graph_program(
            frame, gm, lambda: original(self, gm, example_inputs), graph_break=graph_break_site(self)
        )
    finally:
        once_seam.set_frame(None)
    if code is None:
        return compiled
    # Entry agreement: the program of the cache entry this graph belongs to,
    # checked before the entry runs (agreements/entry.py, entry_check.py).
    lazy_graph_module = bound.originals["LazyGraphModule"]
    # Dynamo compiles a lazy GraphModule's code right after this returns, which it
    # recognises only on the unwrapped object: do it here, as it would.
    lazy = compiled if isinstance(compiled, lazy_graph_module) else getattr(compiled, "__self__", None)
    if isinstance(lazy, lazy_graph_module) and (
        lazy is compiled or getattr(compiled, "__name__", "") == "_lazy_forward"
    ):
        bound.originals["LazyGraphModule.force_recompile"](lazy)
        if lazy is not compiled:
            compiled = lazy.forward
    ctx = bound.originals["CompileContext"].try_get()
    return entry.wrap(
        compiled,
        code,
        frame,
        str(ctx.compile_id),
        ctx.attempt,
        entry_program.GraphProgram(program),
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
    from ..observations import FrameId

    return FrameId("<unknown>", "<unknown>", 0)


# The optional levels (rows of the seam table), and what the audit loses on a torch without one.
_LEVELS = {
    "aot": "the aot graphs are not audited",
    "inductor": "the inductor graphs are not audited",
    "audit-groups": "functional collectives' groups are compared by name",
    "once": "every rank compiles every graph (compile once is off)",
    "once-hit": "a loading rank's cache hit is taken for the entry it was sent, unchecked",
}


def _bind(level: str) -> None:
    problems = bound.bind_level(level)
    if problems:
        log.warning("program audit: torch %s lacks %s; %s", torch.__version__, "; ".join(problems), _LEVELS[level])


def ensure_backend_seams() -> None:
    """Bind (and patch) each optional level once its modules are imported; a level torch lacks is
    dropped with one warning."""
    if len(bound.levels) < len(_LEVELS):
        for level in _LEVELS:
            _bind(level)


@compile_scope.boundary
def aot_module_simplified(mod: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
    original = bound.originals["aot_module_simplified"]
    if rest:
        return original(mod, args, *rest, **kwargs)
    ensure_backend_seams()  # inductor's backend imports compile_fx only once called
    scope = audit.aot_scope()
    sharing = once_seam.applies()
    if scope is None and not sharing:
        return original(mod, args, **kwargs)
    if scope is not None:
        for key, stage in (
            ("fw_compiler", "forward"),
            ("inference_compiler", "inference"),
            ("bw_compiler", "backward"),
        ):
            if kwargs.get(key) is not None:
                kwargs[key] = _audited_aot_compiler(kwargs[key], scope, stage)
    return once_seam.aot_compile(lambda: original(mod, args, **kwargs), mod, args, sharing=sharing)


def _audited_aot_compiler(compiler_fn: Any, scope: Any, stage: str) -> Any:
    serializable = bound.originals["SerializableAOTDispatchCompiler"]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @compile_scope.boundary  # AOTAutograd calls it, inside the backend
        def audited_compiler(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
            return audit.aot_compile(scope, stage, gm, lambda: fn(gm, example_inputs, *args, **kwargs))

        return audited_compiler

    # Keep inductor's compiler serializable: AOTAutograd's cache only serves those.
    if isinstance(compiler_fn, serializable):
        return serializable(compiler_fn.output_code_ty, wrap(compiler_fn.compiler_fn))
    return wrap(compiler_fn)


@compile_scope.boundary
def post_grad_passes(gm: Any, *args: Any, **kwargs: Any) -> Any:
    scope = compile_scope.current()
    if scope is None:  # outside a frame compile (a backward lowered lazily): no audit record
        return bound.originals["recursive_post_grad_passes"](gm, *args, **kwargs)
    depth = scope.post_grad_depth
    scope.post_grad_depth = depth + 1
    try:
        result = bound.originals["recursive_post_grad_passes"](gm, *args, **kwargs)
    finally:
        scope.post_grad_depth = depth
    if depth == 0:  # subgraphs are walked as part of their parent
        audit.inductor_graph(gm)
    return result


@compile_scope.boundary
def group_text(group_name: Any) -> str:
    """A functional collective's group as its member ranks (names are per-process bookkeeping)."""
    if "audit-groups" not in bound.levels:
        _bind("audit-groups")
    if not bound.levels["audit-groups"]:
        return f"group {group_name!r}"
    try:
        group = bound.originals["resolve_process_group"](group_name)
        return f"ranks {list(torch.distributed.get_process_group_ranks(group))}"
    except Exception:  # noqa: BLE001 - an unknown name still compares by name
        return f"group {group_name!r}"
