"""Every touch of ``torch._dynamo`` internals lives here.

``install()`` swaps our implementation into the places where torch 2.13-2.15's
Dynamo calls its own compiler and guard collectives; ``uninstall()`` puts
torch's originals back. The seams, all checked before anything is patched:

* ``convert_frame.get_compile_pg``: hands Dynamo our gloo compile group.
* ``convert_frame.DistributedState`` / ``LocalState``: our per-compile box.
* ``pgo.process_automatic_dynamic`` (also bound by name in
  ``variables.builder``): preflight records, the restarted trace applies.
* ``OutputGraph.run_compiler_collective``: our exchange, our restart decision.
* ``convert_frame._compile``: surfaces errors the guard hook had to park, and
  unwraps our errors from Dynamo's ``InternalTorchDynamoError``.
* ``eval_frame.guard_collectives_hook`` and ``distributed.get_guard_pg``:
  what ``torch.compiler.set_enable_guard_collectives`` installs.
* ``torch._C._dynamo.eval_frame.set_guard_complete_hook``: the C++ hook slot;
  while installed, writes to it go through ours, which remembers the hook, so
  reading the slot never has to swap it.
* ``OutputGraph.call_user_compiler`` (and, once their modules are imported,
  ``backends.common.aot_module_simplified`` and inductor's
  ``compile_fx._recursive_post_grad_passes``): the program audit's view of
  each graph (see the section at the end and ``audit.py``).
* ``convert_frame.get_and_maybe_log_recompilation_reasons``: after an agreed
  guard miss, every rank's reasons, recorded where Dynamo records its own
  (its ``recompiles`` log, the ``recompile_reasons`` artifact, the metrics).
* ``torch._logging.trace_structured``: our ``compiler_collective`` and
  ``guard_collective`` artifacts in ``TORCH_TRACE``, under the compile's id.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import re
import threading
from typing import Any, Callable

import torch

from . import (artifacts, audit, compiler_collective, config, entry_agreement, fingerprint, guard_collective,
               health, recompile_reasons, setup_agreement)
from .errors import CollectiveError, UnsupportedTorchError
from .state import DYNAMIC, UNSET, DistributedState, FrameId, InferStride, LocalState, Marker, SizeEntry
from .stats import counters

log = logging.getLogger("compiler_collectives.dynamo")

# (module, attribute path) of everything we read or replace.
REQUIRED_SEAMS: tuple[tuple[str, str], ...] = (
    ("torch._dynamo.config", "enable_compiler_collectives"),
    ("torch._dynamo.convert_frame", "get_compile_pg"),
    ("torch._dynamo.convert_frame", "DistributedState"),
    ("torch._dynamo.convert_frame", "LocalState"),
    ("torch._dynamo.convert_frame", "_compile"),
    ("torch._dynamo.output_graph", "OutputGraph.run_compiler_collective"),
    ("torch._dynamo.pgo", "process_automatic_dynamic"),
    ("torch._dynamo.pgo", "update_automatic_dynamic"),
    ("torch._dynamo.pgo", "FrameStateSizeEntry"),
    ("torch._dynamo.pgo", "InferStride"),
    ("torch._dynamo.pgo", "auto_dynamic"),
    ("torch._dynamo.pgo", "auto_unset"),
    ("torch._dynamo.pgo", "get_code_state"),
    ("torch._dynamo.pgo", "CodeId.make"),
    ("torch._dynamo.variables.builder", "process_automatic_dynamic"),
    ("torch._dynamo.exc", "CompileCollectiveRestartAnalysis"),
    ("torch._dynamo.exc", "InternalTorchDynamoError"),
    ("torch._dynamo.utils", "dynamo_timed"),
    ("torch._dynamo.utils", "orig_code_map"),
    ("torch._dynamo.eval_frame", "guard_collectives_hook"),
    ("torch._dynamo.distributed", "get_compile_pg"),
    ("torch._dynamo.distributed", "get_guard_pg"),
    ("torch._C._dynamo.eval_frame", "set_guard_complete_hook"),
    ("torch.compiler", "set_enable_guard_collectives"),
    # PT2 tooling: recompile reasons and the structured trace
    ("torch._dynamo.convert_frame", "get_and_maybe_log_recompilation_reasons"),
    ("torch._dynamo.guards", "recompiles_log"),
    ("torch._dynamo.guards", "recompiles_verbose_log"),
    ("torch._dynamo.guards", "is_recompiles_enabled"),
    ("torch._dynamo.guards", "is_recompiles_verbose_enabled"),
    ("torch._dynamo.config", "error_on_recompile"),
    ("torch._dynamo.exc", "RecompileError"),
    ("torch._logging", "trace_structured"),
)

# The torch releases this package supports, [from, to) as (major, minor),
# matching pyproject's requirement; CI runs the suite on each of TESTED_TORCH.
SUPPORTED_TORCH = ((2, 13), (2, 16))
TESTED_TORCH = ("2.13.0", "2.14.1", "2.15.0")


def _resolve(module: str, path: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing_seams() -> list[str]:
    """Seams the installed torch lacks, as 'module:attr' strings."""
    missing = []
    for module, path in REQUIRED_SEAMS:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            missing.append(f"{module}:{path}")
    return missing


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


def check_seams() -> None:
    missing = missing_seams()
    fix = f"It supports {supported_range()}; install one of those, e.g. torch=={TESTED_TORCH[-1]}."
    if missing:
        raise UnsupportedTorchError(
            f"compiler_collectives cannot hook into torch {torch.__version__}: missing Dynamo "
            f"seam(s) {', '.join(missing)}. {fix}"
        )
    if not version_supported():
        raise UnsupportedTorchError(
            f"compiler_collectives does not support torch {torch.__version__}: the Dynamo "
            f"internals it replaces are only known to match in the supported releases. {fix}"
        )


# ------------------------------------------------------------ conversions

_pgo: Any = None  # torch._dynamo.pgo, bound at install


def _atom_from_torch(a: Any) -> Any:
    if a is _pgo.auto_dynamic:
        return DYNAMIC
    if a is _pgo.auto_unset:
        return UNSET
    if isinstance(a, _pgo.InferStride):
        return InferStride(a.dim)
    return int(a)


def _part_from_torch(p: Any) -> Any:
    if isinstance(p, tuple):
        return tuple(_atom_from_torch(a) for a in p)
    return _atom_from_torch(p)


def entry_from_torch(e: Any) -> SizeEntry:
    return SizeEntry(
        scalar=_atom_from_torch(e.scalar),
        size=_part_from_torch(e.size),
        stride=_part_from_torch(e.stride),
        excluded_sizes=None if e.excluded_sizes is None else tuple(e.excluded_sizes),
        excluded_scalar=e.excluded_scalar,
    )


def _atom_to_torch(a: Any) -> Any:
    if a is DYNAMIC:
        return _pgo.auto_dynamic
    if a is UNSET:
        return _pgo.auto_unset
    if isinstance(a, InferStride):
        return _pgo.InferStride(a.dim)
    return a


def _part_to_torch(p: Any) -> Any:
    if isinstance(p, Marker):
        return _atom_to_torch(p)
    return tuple(_atom_to_torch(a) for a in p)


def entry_to_torch(e: SizeEntry) -> Any:
    return _pgo.FrameStateSizeEntry(
        scalar=_atom_to_torch(e.scalar),
        size=_part_to_torch(e.size),
        stride=_part_to_torch(e.stride),
        excluded_sizes=e.excluded_sizes,
        excluded_scalar=e.excluded_scalar,
    )


# ------------------------------------------------------------ replacements

_originals: dict[str, Any] = {}
_installed = False


def torch_original(name: str) -> Any:
    """Torch's own object that the seam ``name`` replaced (for benchmarks and tests that
    compare with torch's implementation); KeyError before ``install()`` or for an unknown name."""
    return _originals[name]


