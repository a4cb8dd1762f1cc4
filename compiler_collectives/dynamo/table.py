"""The seam table: every torch internal this package replaces or relies on, one row each.

A row names the torch attribute (module and attribute path), our
replacement (a function in one of the seam modules here, or None for an
internal we only read), whether it is required, and the fragile reads the
seam relies on beyond the attribute's existence: a positional layout, keyword
names, a tracer attribute, a code object's constants. ``install`` checks every
required row, reads included, before anything is patched, and reports every
problem in one ``UnsupportedTorchError``; the seam modules then read torch
only through ``bound`` (``bound.originals[name]``, or ``bound.current(name)``
for a value such as a config flag), which resolves each row here. Optional
rows (the audit's AOTAutograd and inductor levels, and its group names) are
checked, reads included, and patched where they have a replacement, when an
audited compile first finds their modules imported (``bound.bind_level``); a
problem there drops that level with one warning. A read marked ``degrades``
only makes a feature coarser when it fails: install logs a warning saying
what, and goes on.

Tests check the table against torch (every supported release in CI), against
the code (every seam module's replacements are rows), and against
docs/design.md (every row is listed there).
"""

from __future__ import annotations

import dataclasses
import dataclasses as _dc
import importlib
import inspect
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Read:
    """Something about a torch object that a seam relies on: ``check(obj)`` is True when it holds."""

    what: str
    check: Callable[[Any], bool]
    # Set when a failed read only makes a feature coarser: what the user loses.
    degrades: str = ""


@dataclasses.dataclass(frozen=True)
class Seam:
    name: str  # our key for it (``bound.originals[name]`` is torch's object)
    module: str
    path: str  # attribute path inside ``module``
    # "seam_module:function" in this package; with ``factory`` the function is
    # called with torch's original and returns the replacement. None: read only.
    replace: str | None = None
    factory: bool = False
    required: bool = True
    level: str = ""  # optional rows: the audit level they serve ("aot", "inductor")
    reads: tuple[Read, ...] = ()


# ------------------------------------------------------------ read checks


def _params(obj: Any) -> list[str]:
    return list(inspect.signature(obj).parameters)


def _positional(*names: str) -> Callable[[Any], bool]:
    return lambda obj: _params(obj)[: len(names)] == list(names)