def _get_compile_pg() -> Any:
    if torch._dynamo.config.enable_compiler_collectives and compiler_collective.groups.available():
        return compiler_collective.group_for_compile()
    return None


def _get_guard_pg() -> Any:
    if compiler_collective.groups.available():
        return compiler_collective.groups.guard_pg()
    return None


def _process_automatic_dynamic(
    tx: Any, name: str, entry: Any, *, is_unspecialized_nn_module: bool = False
) -> Any:
    st = tx.distributed_state
    if not isinstance(st, DistributedState):
        # No collective for this compile (or torch's own box): torch's logic.
        return _originals["process_automatic_dynamic"](
            tx, name, entry, is_unspecialized_nn_module=is_unspecialized_nn_module
        )
    update = _pgo.update_automatic_dynamic
    if st.all_states is None:
        # First trace: record what Dynamo observed. A frame argument whose
        # entries every rank exchanged before the trace is decided now, from
        # the prior frame state joined with every rank's entry (on a copy:
        # the frame state itself is updated once, after the exchange). Any
        # other source is traced as static, as in torch's preflight.
        st.local_state.automatic_dynamic[name] = entry_from_torch(entry)
        st.origins[name] = tx
        if name in st.early_names:
            return _joined_early_entry(st, tx, name)
        return entry
    result = None
    for state in st.all_states:  # rank order; includes this rank's own state
        observed = state.automatic_dynamic.get(name)
        if observed is not None:
            result = update(
                tx, name, entry_to_torch(observed), is_unspecialized_nn_module=is_unspecialized_nn_module
            )
    if result is None:
        # No rank saw this source in its preflight (the trace went elsewhere
        # after the exchange); decide from this rank's observation alone.
        log.debug("source %s was not in any rank's preflight; using the local observation", name)
        result = update(tx, name, entry, is_unspecialized_nn_module=is_unspecialized_nn_module)
    return result


def _wrapper_locals() -> dict[Any, str]:
    """Frames that call compiled code on the user's behalf, and the local naming the callee.

    torch.compile(fn) calls ``fn`` from ``compile_wrapper`` (a closure in
    eval_frame); a compiled module's forward is called from
    ``Module._call_impl`` as ``forward_call``. Missing ones only make the
    guard collective's frame identity coarser (it falls back to the caller).
    """
    import torch._dynamo.eval_frame as eval_frame

    found: dict[Any, str] = {}
    pending = [eval_frame._TorchDynamoContext.__call__.__code__]
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
    if len(found) < 2:
        log.warning("guard collective frame identity is coarser on torch %s: wrapper frames not found",
                    torch.__version__)
    return found


def _prior_entry(tx: Any, name: str) -> Any:
    code_state = _pgo.get_code_state().get(_pgo.CodeId.make(tx.f_code, tx.closure))
    prior = None if code_state is None else code_state.automatic_dynamic.get(name)
    return _pgo.FrameStateSizeEntry() if prior is None else prior


def _joined_early_entry(ds: DistributedState, tx: Any, name: str) -> Any:
    """prior ⊔ every rank's exchanged entry for ``name``, in rank order, on a copy."""
    import copy

    joined = copy.copy(_prior_entry(tx, name))
    assert ds.early_states is not None
    for state in ds.early_states:
        observed = state.automatic_dynamic.get(name)
        if observed is not None:
            joined |= entry_to_torch(observed)
    return joined


def _predicted_entry(value: Any) -> SizeEntry | None:
    """What Dynamo's builder will record for a frame argument, or None if we cannot tell.

    Mirrors ``record_automatic_dynamic`` (tensors, with its stride inference)
    and ``make_scalar`` (ints). A wrong prediction costs a restart, never a
    wrong decision: the restart check compares it with what Dynamo recorded.
    """
    if type(value) is int:
        return SizeEntry(scalar=value, size=DYNAMIC, stride=DYNAMIC)
    if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.layout is not torch.strided:
        return None
    if value.is_nested or value.device.type == "meta":
        return None
    size = tuple(int(s) for s in value.size())
    ex_stride = value.stride()
    stride: list[Any] = [None] * len(size)
    candidates: dict[int, Any] = {}
    for i_stride, neg_i in sorted((ex_stride[i], -i) for i in range(len(size))):
        i = -neg_i
        stride[i] = candidates.get(i_stride, i_stride)
        candidates.setdefault(i_stride * size[i], InferStride(i))
    return SizeEntry(scalar=DYNAMIC, size=size, stride=tuple(stride))


_pending = threading.local()  # the frame _compile is about to compile


def _new_distributed_state(compile_pg: Any, local_state: LocalState) -> DistributedState:
    """Dynamo's constructor call for the per-compile box; also runs the input exchange."""
    ds = DistributedState(compile_pg, local_state)
    pending = getattr(_pending, "frame", None)
    settings = config.settings
    if (
        pending is None
        or not settings.exchange_inputs_first
        or not settings.skip_needless_restart
        or not torch._dynamo.config.automatic_dynamic_shapes
    ):
        return ds
    code, frame_locals = pending
    predicted = LocalState(frame_state_fresh=True)
    for name, value in frame_locals.items():
        entry = _predicted_entry(value)
        if entry is not None:
            source = f"L[{name!r}]"
            predicted.automatic_dynamic[source] = entry
            # Dynamo also fakifies a view's base, as the source "<view>._base".
            base = getattr(value, "_base", None) if isinstance(value, torch.Tensor) else None
            base_entry = None if base is None else _predicted_entry(base)
            if base_entry is not None:
                predicted.automatic_dynamic[f"{source}._base"] = base_entry
    frame = FrameId(code.co_name, code.co_filename, code.co_firstlineno)
    result = compiler_collective.exchange(ds, frame, state=predicted)
    ds.early_states = result.states
    ds.early_names = frozenset(n for s in result.states for n in s.automatic_dynamic)
    _trace_exchange(result, ds)
    return ds


def _frame_state_fresh(ds: DistributedState) -> bool:
    """True if this rank's frame state cannot change any preflight decision."""
    if not torch._dynamo.config.automatic_dynamic_shapes:
        return True  # update_automatic_dynamic overwrites: the entry itself wins
    for name, observed in ds.local_state.automatic_dynamic.items():
        if name in ds.early_names:
            continue  # decided from prior + every rank's entry already
        tx = ds.origins.get(name)
        if tx is None:
            return False
        prior_entry = entry_from_torch(_prior_entry(tx, name))
        if prior_entry == SizeEntry():
            continue  # all unset: the identity of the merge
        if not (prior_entry.same_decision_as(observed) and prior_entry.excluded_sizes is None
                and prior_entry.excluded_scalar is None):
            return False
    return True