def _required(obj: Any) -> list[str]:
    """The parameters a call must pass."""
    return [
        n
        for n, p in inspect.signature(obj).parameters.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


def _keywords(*names: str) -> Callable[[Any], bool]:
    return lambda obj: set(names) <= set(_params(obj))


def _fields(*names: str) -> Callable[[Any], bool]:
    return lambda cls: [f.name for f in _dc.fields(cls)][: len(names)] == list(names)


def _fields_within(*ours: str) -> Callable[[Any], bool]:
    """Torch's dataclass has no field beyond ``ours``: our replacement carries all Dynamo reads of it."""
    return lambda cls: {f.name for f in _dc.fields(cls)} <= set(ours)


def _sets_attributes(*names: str) -> Callable[[Any], bool]:
    """The class's ``__init__`` assigns these attributes (they are in its code's names)."""
    return lambda cls: set(names) <= set(cls.__init__.__code__.co_names)


def nested_code(fn: Any, name: str, freevar: str) -> list[Any]:
    """The code objects named ``name`` with the free variable ``freevar``, nested at any depth in ``fn``'s code.

    Empty when ``fn`` has no code of its own (a C function, a ``functools.partial``).
    """
    top = getattr(fn, "__code__", None)
    found: list[Any] = []
    pending = [] if top is None else [top]
    while pending:
        code = pending.pop()
        for const in code.co_consts:
            if isinstance(const, type(code)):
                if const.co_name == name and freevar in const.co_freevars:
                    found.append(const)
                pending.append(const)
    return found


def has_local(fn: Any, name: str) -> bool:
    """Whether ``fn``'s code has a local (or cell) variable ``name``."""
    code = fn.__code__
    return name in code.co_varnames + code.co_cellvars


def _has_nested_code(name: str, freevar: str) -> Callable[[Any], bool]:
    return lambda fn: bool(nested_code(fn, name, freevar))


def _has_local(name: str) -> Callable[[Any], bool]:
    return lambda fn: has_local(fn, name)


def _takes_name_and_metadata(fn: Any) -> bool:
    params = list(inspect.signature(fn).parameters.values())
    return len(params) == 2 and params[0].name == "event_name" and params[1].kind is inspect.Parameter.VAR_KEYWORD


def _is_bool(obj: Any) -> bool:
    return isinstance(obj, bool)


def _is_class(obj: Any) -> bool:
    return isinstance(obj, type)


def _hook_slot_returns_previous(setter: Any) -> bool:
    """``set_guard_complete_hook(h)`` returns the hook it replaced (we read the slot that way once).

    Checked by writing the slot and putting back what was there, at install,
    before any compiled call of ours can run.
    """
    from . import bound

    if bound.installed:  # checked at install already; a live slot is never swapped after that
        return True
    previous = setter(None)
    marker = object.__new__(_Marker)
    try:
        setter(marker)
        return setter(previous) is marker
    except Exception:  # noqa: BLE001 - a slot that refuses a callable: put back what we can
        setter(previous)
        return False


class _Marker:
    def __call__(self, result: bool) -> bool:
        return result


def _or_with_copy(cls: Any) -> bool:
    return hasattr(cls, "__ior__") or hasattr(cls, "__or__")


def _has_mapping_contains(obj: Any) -> bool:
    return hasattr(obj, "__contains__")


def _is_type_of(sample: Callable[[], Any]) -> Callable[[Any], bool]:
    return lambda cls: type(sample()) is cls


def _aten_add_overload() -> Any:
    import torch

    return torch.ops.aten.add.Tensor


def _aten_add_packet() -> Any:
    import torch

    return torch.ops.aten.add


def _lists_overloads(obj: Any) -> bool:
    return callable(getattr(obj, "overloads", None))


def _communication_ops(namespace: str, op: str) -> Seam:
    """A namespace whose ops move data between ranks (the audit's ``fingerprint.COMM_NAMESPACES``),
    by one op it registers."""
    return Seam(
        f"ops.{namespace}",
        "torch._ops",
        f"ops.{namespace}.{op}",
        reads=(
            Read(
                "is a registered operator",
                _lists_overloads,
                degrades=f"the program audit does not see the collectives of torch.ops.{namespace}",
            ),
        ),
    )


# torch.compile's wrapper closure, and its free variable holding the compiled function;
# the local of ``Module._call_impl`` holding the forward it calls (guard collective frame identity).
COMPILE_WRAPPER = ("compile_wrapper", "fn")
FORWARD_CALL = "forward_call"


# ------------------------------------------------------------ the table

CONVERT_FRAME = "torch._dynamo.convert_frame"
PGO = "torch._dynamo.pgo"

SEAMS: tuple[Seam, ...] = (
    # -- switches
    Seam(
        "enable_compiler_collectives",
        "torch._dynamo.config",
        "enable_compiler_collectives",
        reads=(Read("is a bool flag", _is_bool),),
    ),
    Seam(
        "set_enable_guard_collectives",
        "torch.compiler",
        "set_enable_guard_collectives",
        reads=(Read("takes one positional flag", _positional("enabled")),),
    ),
    Seam(
        "automatic_dynamic_shapes",
        "torch._dynamo.config",
        "automatic_dynamic_shapes",
        reads=(Read("is a bool flag", _is_bool),),
    ),
    # -- the compiler collective (compiler_seam.py)
    Seam("get_compile_pg", CONVERT_FRAME, "get_compile_pg", replace="compiler_seam:get_compile_pg"),
    Seam(
        "distributed_get_compile_pg",
        "torch._dynamo.distributed",
        "get_compile_pg",
        replace="compiler_seam:get_compile_pg",
    ),
    Seam(
        "DistributedState",
        CONVERT_FRAME,
        "DistributedState",
        replace="compiler_seam:new_distributed_state",
        reads=(
            Read("is built as DistributedState(compile_pg, local_state)", _positional("compile_pg", "local_state")),
            Read(
                "has only the fields compile_pg, local_state, all_states (ours has them all)",
                _fields_within("compile_pg", "local_state", "all_states"),
            ),
        ),
    ),
    Seam(
        "LocalState",
        CONVERT_FRAME,
        "LocalState",
        replace="compiler_seam:LocalState",
        reads=(Read("has only the field automatic_dynamic (ours has it)", _fields_within("automatic_dynamic")),),
    ),
    Seam(
        "compile",
        CONVERT_FRAME,
        "_compile",
        replace="compiler_seam:wrap_compile",
        factory=True,
        reads=(Read("takes (code, globals, locals, ...) in that order", _positional("code", "globals", "locals")),),
    ),
    Seam(
        "run_compiler_collective",
        "torch._dynamo.output_graph",
        "OutputGraph.run_compiler_collective",
        replace="compiler_seam:run_compiler_collective",
    ),
    Seam(
        "OutputGraph",
        "torch._dynamo.output_graph",
        "OutputGraph",
        reads=(Read("sets root_tx and export", _sets_attributes("root_tx", "export")),),
    ),
    Seam(
        "InstructionTranslatorBase",
        "torch._dynamo.symbolic_convert",
        "InstructionTranslatorBase",
        reads=(
            Read(
                "sets distributed_state, speculation_log, f_code and closure",
                _sets_attributes("distributed_state", "speculation_log", "f_code", "closure"),
            ),
        ),
    ),
    Seam(
        "process_automatic_dynamic",
        PGO,
        "process_automatic_dynamic",
        replace="compiler_seam:process_automatic_dynamic",
        reads=(
            Read(
                "takes (tx, name, entry, *, is_unspecialized_nn_module)",
                lambda f: _positional("tx", "name", "entry")(f) and _keywords("is_unspecialized_nn_module")(f),
            ),
        ),
    ),
    Seam(
        "builder_process_automatic_dynamic",
        "torch._dynamo.variables.builder",
        "process_automatic_dynamic",
        replace="compiler_seam:process_automatic_dynamic",
    ),
    Seam(
        "update_automatic_dynamic",
        PGO,
        "update_automatic_dynamic",
        reads=(
            Read(
                "takes (tx, name, entry, *, is_unspecialized_nn_module)",
                lambda f: _positional("tx", "name", "entry")(f) and _keywords("is_unspecialized_nn_module")(f),
            ),
        ),
    ),
    Seam(
        "FrameStateSizeEntry",
        PGO,
        "FrameStateSizeEntry",
        reads=(
            Read(
                "has the fields scalar, size, stride, excluded_sizes, excluded_scalar",
                _fields("scalar", "size", "stride", "excluded_sizes", "excluded_scalar"),
            ),
            Read("merges with the or operator", _or_with_copy),
        ),
    ),
    Seam("InferStride", PGO, "InferStride", reads=(Read("has the field dim", _fields("dim")),)),
    Seam("auto_dynamic", PGO, "auto_dynamic"),
    Seam("auto_unset", PGO, "auto_unset"),
    Seam("get_code_state", PGO, "get_code_state"),
    Seam("CodeId.make", PGO, "CodeId.make", reads=(Read("takes (code, closure)", _positional("code", "closure")),)),
    Seam("CompileCollectiveRestartAnalysis", "torch._dynamo.exc", "CompileCollectiveRestartAnalysis"),
    Seam(
        "dynamo_timed",
        "torch._dynamo.utils",
        "dynamo_timed",
        reads=(Read("takes log_pt2_compile_event=", _keywords("log_pt2_compile_event")),),
    ),
    Seam(
        "try_add_pt2_compile",
        "torch._dynamo.utils",
        "CompileEventLogger.try_add_pt2_compile",
        reads=(
            Read(
                "takes (event_name, **metadata)",
                _takes_name_and_metadata,
                degrades="compile once's dynamo_timed events do not say the rank's role",
            ),
        ),
    ),
    Seam(
        "CompileContext",
        "torch._guards",
        "CompileContext",
        reads=(
            Read(
                "has current_compile_id() and try_get()",
                lambda c: callable(getattr(c, "current_compile_id", None)) and callable(getattr(c, "try_get", None)),
            ),
            Read("sets compile_id and attempt", _sets_attributes("compile_id", "attempt")),
        ),
    ),
    Seam(
        "ConvertFrameReturn",
        "torch._dynamo.types",
        "ConvertFrameReturn",
        reads=(
            Read(
                "has the field guarded_code (what _compile returns)",
                lambda c: "guarded_code" in {f.name for f in _dc.fields(c)},
            ),
        ),
    ),
    Seam("LazyGraphModule", "torch.fx._lazy_graph_module", "_LazyGraphModule", reads=(Read("is a class", _is_class),)),
    Seam(
        "LazyGraphModule.force_recompile",
        "torch.fx._lazy_graph_module",
        "_LazyGraphModule.force_recompile",
        reads=(Read("takes the graph module", _positional("gm")),),
    ),
    Seam(
        "force_disable_caches",
        "torch.compiler.config",
        "force_disable_caches",
        reads=(Read("is a bool flag", _is_bool),),
    ),
    Seam(
        "force_non_lazy_backward_lowering",
        "torch._functorch.config",
        "force_non_lazy_backward_lowering",
        reads=(Read("is a bool flag", _is_bool),),
    ),
    Seam(
        "accumulated_recompile_limit",
        "torch._dynamo.config",
        "accumulated_recompile_limit",
        reads=(Read("is an int", lambda v: type(v) is int),),
    ),
    Seam(
        "dynamo_reset",
        "torch._dynamo",
        "reset",
        replace="compiler_seam:wrap_reset",
        factory=True,
        reads=(Read("takes no argument", lambda f: _params(f) == []),),
    ),
    Seam("reset_code", "torch._C._dynamo.eval_frame", "reset_code", reads=(Read("is callable", callable),)),
    # -- the guard collective (guard_seam.py)
    Seam(
        "guard_collectives_hook", "torch._dynamo.eval_frame", "guard_collectives_hook", replace="guard_seam:guard_hook"
    ),
    Seam("get_guard_pg", "torch._dynamo.distributed", "get_guard_pg", replace="guard_seam:get_guard_pg"),
    Seam(
        "set_guard_complete_hook",
        "torch._C._dynamo.eval_frame",
        "set_guard_complete_hook",
        replace="guard_seam:set_guard_complete_hook",
        reads=(Read("returns the hook it replaced", _hook_slot_returns_previous),),
    ),
    Seam(
        "orig_code_map",
        "torch._dynamo.utils",
        "orig_code_map",
        reads=(Read("maps Dynamo's output code to the user's", _has_mapping_contains),),
    ),
    Seam(
        "TorchDynamoContext.__call__",
        "torch._dynamo.eval_frame",
        "_TorchDynamoContext.__call__",
        reads=(
            Read(
                "defines compile_wrapper calling its free variable fn",
                _has_nested_code(*COMPILE_WRAPPER),
                degrades="the guard collective names torch.compile'd functions by their caller",
            ),
        ),
    ),
    Seam(
        "Module._call_impl",
        "torch.nn",
        "Module._call_impl",
        reads=(
            Read(
                "calls the forward through the local forward_call",
                _has_local(FORWARD_CALL),
                degrades="the guard collective names compiled modules by their caller",
            ),
        ),
    ),
    Seam(
        "profiler_enabled",
        "torch.autograd.profiler",
        "_is_profiler_enabled",
        reads=(Read("is a bool flag", _is_bool, degrades="guard collectives show no profiler range"),),
    ),
    # -- PT2 tooling (tooling.py)
    Seam(
        "get_and_maybe_log_recompilation_reasons",
        CONVERT_FRAME,
        "get_and_maybe_log_recompilation_reasons",
        replace="tooling:recompilation_reasons",
        reads=(
            Read(
                "takes (cache_entries, frame, backend, skip_logging)",
                _positional("cache_entries", "frame", "backend", "skip_logging"),
            ),
        ),
    ),
    Seam("recompiles_log", "torch._dynamo.guards", "recompiles_log"),
    Seam("recompiles_verbose_log", "torch._dynamo.guards", "recompiles_verbose_log"),
    Seam("is_recompiles_enabled", "torch._dynamo.guards", "is_recompiles_enabled"),
    Seam("is_recompiles_verbose_enabled", "torch._dynamo.guards", "is_recompiles_verbose_enabled"),
    Seam("error_on_recompile", "torch._dynamo.config", "error_on_recompile"),
    Seam("RecompileError", "torch._dynamo.exc", "RecompileError"),
    Seam(
        "trace_structured",
        "torch._logging",
        "trace_structured",
        reads=(
            Read(
                "takes metadata_fn=, payload_fn= and expect_trace_id=",
                _keywords("metadata_fn", "payload_fn", "expect_trace_id"),
            ),
        ),
    ),
    # -- the program audit (audit_seam.py)
    Seam(
        "compile_subgraph",
        "torch._dynamo.output_graph",
        "OutputGraph.compile_subgraph",
        reads=(
            Read(
                "records why it compiles as compile_subgraph_reason",
                lambda f: "compile_subgraph_reason" in f.__code__.co_names,
            ),
        ),
    ),
    Seam(
        "GraphCompileReason",
        "torch._dynamo.output_graph",
        "GraphCompileReason",
        reads=(Read("has the fields reason, user_stack, graph_break", _fields("reason", "user_stack", "graph_break")),),
    ),
    Seam(
        "call_user_compiler",
        "torch._dynamo.output_graph",
        "OutputGraph.call_user_compiler",
        replace="audit_seam:call_user_compiler",
        reads=(Read("takes (self, gm, example_inputs)", _positional("self", "gm", "example_inputs")),),
    ),
    Seam(
        "aot_module_simplified",
        "torch._dynamo.backends.common",
        "aot_module_simplified",
        replace="audit_seam:aot_module_simplified",
        required=False,
        level="aot",
        reads=(
            Read(
                "takes (mod, args, ...) and fw_compiler=, bw_compiler=, inference_compiler=",
                lambda f: (
                    _positional("mod", "args")(f) and _keywords("fw_compiler", "bw_compiler", "inference_compiler")(f)
                ),
            ),
        ),
    ),
    Seam(
        "SerializableAOTDispatchCompiler",
        "torch._functorch.aot_autograd",
        "SerializableAOTDispatchCompiler",
        required=False,
        level="aot",
        reads=(Read("is built as (output_code_ty, compiler_fn)", _positional("output_code_ty", "compiler_fn")),),
    ),
    Seam(
        "recursive_post_grad_passes",
        "torch._inductor.compile_fx",
        "_recursive_post_grad_passes",
        replace="audit_seam:post_grad_passes",
        required=False,
        level="inductor",
        reads=(Read("takes the graph module first", _positional("gm")),),
    ),
    # -- compile once (once_seam.py): AOTAutograd's cache lookup and what a compile reads and writes
    Seam(
        "autograd_cache_key",
        "torch._functorch._aot_autograd.autograd_cache",
        "autograd_cache_key",
        replace="once_seam:cache_key",
        required=False,
        level="once",
        reads=(
            Read(
                "takes (mod, example_inputs, config, ...) and returns (key, debug lines)",
                _positional("mod", "example_inputs", "config"),
            ),
        ),
    ),
    Seam(
        "AOTAutogradCache.try_load",
        "torch._functorch._aot_autograd.autograd_cache",
        "AOTAutogradCache.try_load",
        replace="once_seam:try_load",
        required=False,
        level="once",
        reads=(
            Read(
                "takes (mod, args, aot_config, compiler_config_extra, local, remote, ...) and computes its key "
                "with autograd_cache_key before reading the cache",
                lambda f: (
                    _positional("mod", "args", "aot_config", "compiler_config_extra", "local", "remote")(f)
                    and "autograd_cache_key" in f.__code__.co_names
                ),
            ),
        ),
    ),
    Seam(
        "AOTAutogradCache",
        "torch._functorch._aot_autograd.autograd_cache",
        "AOTAutogradCache",
        required=False,
        level="once",
        reads=(Read("has _get_tmp_dir_for_key(key)", lambda c: callable(getattr(c, "_get_tmp_dir_for_key", None))),),
    ),
    Seam(
        "AOTAutogradCache._lookup",
        "torch._functorch._aot_autograd.autograd_cache",
        "AOTAutogradCache._lookup",
        replace="once_seam:lookup_entry",
        required=False,
        level="once-hit",
        reads=(
            Read(
                "takes (key, local, remote, args, cache_info, aot_config) and returns (entry, pickled entry) or None",
                _positional("key", "local", "remote", "args", "cache_info", "aot_config"),
            ),
        ),
    ),
    Seam(
        "AOTConfig",
        "torch._functorch._aot_autograd.schemas",
        "AOTConfig",
        required=False,
        level="once",
        reads=(
            Read(
                "is a dataclass with a force_non_lazy_backward_lowering field (dataclasses.replace copies it)",
                lambda c: "force_non_lazy_backward_lowering" in getattr(c, "__dataclass_fields__", {}),
            ),
        ),
    ),
    Seam(
        "BypassAOTAutogradCache",
        "torch._functorch._aot_autograd.autograd_cache",
        "BypassAOTAutogradCache",
        required=False,
        level="once",
        reads=(Read("is an exception type", lambda c: isinstance(c, type) and issubclass(c, Exception)),),
    ),
    Seam(
        "FxGraphCache",
        "torch._inductor.codecache",
        "FxGraphCache",
        required=False,
        level="once",
        reads=(Read("has _get_tmp_dir_for_key(key)", lambda c: callable(getattr(c, "_get_tmp_dir_for_key", None))),),
    ),
    Seam(
        "FxGraphCache._lookup_graph",
        "torch._inductor.codecache",
        "FxGraphCache._lookup_graph",
        replace="once_seam:lookup_graph",
        required=False,
        level="once",
        reads=(Read("takes the cache key first", _positional("key")),),
    ),
    Seam(
        "_compile_fx_inner",
        "torch._inductor.compile_fx",
        "_compile_fx_inner",
        replace="once_seam:compile_fx_inner",
        required=False,
        level="once",
        reads=(
            Read(
                "takes (gm, example_inputs, ...) and looks its graph up with prepare_key and load_with_key",
                lambda f: (
                    _positional("gm", "example_inputs")(f)
                    and {"prepare_key", "load_with_key"} <= set(f.__code__.co_names)
                ),
            ),
        ),
    ),
    Seam(
        "FxGraphCache.prepare_key",
        "torch._inductor.codecache",
        "FxGraphCache.prepare_key",
        replace="once_seam:prepare_key",
        required=False,
        level="once",
        reads=(
            Read(
                "takes (gm, example_inputs, ...) and returns (key info, cache info)",
                _positional("gm", "example_inputs"),
            ),
        ),
    ),
    Seam(
        "FxGraphCache.load_with_key",
        "torch._inductor.codecache",
        "FxGraphCache.load_with_key",
        replace="once_seam:load_with_key",
        required=False,
        level="once",
        reads=(Read("takes the cache key first and returns (graph or None, cache info)", _positional("key")),),
    ),
    Seam(
        "codecache.write",
        "torch._inductor.codecache",
        "write",
        replace="once_seam:write_source",
        required=False,
        level="once",
        reads=(
            Read("takes (content, extension, ...) and returns (basename, path)", _positional("content", "extension")),
        ),
    ),
    Seam(
        "inductor_cache_dir",
        "torch._inductor.runtime.cache_dir_utils",
        "cache_dir",
        required=False,
        level="once",
    ),
    Seam(
        "functorch_config",
        "torch._functorch",
        "config",
        required=False,
        level="once",
        reads=(Read("has _sync_decision_cross_ranks", lambda m: hasattr(m, "_sync_decision_cross_ranks")),),
    ),
    Seam(
        "inductor_config",
        "torch._inductor",
        "config",
        required=False,
        level="once",
        reads=(Read("has distributed_max_autotune_gemm", lambda m: hasattr(m, "distributed_max_autotune_gemm")),),
    ),
    Seam(
        "inductor_config_comms",
        "torch._inductor",
        "config_comms",
        required=False,
        level="once",
        reads=(
            Read(
                "has runtime_estimations_align_across_all_distributed_ranks",
                lambda m: hasattr(m, "runtime_estimations_align_across_all_distributed_ranks"),
            ),
        ),
    ),
    # -- compile once's build fingerprint (agreements/once/build.py): the compiler inductor builds with
    Seam(
        "cpp_compiler",
        "torch._inductor.cpp_builder",
        "get_cpp_compiler",
        required=False,
        level="once",
        reads=(Read("takes no required argument", lambda f: _required(f) == []),),
    ),
    Seam(
        "compiler_version_info",
        "torch._inductor.cpp_builder",
        "get_compiler_version_info",
        required=False,
        level="once",
        reads=(Read("takes (compiler)", _positional("compiler")),),
    ),
    # -- the program audit's graph walk (agreements/fingerprint.py, handed these at install)
    Seam(
        "OpOverload",
        "torch._ops",
        "OpOverload",
        reads=(Read("is the type of torch.ops.aten.add.Tensor", _is_type_of(_aten_add_overload)),),
    ),
    Seam(
        "OpOverloadPacket",
        "torch._ops",
        "OpOverloadPacket",
        reads=(
            Read("is the type of torch.ops.aten.add", _is_type_of(_aten_add_packet)),
            Read("lists a packet's overloads()", _lists_overloads),
        ),
    ),
    Seam(
        "normalize_function",
        "torch.fx.operator_schemas",
        "normalize_function",
        reads=(
            Read(
                "takes (target, args, kwargs, ...) and normalize_to_only_use_kwargs=",
                lambda f: _positional("target", "args", "kwargs")(f) and _keywords("normalize_to_only_use_kwargs")(f),
                degrades="the program audit compares a collective's arguments by position, not by name",
            ),
        ),
    ),
    _communication_ops("_c10d_functional", "all_reduce"),
    _communication_ops("_c10d_functional_autograd", "all_to_all_single"),
    _communication_ops("c10d", "allreduce_"),
    _communication_ops("_dtensor", "shard_dim_alltoall"),
    _communication_ops("symm_mem", "one_shot_all_reduce"),
    # -- process model (c10d_seam.py): a destroyed default group drops our generation
    Seam(
        "destroy_process_group",
        "torch.distributed",
        "destroy_process_group",
        replace="c10d_seam:wrap_destroy",
        factory=True,
        reads=(Read("takes the group first", _positional("group")),),
    ),
    Seam(
        "c10d_destroy_process_group",
        "torch.distributed.distributed_c10d",
        "destroy_process_group",
        replace="c10d_seam:wrap_destroy",
        factory=True,
        reads=(Read("takes the group first", _positional("group")),),
    ),
    Seam(
        "get_default_store",
        "torch.distributed.distributed_c10d",
        "_get_default_store",
        reads=(Read("takes no argument", lambda f: _params(f) == []),),
    ),
    Seam(
        "no_python_dispatcher",
        "torch._dispatch.python",
        "no_python_dispatcher",
        reads=(
            Read(
                "is a context manager type",
                lambda c: isinstance(c, type) and hasattr(c, "__enter__") and hasattr(c, "__exit__"),
            ),
        ),
    ),
    Seam(
        "resolve_process_group",
        "torch.distributed.distributed_c10d",
        "_resolve_process_group",
        required=False,
        level="audit-groups",
        reads=(Read("is callable", callable, degrades="the audit names functional collectives' groups by name"),),
    ),
)


_BY_NAME = {r.name: r for r in SEAMS}


def named(name: str) -> Seam:
    """The row named ``name`` (KeyError for a name that is not in the table)."""
    return _BY_NAME[name]


def resolve(row: Seam) -> Any:
    """Torch's attribute as it is now."""
    owner, name = place(row)
    return getattr(owner, name)


def place(row: Seam) -> tuple[Any, str]:
    """The object holding the row's attribute, and the attribute's name (what a patch sets)."""
    owner: Any = importlib.import_module(row.module)
    *parents, name = row.path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


def where(row: Seam) -> str:
    return f"{row.module}:{row.path}"


def required_rows() -> tuple[Seam, ...]:
    return tuple(r for r in SEAMS if r.required)


def optional_rows(level: str | None = None) -> tuple[Seam, ...]:
    return tuple(r for r in SEAMS if not r.required and (level is None or r.level == level))


def patched_rows() -> tuple[Seam, ...]:
    """The required rows we replace, in the order install patches them."""
    return tuple(r for r in SEAMS if r.required and r.replace is not None)


def check(rows: tuple[Seam, ...]) -> tuple[list[str], list[str]]:
    """(problems, degradations) of ``rows`` on the installed torch, each as one line."""
    problems: list[str] = []
    degraded: list[str] = []
    from . import bound

    for row in rows:
        try:
            obj = resolve(row)
            # Reads are about torch's object, not our replacement where ours is in place. Where it
            # is not (an optional level about to be bound, or bound again after ``unbind_levels``),
            # the object in place is the one ours will wrap: a stale original is not read.
            patched_now = bound.levels.get(row.level) is True if row.level else bound.installed
            if patched_now and row.replace is not None and row.name in bound.originals:
                obj = bound.originals[row.name]
        except (ImportError, AttributeError):
            if row.reads and all(read.degrades for read in row.reads):
                degraded.extend(f"{where(row)} is missing: {read.degrades}" for read in row.reads)
            else:
                problems.append(f"{where(row)} is missing")
            continue
        for read in row.reads:
            try:
                ok = bool(read.check(obj))
            except Exception:  # noqa: BLE001 - a read that cannot even be made fails
                ok = False
            if not ok:
                line = f"{where(row)} no longer {read.what}"
                if read.degrades:
                    degraded.append(f"{line}: {read.degrades}")
                else:
                    problems.append(line)
    return problems, degraded


def problems(rows: tuple[Seam, ...]) -> list[str]:
    return check(rows)[0]


def holds(name: str) -> bool:
    """Whether row ``name`` resolves and every read of it holds (degrading ones included)."""
    return check((named(name),)) == ([], [])