def _apply_without_restart(ds: DistributedState) -> None:
    """Do what the restarted trace's process_automatic_dynamic calls would have done."""
    update = _pgo.update_automatic_dynamic
    assert ds.all_states is not None
    for name in ds.local_state.automatic_dynamic:
        tx = ds.origins[name]
        for state in ds.all_states:
            observed = state.automatic_dynamic.get(name)
            if observed is not None:
                update(tx, name, entry_to_torch(observed))


def _run_compiler_collective(self: Any) -> None:
    tx = self.root_tx
    ds = tx.distributed_state
    if ds is None or ds.all_states is not None:
        return
    if not isinstance(ds, DistributedState):
        return _originals["run_compiler_collective"](self)
    code = tx.f_code
    frame = FrameId(code.co_name, code.co_filename, code.co_firstlineno)
    ds.local_state.frame_state_fresh = _frame_state_fresh(ds)
    with _dynamo_timed("compiler_collective", log_pt2_compile_event=True):
        result = compiler_collective.exchange(ds, frame)
    ds.all_states = result.states
    _trace_exchange(result, ds)
    if result.restart:
        counters.restarts += 1
        tx.speculation_log.clear()
        raise _exc.CompileCollectiveRestartAnalysis
    counters.restarts_skipped += 1
    ds.restart_skipped = True
    _apply_without_restart(ds)


def _wrap_compile(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _compile(*args: Any, **kwargs: Any) -> Any:
        health.raise_parked()
        code = args[0] if args else kwargs.get("code")
        frame_locals = args[2] if len(args) > 2 else kwargs.get("locals")
        previous = getattr(_pending, "frame", None)
        _pending.frame = (code, frame_locals) if isinstance(frame_locals, dict) else None
        # --- entry agreement (issue 16): which cache entries a frame's compiles add ---
        building = entry_agreement.compile_started(code)
        kept = False
        try:
            result = original(*args, **kwargs)
            kept = getattr(result, "guarded_code", None) is not None
            return result
        # --- end entry agreement ---
        except _exc.InternalTorchDynamoError as e:
            # Dynamo rewraps unknown exceptions "from None"; the original is
            # still the context. Give the user our type back.
            inner = e.__context__
            if isinstance(inner, CollectiveError):
                raise inner from inner.__cause__
            raise
        finally:
            _pending.frame = previous
            if code is not None:  # --- entry agreement (issue 16) ---
                entry_agreement.compile_finished(code, FrameId(code.co_name, code.co_filename, code.co_firstlineno),
                                                 building, kept)

    _compile.__compiler_collectives_wrapper__ = True  # type: ignore[attr-defined]
    return _compile


# ------------------------------------------------------------ PT2 tooling
#
# What TORCH_TRACE/tlparse and TORCH_LOGS show of us: our artifacts under
# the compile they belong to, and every rank's recompile reasons where
# Dynamo records its own.

_compiler_log = logging.getLogger("compiler_collectives.compiler")


def _structured_artifact(name: str, payload_fn: Callable[[], Any]) -> None:
    """A JSON artifact in torch's structured trace; ``payload_fn`` runs only if TORCH_TRACE is on.

    Inside a compile, torch files it under that compile's id (and attempt).
    """
    _trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=lambda: json.dumps(payload_fn(), indent=1),
    )


def _trace_exchange(result: Any, ds: DistributedState) -> None:
    """The ``compiler_collective`` artifact and the INFO line for one exchange."""
    built: dict[str, Any] = {}

    def payload() -> dict[str, Any]:
        if not built:
            times = [e.sent_at for e in result.envelopes]
            built.update(artifacts.compiler_collective(
                phase=result.phase,
                rank=ds.compile_pg.rank(),
                frame=str(ds.frame),
                seq=ds.seq or 0,
                states=result.states,
                restart=None if result.phase == "inputs" else result.restart,
                restart_why=result.restart_why,
                bytes_sent=result.bytes_sent,
                bytes_received=result.bytes_received,
                rounds=result.rounds,
                elapsed_s=result.elapsed_s,
                arrival_spread_s=max(times) - min(times),
                last_rank=max(range(len(times)), key=lambda r: times[r]),
            ))
        return built

    _structured_artifact("compiler_collective", payload)
    level = logging.INFO if result.phase == "trace" else logging.DEBUG
    if _compiler_log.isEnabledFor(level):
        _compiler_log.log(level, "compiler collective #%s: %s", ds.seq, artifacts.summary_line(payload()))


def _recompilation_reasons(
    cache_entries: Any, frame: Any, backend: Any, skip_logging: bool = False
) -> list[str]:
    """Dynamo's recompile reasons; after an agreed guard miss, every rank's, on every rank."""
    original = _originals["get_and_maybe_log_recompilation_reasons"]
    miss = None if skip_logging else guard_collective.take_agreed_miss()
    if miss is None:
        return original(cache_entries, frame, backend, skip_logging=skip_logging)
    seq, missed, pg = miss
    code = frame.f_code
    where = str(FrameId(code.co_name, code.co_filename, code.co_firstlineno))
    # A rank that hit has no failing guard to report; Dynamo would say it
    # cannot find a reason.
    own = original(cache_entries, frame, backend, skip_logging=True) if missed else []
    shared = recompile_reasons.exchange(pg, seq=seq, missed=missed, own=own, frame=where)
    _structured_artifact("guard_collective", lambda: artifacts.guard_collective(shared, where))
    _record_recompile_reasons(code, shared.reasons)
    return shared.reasons


def _record_recompile_reasons(code: Any, reasons: list[str]) -> None:
    """Where Dynamo records recompile reasons: its recompile logs and ``recompile_reasons`` artifact.

    The returned list also becomes the compile's metrics ``recompile_reason``
    (its first item), which tlparse shows in the compile's metrics.
    """
    listed = "\n".join("    - " + r.replace("\n", "\n      ") for r in reasons)
    message = (
        f"Recompiling function {code.co_name} in {code.co_filename}:{code.co_firstlineno} "
        f"with every rank (guard collective); guard failures:\n{listed}"
    )
    if _guards.is_recompiles_verbose_enabled():
        _guards.recompiles_verbose_log.debug(message)
    elif _guards.is_recompiles_enabled():
        _guards.recompiles_log.debug(message)
    _trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": "recompile_reasons", "encoding": "json"},
        # the shape Dynamo writes: one reason as a string, several as a list
        payload_fn=lambda: reasons[0] if len(reasons) == 1 else reasons,
    )
    if torch._dynamo.config.error_on_recompile:
        raise _exc.RecompileError(message)


_exc: Any = None
_dynamo_timed: Any = None
_guards: Any = None
_trace_structured: Any = None

# The C++ guard-complete hook slot cannot be read without swapping it out and
# back (a compiled call landing in between would skip the collective). While we
# are installed, every write to the slot goes through ``_set_guard_complete_hook``,
# which remembers what it wrote: reading is then a plain attribute read.
_guard_slot: Any = None
_modules: dict[str, Any] = {}


def _set_guard_complete_hook(hook: Any) -> Any:
    global _guard_slot
    previous = _originals["set_guard_complete_hook"](hook)
    _guard_slot = hook
    return previous


def _prepare() -> dict[str, Any]:
    """Everything ``install`` needs, read and checked before anything is patched."""
    import torch._dynamo.guards as guards
    import torch._C._dynamo.eval_frame as c_eval_frame
    import torch._dynamo.convert_frame as convert_frame
    import torch._dynamo.distributed as dynamo_distributed
    import torch._dynamo.eval_frame as eval_frame
    import torch._dynamo.exc as exc
    import torch._dynamo.output_graph as output_graph
    import torch._dynamo.pgo as pgo
    import torch._dynamo.utils as dynamo_utils
    import torch._dynamo.variables.builder as builder

    # --- entry agreement (issue 16): instance fields the seams above read ---
    import dataclasses as _dataclasses

    from torch._dynamo.types import ConvertFrameReturn
    from torch._guards import CompileContext

    if not {"compile_id", "attempt"} <= set(CompileContext.__init__.__code__.co_names):
        raise AttributeError("torch._guards.CompileContext has no compile_id/attempt")
    if "guarded_code" not in {f.name for f in _dataclasses.fields(ConvertFrameReturn)}:
        raise AttributeError("torch._dynamo.types.ConvertFrameReturn has no guarded_code")
    # --- end entry agreement ---
    return dict(
        modules=dict(c_eval_frame=c_eval_frame, convert_frame=convert_frame,
                     dynamo_distributed=dynamo_distributed, eval_frame=eval_frame,
                     output_graph=output_graph, pgo=pgo, builder=builder),
        exc=exc,
        dynamo_timed=dynamo_utils.dynamo_timed,
        guards=guards,
        trace_structured=torch._logging.trace_structured,
        orig_code_map=dynamo_utils.orig_code_map,
        wrapper_locals=_wrapper_locals(),
        originals=dict(
            get_compile_pg=convert_frame.get_compile_pg,
            distributed_get_compile_pg=dynamo_distributed.get_compile_pg,
            get_guard_pg=dynamo_distributed.get_guard_pg,
            DistributedState=convert_frame.DistributedState,
            LocalState=convert_frame.LocalState,
            compile=convert_frame._compile,
            run_compiler_collective=output_graph.OutputGraph.run_compiler_collective,
            process_automatic_dynamic=pgo.process_automatic_dynamic,
            builder_process_automatic_dynamic=builder.process_automatic_dynamic,
            guard_collectives_hook=eval_frame.guard_collectives_hook,
            set_guard_complete_hook=c_eval_frame.set_guard_complete_hook,
            get_and_maybe_log_recompilation_reasons=convert_frame.get_and_maybe_log_recompilation_reasons,
        ),
    )


# (module key, attribute path, key in _originals, replacement factory)
_PATCHES: tuple[tuple[str, str, str], ...] = (
    ("convert_frame", "get_compile_pg", "get_compile_pg"),
    ("dynamo_distributed", "get_compile_pg", "distributed_get_compile_pg"),
    ("dynamo_distributed", "get_guard_pg", "get_guard_pg"),
    ("convert_frame", "DistributedState", "DistributedState"),
    ("convert_frame", "LocalState", "LocalState"),
    ("convert_frame", "_compile", "compile"),
    ("output_graph", "OutputGraph.run_compiler_collective", "run_compiler_collective"),
    ("pgo", "process_automatic_dynamic", "process_automatic_dynamic"),
    ("builder", "process_automatic_dynamic", "builder_process_automatic_dynamic"),
    ("eval_frame", "guard_collectives_hook", "guard_collectives_hook"),
    ("c_eval_frame", "set_guard_complete_hook", "set_guard_complete_hook"),
    ("convert_frame", "get_and_maybe_log_recompilation_reasons", "get_and_maybe_log_recompilation_reasons"),
)


def _assign(modules: dict[str, Any], module: str, path: str, value: Any) -> None:
    owner = modules[module]
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    setattr(owner, name, value)


def install() -> None:
    """Swap our implementation in (idempotent).

    Every internal we rely on is read and checked first (``check_seams``,
    ``_prepare``); only then is torch patched, and a failure while patching
    puts back what was already replaced: torch is never left half-patched.
    """
    global _installed, _pgo, _exc, _dynamo_timed, _modules, _guards, _trace_structured
    if _installed:
        return
    check_seams()
    try:
        prepared = _prepare()
    except Exception as e:  # noqa: BLE001 - any surprise in torch's internals
        raise UnsupportedTorchError(
            f"compiler_collectives cannot hook into torch {torch.__version__}: reading its Dynamo "
            f"internals failed ({type(e).__name__}: {e}). Nothing was patched. It supports "
            f"{supported_range()}; install one of those."
        ) from e
    modules = prepared["modules"]
    originals = prepared["originals"]
    replacements = dict(
        get_compile_pg=_get_compile_pg,
        distributed_get_compile_pg=_get_compile_pg,
        get_guard_pg=_get_guard_pg,
        DistributedState=_new_distributed_state,
        LocalState=LocalState,
        compile=_wrap_compile(originals["compile"]),
        run_compiler_collective=_run_compiler_collective,
        process_automatic_dynamic=_process_automatic_dynamic,
        builder_process_automatic_dynamic=_process_automatic_dynamic,
        guard_collectives_hook=guard_collective.hook,
        set_guard_complete_hook=_set_guard_complete_hook,
        get_and_maybe_log_recompilation_reasons=_recompilation_reasons,
    )
    done: list[tuple[str, str, str]] = []
    audit_installed = False
    try:
        _originals.update(originals)
        for module, path, key in _PATCHES:
            _assign(modules, module, path, replacements[key])
            done.append((module, path, key))
        _install_audit(modules["output_graph"])
        audit_installed = True
        # If torch's own guard hook is active (set_enable_guard_collectives was
        # called before we were imported), keep guard collectives on, but ours.
        # The one read of the slot that has to swap it: at install, before any
        # compiled call of ours can run.
        previous = originals["set_guard_complete_hook"](None)
        if previous is originals["guard_collectives_hook"] or config.settings.guards:
            _set_guard_complete_hook(guard_collective.hook)
        else:
            _set_guard_complete_hook(previous)
    except BaseException:
        if audit_installed:
            _uninstall_audit(modules["output_graph"])
        for module, path, key in reversed(done):
            _assign(modules, module, path, originals[key])
        raise
    _modules = modules
    _pgo, _exc, _dynamo_timed = modules["pgo"], prepared["exc"], prepared["dynamo_timed"]
    _guards, _trace_structured = prepared["guards"], prepared["trace_structured"]
    orig_code_map = prepared["orig_code_map"]
    guard_collective._is_dynamo_output_code = lambda code: code in orig_code_map
    guard_collective._wrapper_locals.update(prepared["wrapper_locals"])
    _installed = True
    log.debug("installed into torch %s", torch.__version__)


def uninstall() -> None:
    """Restore torch's originals, the C++ hook slot included (tests)."""
    global _installed
    if not _installed:
        return
    modules = _modules
    current = _guard_slot
    _uninstall_audit(modules["output_graph"])
    for module, path, key in reversed(_PATCHES):
        _assign(modules, module, path, _originals[key])
    if current is guard_collective.hook:
        _originals["set_guard_complete_hook"](_originals["guard_collectives_hook"])
    _installed = False


def installed() -> bool:
    return _installed


def set_guard_hook(enabled: bool) -> bool:
    """Turn our guard collective on or off; returns whether a hook was set before."""
    return bool(torch.compiler.set_enable_guard_collectives(enabled))


def guard_hook_active() -> bool:
    """Whether our guard hook is in the C++ slot. A plain read: the slot is never touched."""
    return _installed and _guard_slot is guard_collective.hook


def _setup_items() -> dict[str, Any]:
    """Switches every rank must have alike, as they are now (for the setup agreement).

    The guard switch's entry replaces the ``COMPILER_COLLECTIVES_GUARDS``
    setting's: what counts is whether our hook is in the slot, however it got there.
    """
    dynamo_config = torch._dynamo.config
    return {
        "COMPILER_COLLECTIVES_GUARDS": guard_hook_active(),
        "TORCH_COMPILER_COLLECTIVES": bool(dynamo_config.enable_compiler_collectives),
        "torch._dynamo.config.automatic_dynamic_shapes": bool(dynamo_config.automatic_dynamic_shapes),
    }


setup_agreement.register_source(_setup_items)


def compiler_collectives_flag() -> bool:
    return bool(torch._dynamo.config.enable_compiler_collectives)


def set_compiler_collectives_flag(value: bool) -> None:
    torch._dynamo.config.enable_compiler_collectives = value


# ------------------------------------------------------------ program audit seams
#
# The audit (audit.py) sees each graph Dynamo hands to a backend and the graphs
# AOTAutograd and inductor derive from it. Dynamo's level is a required seam.
# The AOTAutograd and inductor levels are patched when an audited compile first
# finds their modules imported (importing them here would add about a second
# to `import compiler_collectives` for users of the eager backend); they are
# optional: on a torch without them the audit covers fewer levels and says so.

AUDIT_REQUIRED_SEAMS: tuple[tuple[str, str], ...] = (
    ("torch._dynamo.output_graph", "OutputGraph.call_user_compiler"),
    ("torch._guards", "CompileContext.try_get"),
    # --- entry agreement (issue 16) ---
    ("torch._guards", "CompileContext.__init__"),  # its compile_id and attempt: checked in _prepare
    ("torch._dynamo.types", "ConvertFrameReturn"),  # what _compile returns: its guarded_code, ditto
    ("torch.fx._lazy_graph_module", "_LazyGraphModule.force_recompile"),
    ("torch.compiler.config", "force_disable_caches"),  # the audit's recompile of cached levels
    # --- end entry agreement ---
)
REQUIRED_SEAMS = REQUIRED_SEAMS + AUDIT_REQUIRED_SEAMS

# (seam name, module, attribute path) of the optional levels.
AUDIT_BACKEND_SEAMS: tuple[tuple[str, str, str], ...] = (
    ("aot", "torch._dynamo.backends.common", "aot_module_simplified"),
    ("aot", "torch._functorch.aot_autograd", "SerializableAOTDispatchCompiler"),
    ("inductor", "torch._inductor.compile_fx", "_recursive_post_grad_passes"),
)

_audit_backends: dict[str, bool] = {}  # "aot"/"inductor" -> patched (False: seam missing)
_post_grad = threading.local()  # depth: post-grad passes recurse into subgraphs through our wrapper


def missing_audit_backend_seams() -> list[str]:
    """Optional audit seams the installed torch lacks (imports the backend modules)."""
    missing = []
    for _, module, path in AUDIT_BACKEND_SEAMS:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            missing.append(f"{module}:{path}")
    return missing


def _audit_applies(output_graph: Any) -> bool:
    if not (config.settings.audit and torch._dynamo.config.enable_compiler_collectives):
        return False
    if getattr(output_graph, "export", False) or not compiler_collective.groups.available():
        return False
    from torch._guards import CompileContext

    # A backend call outside a frame compile (a specialization compiled at run
    # time) happens on whichever ranks take that path: no exchange there.
    if CompileContext.try_get() is None:
        return False
    return torch.distributed.get_world_size() > 1


def _audited_call_user_compiler(self: Any, gm: Any, example_inputs: Any) -> Any:
    original = _originals["call_user_compiler"]
    if not _audit_applies(self):
        return original(self, gm, example_inputs)
    _ensure_audit_backend_seams()
    code = getattr(getattr(self, "root_tx", None), "f_code", None)
    frame = (FrameId(code.co_name, code.co_filename, code.co_firstlineno) if code is not None
             else FrameId("<unknown>", "<unknown>", 0))
    # --- entry agreement (issue 16): the program of the entry this graph belongs to ---
    compiled, program = audit.audit_graph_program(frame, gm, lambda: original(self, gm, example_inputs))
    if code is None:
        return compiled
    from torch._guards import CompileContext
    from torch.fx._lazy_graph_module import _LazyGraphModule

    # Dynamo compiles a lazy GraphModule's code right after this returns, which it
    # recognises only on the unwrapped object: do it here, as it would.
    lazy = compiled if isinstance(compiled, _LazyGraphModule) else getattr(compiled, "__self__", None)
    if isinstance(lazy, _LazyGraphModule) and (lazy is compiled or getattr(compiled, "__name__", "") == "_lazy_forward"):
        _LazyGraphModule.force_recompile(lazy)
        if lazy is not compiled:
            compiled = lazy.forward
    ctx = CompileContext.try_get()
    return entry_agreement.wrap(
        compiled, code, frame, str(ctx.compile_id), ctx.attempt, entry_agreement.GraphProgram(program),
        check=config.settings.entry_check and guard_hook_active(),
    )
    # --- end entry agreement ---


def _patch_backend(name: str, module_name: str) -> Any:
    """The module if every seam of ``name`` resolves in it, else None (logged once)."""
    import sys

    module = sys.modules.get(module_name)
    if module is None:
        return None
    missing = [f"{m}:{p}" for n, m, p in AUDIT_BACKEND_SEAMS if n == name and not _resolves(m, p)]
    if missing:
        _audit_backends[name] = False
        log.warning("program audit: torch %s lacks %s; the %s graphs are not audited",
                    torch.__version__, ", ".join(missing), name)
        return None
    _audit_backends[name] = True
    return module


def _resolves(module: str, path: str) -> bool:
    try:
        _resolve(module, path)
    except (ImportError, AttributeError):
        return False
    return True


def _ensure_audit_backend_seams() -> None:
    if len(_audit_backends) == 2:
        return
    if "aot" not in _audit_backends:
        common = _patch_backend("aot", "torch._dynamo.backends.common")
        if common is not None:
            from torch._functorch.aot_autograd import SerializableAOTDispatchCompiler

            _originals["aot_module_simplified"] = common.aot_module_simplified
            _originals["SerializableAOTDispatchCompiler"] = SerializableAOTDispatchCompiler
            common.aot_module_simplified = _audited_aot_module_simplified
    if "inductor" not in _audit_backends:
        compile_fx = _patch_backend("inductor", "torch._inductor.compile_fx")
        if compile_fx is not None:
            _originals["recursive_post_grad_passes"] = compile_fx._recursive_post_grad_passes
            compile_fx._recursive_post_grad_passes = _audited_post_grad_passes


def _audited_aot_module_simplified(mod: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
    original = _originals["aot_module_simplified"]
    scope = audit.aot_scope() if not rest else None
    if scope is None:
        return original(mod, args, *rest, **kwargs)
    _ensure_audit_backend_seams()  # inductor's backend imports compile_fx only once called
    for key, stage in (("fw_compiler", "forward"), ("inference_compiler", "inference"),
                       ("bw_compiler", "backward")):
        if kwargs.get(key) is not None:
            kwargs[key] = _audited_aot_compiler(kwargs[key], scope, stage)
    return original(mod, args, **kwargs)


def _audited_aot_compiler(compiler: Any, scope: Any, stage: str) -> Any:
    serializable = _originals["SerializableAOTDispatchCompiler"]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def audited_compiler(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
            return audit.aot_compile(scope, stage, gm, lambda: fn(gm, example_inputs, *args, **kwargs))

        return audited_compiler

    # Keep inductor's compiler serializable: AOTAutograd's cache only serves those.
    if isinstance(compiler, serializable):
        return serializable(compiler.output_code_ty, wrap(compiler.compiler_fn))
    return wrap(compiler)


def _audited_post_grad_passes(gm: Any, *args: Any, **kwargs: Any) -> Any:
    depth = getattr(_post_grad, "depth", 0)
    _post_grad.depth = depth + 1
    try:
        result = _originals["recursive_post_grad_passes"](gm, *args, **kwargs)
    finally:
        _post_grad.depth = depth
    if depth == 0:  # subgraphs are walked as part of their parent
        audit.inductor_graph(gm)
    return result


def _group_text(group_name: Any) -> str:
    """A functional collective's group as its member ranks (names are per-process bookkeeping)."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group, get_process_group_ranks

        return f"ranks {list(get_process_group_ranks(_resolve_process_group(group_name)))}"
    except Exception:  # noqa: BLE001 - an unknown name still compares by name
        return f"group {group_name!r}"


def _emit_artifact(name: str, payload_fn: Callable[[], str]) -> None:
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "json"},
        payload_fn=payload_fn,
        expect_trace_id=False,
    )


def _install_audit(output_graph: Any) -> None:
    _originals["call_user_compiler"] = output_graph.OutputGraph.call_user_compiler
    output_graph.OutputGraph.call_user_compiler = _audited_call_user_compiler
    fingerprint.set_group_resolver(_group_text)
    audit.set_artifact_sink(_emit_artifact)


def _uninstall_audit(output_graph: Any) -> None:
    output_graph.OutputGraph.call_user_compiler = _originals["call_user_compiler"]
    if _audit_backends.get("aot"):
        import torch._dynamo.backends.common as common

        common.aot_module_simplified = _originals["aot_module_simplified"]
    if _audit_backends.get("inductor"):
        import torch._inductor.compile_fx as compile_fx

        compile_fx._recursive_post_grad_passes = _originals["recursive_post_grad_passes"]
    _audit_backends.clear()
    fingerprint.set_group_resolver(None)
    audit.set_artifact_sink(None)
